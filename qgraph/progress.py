"""Progress feedback for the slow steps (export, compile, capture, save, load, generation): a
``tqdm.auto`` bar (a widget in a Jupyter kernel, a line on stderr on a terminal) that appears only once
a step has lasted ``delay`` seconds (``DELAY``, 2 s), so fast steps show nothing.

    from qgraph.progress import progress

    with progress("exporting Qwen3_5ForCausalLM"):            # one blocking step: a ticking timer
        program = torch.export.export(...)

    with progress("generating", total=max_new_tokens, unit="token") as bar:   # a loop: a bar
        for step in range(max_new_tokens):
            ...
            bar.update()

    with stages("qgraph: saving", ("export", "write")) as stage:   # a few opaque calls: a bar of stages
        stage("export")
        ...
        stage("write")
        ...

It shows in a Jupyter kernel (``in_kernel``) and when stderr is a terminal; it is silent elsewhere
(logs, pipes, tests) and when ``QGRAPH_PROGRESS=0``; ``QGRAPH_PROGRESS=1`` shows it everywhere.
"""
from __future__ import annotations

import builtins
import contextlib
import os
import sys
import threading

from tqdm import tqdm

DELAY = 2.0  # seconds a step runs before its line appears
_TICK = 0.25  # seconds between redraws of a blocking step's timer


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (notebook, JupyterLab, VS Code, Colab), whose streams are
    not terminals: IPython's shell there is a ``ZMQInteractiveShell`` (or a subclass of it); a terminal
    IPython's is not. IPython is not imported here: a kernel has imported it."""
    get_ipython = getattr(builtins, "get_ipython", None) or getattr(sys.modules.get("IPython"), "get_ipython", None)
    if get_ipython is None:
        return False
    try:
        shell = get_ipython()
    except Exception:  # a broken or half-started IPython: not a kernel to draw in
        return False
    return any(cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__)


def enabled(stream=None) -> bool:
    """Whether progress is shown: ``QGRAPH_PROGRESS`` (0 or 1) if set, else whether this runs in a
    Jupyter kernel or ``stream`` (default stderr) is a terminal."""
    setting = os.environ.get("QGRAPH_PROGRESS", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    if stream is None and in_kernel():
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


@contextlib.contextmanager
def progress(description: str, total: int | None = None, unit: str = "it", delay: float | None = None,
             bar_format: str | None = None):
    """Show ``description`` with the elapsed time (and a bar when ``total`` is given) if the block
    lasts longer than ``delay`` seconds (``DELAY`` when None); yields the tqdm object (``bar.update(n)``
    for loops; a disabled one, whose methods do nothing, when progress is off). See the module doc.

    The bar is redrawn every 0.25 s by a helper thread, so a single blocking call (an export, a
    compile, one slow generation step) still shows its time ticking; it is cleared at the end.
    """
    show = enabled()
    delay = DELAY if delay is None else delay
    if bar_format is None and total is None:
        bar_format = "{desc}: {elapsed}"
    if show:
        from tqdm.auto import tqdm as shown  # a widget in a Jupyter kernel (with ipywidgets), else a line
    bar = (shown if show else tqdm)(total=total, desc=description, unit=unit, delay=delay, disable=not show,
                                    leave=False, file=sys.stderr, bar_format=bar_format, dynamic_ncols=True)
    done = threading.Event()
    ticker = None
    if show:
        ticker = threading.Thread(target=_tick, args=(bar, done, delay), daemon=True, name="qgraph-progress")
        ticker.start()
    try:
        yield bar
        if bar.total is not None and bar.n < bar.total:  # done early (a loop's bound, not its length):
            bar.total = bar.n                            # full, not a failed bar in a notebook
    finally:
        done.set()
        if ticker is not None:
            ticker.join()
        bar.close()


@contextlib.contextmanager
def stages(description: str, names: tuple[str, ...]):
    """A step made of a few opaque calls (an export: trace, repeat blocks, save to the cache): a bar
    over ``names``, shown as ``progress`` shows it; yields ``stage``: ``stage(name)`` ends the stage
    running (the bar counts it) and names the next one on the bar."""
    layout = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    with progress(description, total=len(names), unit="stage", bar_format=layout) as bar:
        running: list[str] = []

        def stage(name: str) -> None:
            bar.set_postfix_str(name, refresh=False)  # drawn by the update or the next tick, past the delay
            if running:
                bar.update()
            running[:] = [name]

        yield stage
        if running:
            bar.update()


def _tick(bar, done: threading.Event, delay: float) -> None:
    """Redraw ``bar`` every tick once ``delay`` has passed, until ``done`` is set."""
    if done.wait(delay):
        return
    while not done.wait(_TICK):
        bar.refresh()

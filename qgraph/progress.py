"""Progress feedback for the slow steps (export, compile, generation): a tqdm line on stderr that
appears only once a step has lasted ``delay`` seconds (2 s by default), so fast steps print nothing.

    from qgraph.progress import progress

    with progress("exporting Qwen3_5ForCausalLM"):            # one blocking step: a ticking timer
        program = torch.export.export(...)

    with progress("generating", total=max_new_tokens, unit="token") as bar:   # a loop: a bar
        for step in range(max_new_tokens):
            ...
            bar.update()

It is silent when stderr is not a terminal (logs, pipes, tests) or when ``QGRAPH_PROGRESS=0``;
``QGRAPH_PROGRESS=1`` shows it even when stderr is not a terminal.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

from tqdm import tqdm

DELAY = 2.0  # seconds a step runs before its line appears
_TICK = 0.25  # seconds between redraws of a blocking step's timer


def enabled(stream=None) -> bool:
    """Whether progress lines are shown: ``QGRAPH_PROGRESS`` (0 or 1) if set, else whether
    ``stream`` (default stderr) is a terminal."""
    setting = os.environ.get("QGRAPH_PROGRESS", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


@contextlib.contextmanager
def progress(description: str, total: int | None = None, unit: str = "it", delay: float = DELAY):
    """Show ``description`` with the elapsed time (and a bar when ``total`` is given) on stderr if
    the block lasts longer than ``delay`` seconds; yields the tqdm object (``bar.update(n)`` for
    loops; a disabled one, whose methods do nothing, when progress is off). See the module doc.

    The line is redrawn every 0.25 s by a helper thread, so a single blocking call (an export, a
    compile, one slow generation step) still shows its time ticking; the line is cleared at the end.
    """
    show = enabled()
    bar_format = None if total is not None else "{desc}: {elapsed}"
    bar = tqdm(total=total, desc=description, unit=unit, delay=delay, disable=not show, leave=False,
               file=sys.stderr, bar_format=bar_format, dynamic_ncols=True)
    done = threading.Event()
    ticker = None
    if show:
        ticker = threading.Thread(target=_tick, args=(bar, done, delay), daemon=True, name="qgraph-progress")
        ticker.start()
    try:
        yield bar
    finally:
        done.set()
        if ticker is not None:
            ticker.join()
        bar.close()


def _tick(bar, done: threading.Event, delay: float) -> None:
    """Redraw ``bar`` every tick once ``delay`` has passed, until ``done`` is set."""
    if done.wait(delay):
        return
    while not done.wait(_TICK):
        bar.refresh()

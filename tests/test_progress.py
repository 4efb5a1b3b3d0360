"""Progress where people look (issue 28, item 2): long steps show a ``tqdm.auto`` bar in a Jupyter kernel
and on a terminal, nothing in a pipe or with ``QGRAPH_PROGRESS=0``; ``QGRAPH_PROGRESS=1`` forces it on.
A step made of a few opaque calls (export, save, load) is a bar of named stages."""
from __future__ import annotations

import builtins
import io
import re
import sys
import time

import pytest
import torch
import tqdm.auto

import qgraph.progress
from qgraph.capture import capture
from qgraph.progress import enabled, in_kernel, progress, stages


class ZMQInteractiveShell:  # the class of IPython's shell in a Jupyter kernel (ipykernel.zmqshell)
    pass


class Shell(ZMQInteractiveShell):  # Colab's shell subclasses it
    pass


class TerminalInteractiveShell:  # IPython on a terminal
    pass


@pytest.fixture
def shell(monkeypatch):
    """Install a fake ``get_ipython()`` returning an instance of the class given."""
    def install(cls):
        monkeypatch.setattr(builtins, "get_ipython", lambda: cls(), raising=False)
    monkeypatch.delenv("QGRAPH_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal, whatever pytest was given
    return install


def test_jupyter_kernel_detection(shell, monkeypatch):
    monkeypatch.delattr(builtins, "get_ipython", raising=False)
    assert not in_kernel() and not enabled()  # a pipe, no kernel: off
    shell(ZMQInteractiveShell)
    assert in_kernel() and enabled()  # a kernel's streams are no terminals: on all the same
    shell(Shell)
    assert in_kernel()
    shell(TerminalInteractiveShell)
    assert not in_kernel() and not enabled()
    shell(lambda: None)  # get_ipython() outside IPython
    assert not in_kernel()
    shell(ZMQInteractiveShell)
    monkeypatch.setenv("QGRAPH_PROGRESS", "0")
    assert not enabled()


def test_a_kernel_gets_the_tqdm_auto_bar(shell, monkeypatch):
    made = []

    class Recorded(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            made.append(kwargs["desc"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    with progress("in a pipe", delay=0):
        pass
    shell(ZMQInteractiveShell)
    with progress("in a kernel", delay=0):
        pass
    assert made == ["in a kernel"]


def _capture(model, tokenizer, out):
    return capture(model, tokenizer, ["one document", "and another, longer than the first one"], ["layers.0.layer_output"],
                   out, context=16, batch_size=2, dtype=torch.float32)


def test_capture_shows_a_bar_only_where_asked(sdpa_model, tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(qgraph.progress, "DELAY", 0)  # show at once
    monkeypatch.setenv("QGRAPH_PROGRESS", "1")  # stderr is pytest's, not a terminal: forced on
    run = _capture(sdpa_model, tokenizer, tmp_path / "shown")
    err = capsys.readouterr().err
    assert run.tokens > 0 and "capturing:" in err and "\r" in err  # a tqdm line, redrawn in place (what it
    # reads when drawn depends on the machine's speed: the count, or the timer before the first rows)
    monkeypatch.setenv("QGRAPH_PROGRESS", "0")
    _capture(sdpa_model, tokenizer, tmp_path / "off")
    assert capsys.readouterr().err == ""


def test_stages_count_named_stages(monkeypatch, capsys):
    monkeypatch.setenv("QGRAPH_PROGRESS", "1")
    with stages("saving", ("export", "write")) as stage:
        stage("export")
        time.sleep(0.15)
        stage("write")
    assert capsys.readouterr().err == ""  # shown past DELAY (2 s) only
    monkeypatch.setattr(qgraph.progress, "DELAY", 0)
    with stages("saving", ("export", "write", "write the weights")) as stage:
        stage("export")
        time.sleep(0.4)  # the helper thread redraws while a stage blocks
        stage("write")
        time.sleep(0.4)
    err = capsys.readouterr().err
    assert re.search(r"saving:   0%\|\s+\| 0/3 \[00:0\d, export\]", err), err
    assert re.search(r"saving:  33%\|.+\| 1/3 \[00:0\d, write\]", err), err
    monkeypatch.setenv("QGRAPH_PROGRESS", "0")
    with stages("silent", ("a", "b")) as stage:
        stage("a")
        time.sleep(0.3)
    assert capsys.readouterr().err == ""


def test_a_loop_that_ends_early_ends_full(monkeypatch):
    """A bound that was not reached (generation stopped at eos, a capture's data ran out) is no failure:
    the bar ends full (in a notebook a bar short of its total is drawn as failed)."""
    monkeypatch.setenv("QGRAPH_PROGRESS", "1")
    with progress("generating", total=5, delay=60) as bar:
        bar.update(2)
    assert (bar.n, bar.total) == (2, 2)
    with pytest.raises(KeyboardInterrupt):
        with progress("generating", total=5, delay=60) as bar:
            bar.update(2)
            raise KeyboardInterrupt
    assert (bar.n, bar.total) == (2, 5)


def test_progress_off_in_a_pipe(monkeypatch, capsys):
    monkeypatch.delenv("QGRAPH_PROGRESS", raising=False)
    monkeypatch.delattr(builtins, "get_ipython", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress("piped", delay=0) as bar:
        bar.update()
        time.sleep(0.3)
    assert sys.stderr.getvalue() == ""

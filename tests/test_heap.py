"""The C heap a call's values grew stays mapped for the next call, and ``release_buffers`` gives it back
(qgraph/kernels/heap.py: glibc on Linux)."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qgraph
from qgraph.kernels import heap

pytestmark = pytest.mark.skipif(heap.size() == 0, reason="the heap is glibc's on Linux only")

MIB = 1 << 20
# the scenario's exit status where its control fails: something torch or Python allocated while the values were
# made (a table grown, at a point that varies from run to run) stayed above them and pins the heap's top, so
# glibc trims nothing with or without qgraph
PINNED = 3


def _values(mib: int = 300) -> list[torch.Tensor]:
    """``mib`` MiB in 1 MiB tensors, written: what a call's values take from the heap."""
    values: list = [None] * mib  # the list's array first: grown as it filled, it would land among the values
    for i in range(mib):
        values[i] = torch.ones(MIB // 4)
    return values


def _resident() -> int:
    """The process's resident memory, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _faulted_mib(call) -> float:
    """MiB of pages the kernel faulted in while ``call()`` ran."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    call()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / MIB


def _kept_until_released() -> None:
    """The scenario, in a fresh process (``__main__`` below): there the values land at the heap's top,
    where glibc trims. In a long-lived process they may land in free chunks below it, never trimmed."""
    # the process's first tensors: what torch sets up at its first ops lands among them and stays, which would
    # keep the heap's top from being trimmed; then glibc's trim threshold: 64 MiB, nothing kept
    first = _values()
    del first
    heap.release()
    values = _values()
    resident = _resident()
    del values
    if _resident() > resident - 200 * MIB:  # the control: glibc gives the dropped values' heap back
        sys.exit(PINNED)

    values = _values()
    heap.keep()  # what a call does after it ran
    assert heap.kept() == heap.size() >= 300 * MIB
    resident = _resident()
    del values
    assert _resident() > resident - 10 * MIB  # kept
    again: list[torch.Tensor] = []
    assert _faulted_mib(lambda: again.extend(_values())) < 30  # the next values land in pages already there
    again.clear()
    heap.release()
    assert heap.kept() == 0 and _resident() < resident - 200 * MIB


@pytest.mark.slow  # fresh Python processes of its own: the slow tier
def test_the_heap_values_grew_stays_for_the_next_values_until_released():
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for _ in range(8):  # a process whose heap's top is pinned shows nothing either way: another one
        done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120, env=env)
        if done.returncode != PINNED:
            break
    assert done.returncode == 0, done.stderr[-3000:] or "in 8 processes the heap's top was pinned"


def test_a_call_keeps_its_heap_and_release_buffers_gives_it_back(sdpa_model):
    ig = qgraph.instrument(sdpa_model, values=["layers.*.layer_output"])
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    heap.release()
    held = _values(100)  # the heap past glibc's own 64 MiB, as a big capture's values make it
    out = ig(ids)
    assert heap.kept() >= 100 * MIB and heap.kept() == heap.size()
    del held, out
    ig.release_buffers()
    assert heap.kept() == 0


if __name__ == "__main__":
    _kept_until_released()

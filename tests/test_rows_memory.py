"""The rows store (qgraph/circuits/rows.py) reads its rows a bounded part at a time: the influence's
``|rows|`` and the kept columns give what a float64 computation on the whole matrix gives, and the
memory they take while they run, measured as the process's peak RSS (Linux: reset by
``/proc/self/clear_refs``), stays within ``rows.READ`` floats, however many rows and columns."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from qgraph.circuits.rows import READ, Rows

CLEAR_REFS = Path("/proc/self/clear_refs")
pytestmark = pytest.mark.skipif(not os.access(CLEAR_REFS, os.W_OK),
                                reason="the peak RSS is reset and read in /proc (Linux)")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _peak_rise(call):
    """``call()``'s result and how far the process's peak RSS rose over its RSS just before."""
    CLEAR_REFS.write_text("5")
    before = _status("VmRSS")
    result = call()
    return result, _status("VmHWM") - before


@pytest.fixture(scope="module", params=[None, "disk"])
def store(request):
    """300 rows of 60,000 active features (72 MB), random, in memory or in a file."""
    generator = torch.Generator().manual_seed(0)
    rows = Rows(300, 60_000, 40, 8, request.param)
    for part in range(3):
        rows.put({"features": torch.randn(100, 60_000, generator=generator),
                  "errors": torch.randn(100, 40, generator=generator),
                  "embeddings": torch.randn(100, 8, generator=generator), "constants": torch.zeros(100)},
                 list(range(100 * part, 100 * part + 100)))
    yield rows
    rows.close()


def test_the_influence_through_the_rows_reads_a_bounded_part_at_a_time(store):
    generator = torch.Generator().manual_seed(1)
    picked = torch.randperm(300, generator=generator)
    coefficients = torch.rand(300, generator=generator)
    store.spread(coefficients[:10], picked[:10])  # the first call's one-time costs
    spread, rise = _peak_rise(lambda: store.spread(coefficients, picked))
    whole = store.features[picked].double()
    magnitude = whole.abs().sum(1) + store.errors[picked].double().abs().sum(1) + \
        store.embeddings[picked].double().abs().sum(1)
    torch.testing.assert_close(spread.double(), (coefficients.double() / magnitude) @ whole.abs(), rtol=1e-5, atol=0)
    assert rise < READ * 4 + (4 << 20)  # one part of READ floats (16 MiB), not 256 whole rows (61 MB) twice


def test_the_kept_columns_are_gathered_without_copying_whole_rows(store):
    generator = torch.Generator().manual_seed(2)
    rows = torch.randperm(300, generator=generator)[:200].tolist()
    columns = torch.randperm(60_000, generator=generator)[:500].sort().values
    gathered, rise = _peak_rise(lambda: store.columns(rows, columns))
    assert torch.equal(gathered, store.features[torch.tensor(rows)][:, columns])
    assert rise < gathered.numel() * 4 + (8 << 20)  # the result and little more (whole rows: 48 MB)

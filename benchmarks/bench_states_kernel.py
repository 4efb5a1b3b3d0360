"""Benchmark: per-token DeltaNet states vs transformers' chunked gated delta rule kernel.

Shape of one Qwen3.5-0.8B Gated DeltaNet block over a 256-token prompt: batch 1, 16 key heads,
16 value heads, k_dim = v_dim = 128, float32. Compares, median of 5 runs after a warm-up (the
variants are interleaved so background load hits them alike):

* ``kernel``     transformers' ``torch_chunk_gated_delta_rule`` (output + final state);
* ``all``        ``chunk_gated_delta_rule_with_states`` keeping every state (256 MiB);
* ``all_4k_pages`` the same with ``qgraph.kernels.buffers.HUGE_PAGE_MIN_BYTES = None``, i.e. the
  states buffer from plain ``torch.empty`` (ordinary 4 KiB pages unless THP_MEM_ALLOC_ENABLE=1);
* ``all_bf16``   the same, states stored in bfloat16 (128 MiB);
* ``positions``  the same, keeping only the states after tokens 0, 128 and 255;
* ``pooled``     ``all`` writing into memory reused from the previous call (``BufferPool``), as an
  instrumented program does;
* ``pooled_torch`` the same with ``QGRAPH_NATIVE=0``: the torch path instead of ``states.c``.

Memory: each variant is also run once in a fresh process that reads the peak resident set
(``VmHWM``, reset through ``/proc/self/clear_refs``) around a single call; "extra" is that peak
minus the resident size before the call, and "temporaries" subtracts the call's outputs.

Fresh large allocations on CPU cost page faults on first touch, which on small VMs can cost as
much as the arithmetic; PyTorch can back them with transparent huge pages when the environment
variable ``THP_MEM_ALLOC_ENABLE=1`` is set, so timings are reported with and without it.

Usage: ``python benchmarks/bench_states_kernel.py [--seq 256] [--repeats 5]``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

from common import interleaved

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("kernel", "all", "all_4k_pages", "all_bf16", "positions", "pooled", "pooled_torch")


_MODULE = []


def _setup(seq):
    import torch

    # Load the kernels package by path: the benchmark measures this kernel only, independent of
    # whatever the rest of the package imports (qgraph/kernels/__init__.py imports nothing).
    if not _MODULE:
        folder = ROOT / "qgraph" / "kernels"
        spec = importlib.util.spec_from_file_location("qgraph_kernels", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["qgraph_kernels"] = package
        spec.loader.exec_module(package)
        _MODULE.extend(importlib.import_module(f"qgraph_kernels.{name}") for name in ("delta_states", "buffers"))
        _MODULE.append(_MODULE[1].BufferPool())
    delta_states, buffers, pool = _MODULE
    chunk_gated_delta_rule_with_states = delta_states.chunk_gated_delta_rule_with_states
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    batch, heads, dim = 1, 16, 128
    query = torch.randn(batch, seq, heads, dim, generator=gen)
    key = torch.randn(batch, seq, heads, dim, generator=gen)
    value = torch.randn(batch, seq, heads, dim, generator=gen)
    g = -torch.rand(batch, seq, heads, generator=gen) * 0.5  # model-like decays in (0.6, 1]
    beta = torch.rand(batch, seq, heads, generator=gen)
    positions = torch.tensor([0, seq // 2, seq - 1])
    args = (query, key, value, g, beta)

    calls = {
        "kernel": lambda: torch_chunk_gated_delta_rule(
            *args, output_final_state=True, use_qk_l2norm_in_kernel=True),
        "all": lambda: chunk_gated_delta_rule_with_states(*args),
        "all_4k_pages": lambda: _plain_pages(buffers, lambda: chunk_gated_delta_rule_with_states(*args)),
        "all_bf16": lambda: chunk_gated_delta_rule_with_states(*args, states_dtype=torch.bfloat16),
        "positions": lambda: chunk_gated_delta_rule_with_states(*args, positions=positions),
        "pooled": lambda: _pooled(buffers, pool, lambda: chunk_gated_delta_rule_with_states(*args)),
        "pooled_torch": lambda: _pooled(buffers, pool, lambda: chunk_gated_delta_rule_with_states(*args), native=False),
    }
    return torch, calls


def _pooled(module, pool, fn, native=True):
    saved = os.environ.pop("QGRAPH_NATIVE", None)
    if not native:
        os.environ["QGRAPH_NATIVE"] = "0"
    try:
        with module.reusing(pool):
            return fn()
    finally:
        os.environ.pop("QGRAPH_NATIVE", None)
        if saved is not None:
            os.environ["QGRAPH_NATIVE"] = saved


def _plain_pages(module, fn):
    saved, module.HUGE_PAGE_MIN_BYTES = module.HUGE_PAGE_MIN_BYTES, None
    try:
        return fn()
    finally:
        module.HUGE_PAGE_MIN_BYTES = saved


def _status_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child_time(seq, repeats):
    """Interleaved timings of every variant in this process; prints JSON {variant: seconds}."""
    torch, calls = _setup(seq)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = interleaved(calls, repeats=repeats)
    print(json.dumps(times))


def child_memory(seq, variant):
    """Peak resident memory of one call of ``variant`` in a fresh process; prints JSON (MiB)."""
    import gc

    torch, calls = _setup(seq)
    _, small = _setup(8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small[variant]()  # load lazily initialised libraries without touching big buffers
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _status_kib("VmRSS")
        result = calls[variant]()
        peak = _status_kib("VmHWM")
    outputs = sum(t.numel() * t.element_size() for t in result if t is not None)
    print(json.dumps({"extra": (peak - before) / 1024, "outputs": outputs / 2**20}))


def _run_child(argv, thp):
    env = dict(os.environ)
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    if thp:
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    done = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", choices=("time", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child == "time":
        return child_time(opts.seq, opts.repeats)
    if opts.child == "memory":
        return child_memory(opts.seq, opts.variant)

    import torch

    states_mib = opts.seq * 16 * 128 * 128 * 4 / 2**20
    print(f"gated delta rule, batch 1, seq {opts.seq}, 16 k/v heads, dims 128, fp32; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"all states = {states_mib:.0f} MiB fp32; load average {os.getloadavg()[0]:.2f}")
    for thp in (False, True):
        times = _run_child(["--child", "time", "--seq", str(opts.seq), "--repeats", str(opts.repeats)], thp)
        base = times["kernel"]
        print(f"\nTHP_MEM_ALLOC_ENABLE={int(thp)}: median of {opts.repeats} (after warm-up)")
        for name in VARIANTS:
            print(f"  {name:12s} {times[name] * 1e3:8.1f} ms   x{times[name] / base:5.2f} of kernel")
    print("\npeak resident memory of one call (fresh process, THP off), MiB:")
    for name in VARIANTS:
        mem = _run_child(["--child", "memory", "--seq", str(opts.seq), "--variant", name], False)
        print(f"  {name:12s} extra {mem['extra']:7.1f}   outputs {mem['outputs']:7.1f}   "
              f"temporaries {mem['extra'] - mem['outputs']:7.1f}")


if __name__ == "__main__":
    main()

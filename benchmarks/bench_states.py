"""A forward with `states` on every DeltaNet block vs the plain chunked forward (issue 4).

    python benchmarks/bench_states.py [--tokens 256]

0.8B shape, random weights, batch 1, under torch.no_grad(): the instrumented program capturing
every DeltaNet block's states (all tokens, float32) against the plain Hugging Face forward,
interleaved in one run (median of 5 after a warm-up); and the peak memory of one forward of each,
measured in a fresh child process per variant as the peak RSS (VmHWM, reset before the forward)
above the resting RSS. The timed loop drops each call's states before the next call, so the
program writes the next states into the same memory (``kernels.buffers.BufferPool``); the memory
measurement releases that memory first, so it counts the states' allocation.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import torch

import qgraph
from common import build_0_8b, interleaved


def memory_kib(field: str) -> int:
    """A field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident since the last reset)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def one_variant(variant: str, tokens: int) -> None:
    """Run a forward of ``variant`` in this (fresh) process; print its peak RSS above the resting RSS."""
    model = build_0_8b()
    ids = torch.randint(0, 1000, (1, tokens))
    ig = qgraph.instrument(model, values=["layers.*.linear_attn.states"]) if variant == "states" else None
    with torch.no_grad():
        out = model(input_ids=ids) if ig is None else ig(ids)  # warm-up (allocator, lazy inits)
        del out
        if ig is not None:
            ig.release_buffers()  # measure a forward that allocates its states afresh
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current RSS (Linux)
        resting = memory_kib("VmRSS")
        out = model(input_ids=ids) if ig is None else ig(ids)
    print(f"{(memory_kib('VmHWM') - resting) / 1024:.0f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--variant")
    args = parser.parse_args()
    if args.variant:
        return one_variant(args.variant, args.tokens)
    model = build_0_8b()
    ids = torch.randint(0, 1000, (1, args.tokens))
    states = qgraph.instrument(model, values=["layers.*.linear_attn.states"])
    with torch.no_grad():
        out = states(ids)
        blocks = len(out.values)
        size = sum(v.numel() * v.element_size() for v in out.values.values()) / 2**20
        del out
        times = interleaved({"plain": lambda: model(input_ids=ids), "states": lambda: states(ids)})
    print(f"{args.tokens} tokens, states on {blocks} DeltaNet blocks ({size:.0f} MiB of states)")
    print(f"plain HF forward {times['plain'] * 1e3:.0f} ms, with states {times['states'] * 1e3:.0f} ms, "
          f"ratio {times['states'] / times['plain']:.3f}")
    growth = {}
    for variant in ("plain", "states"):
        result = subprocess.run([sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens)],
                                capture_output=True, text=True, check=True)
        growth[variant] = float(result.stdout.strip().splitlines()[-1])
    print(f"peak memory of a forward above resting: plain {growth['plain']:.0f} MiB, states {growth['states']:.0f} MiB, "
          f"added {growth['states'] - growth['plain']:.0f} MiB (the states tensors are {size:.0f} MiB)")


if __name__ == "__main__":
    main()

"""The cost of a per-call edit at a value with no declared slot (issue 12), on the 0.8B shape.

    python benchmarks/bench_new_slots.py [--tokens 128]

A call with edits at undeclared values builds (once per set of slots) a program with those slots.
This times, on one instrumented model: the first call with a new slot set (build + forward), a later
call with the same set, a call with a declared slot, and a plain call; the later ones interleaved
(median of 5 after a warm-up), under torch.no_grad().
"""
from __future__ import annotations

import argparse
import time

import torch

import qgraph
from common import build_0_8b, interleaved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    model = build_0_8b()
    ids = torch.randint(0, 1000, (1, args.tokens))
    ig = qgraph.instrument(model, values=["layers.*.layer_output"], edits=["layers.5.layer_output"])
    declared = {"layers.5.layer_output": qgraph.Zero(positions=[0])}
    new = qgraph.skip_layers(8, 10)  # 6 undeclared slots
    with torch.no_grad():
        ig(ids)  # warm
        start = time.perf_counter()
        ig(ids, edits=new)
        first = time.perf_counter() - start
        times = interleaved({"plain": lambda: ig(ids), "declared slot": lambda: ig(ids, edits=declared),
                             "new slot set, later call": lambda: ig(ids, edits=new)})
    print(f"first call with a new slot set: {first * 1e3:8.1f} ms   ({first / times['plain']:.2f}x a plain call)")
    for name, seconds in times.items():
        print(f"{name:28} {seconds * 1e3:8.1f} ms   ratio {seconds / times['plain']:.3f}")


if __name__ == "__main__":
    main()

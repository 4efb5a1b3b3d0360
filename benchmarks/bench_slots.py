"""The cost of declared-but-unused edit slots (issue 3), on the 0.8B shape with random weights.

    python benchmarks/bench_slots.py [--tokens 128]

Forward time with 0, 1 and 24 declared slots (no edit given) against the same program with no
slot declaration, interleaved in one run (median of 5 after a warm-up), under torch.no_grad().
"""
from __future__ import annotations

import argparse

import torch

import qgraph
from common import build_0_8b, interleaved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    model = build_0_8b()
    values = ["layers.*.layer_output"]
    programs = {
        "no slots": qgraph.instrument(model, values=values),
        "0 slots declared": qgraph.instrument(model, values=values, edits=[]),
        "1 slot": qgraph.instrument(model, values=values, edits=["layers.5.layer_output"]),
        "24 slots": qgraph.instrument(model, values=values, edits=["layers.*.layer_output"]),
    }
    ids = torch.randint(0, 1000, (1, args.tokens))
    with torch.no_grad():
        times = interleaved({name: (lambda ig=ig: ig(ids)) for name, ig in programs.items()})
    base = times["no slots"]
    for name, seconds in times.items():
        print(f"{name:18} {seconds * 1e3:8.1f} ms   ratio {seconds / base:.3f}")


if __name__ == "__main__":
    main()

"""The cost of an edit that reads the forward (issue 55), on the 0.8B shape with random weights.

    python benchmarks/bench_reads.py [--tokens 128] [--repeats 7]

One per-call edit at ``layers.12.layer_output`` three ways, interleaved in one run (median after a
warm-up), under torch.no_grad(): ``Add(constant tensor)`` (the baseline: a tensor given with the call),
``Add(Read("layers.4.layer_output"))`` (the same shape read from the forward) and relative steering
(``Add(v, relative=True)``: the mean norm over the real tokens). Also the two-forward way a reading edit
took before (capture, then edit with the captured tensor), and the plain call with no edit.
"""
from __future__ import annotations

import argparse

import torch

import qgraph
from common import build_0_8b, interleaved

AT, READ = "layers.12.layer_output", "layers.4.layer_output"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = build_0_8b()
    ig = qgraph.instrument(model, values=[READ])
    ids = torch.randint(0, 1000, (1, args.tokens))
    constant = torch.randn(1, args.tokens, model.config.hidden_size)
    vector = torch.randn(model.config.hidden_size)

    def two_forwards():
        read = ig(ids)[READ]
        return ig(ids, edits={AT: qgraph.Add(read, scale=0.5)})

    runs = {
        "plain call": lambda: ig(ids),
        "Add(constant)": lambda: ig(ids, edits={AT: qgraph.Add(constant, scale=0.5)}),
        "Add(Read(...))": lambda: ig(ids, edits={AT: qgraph.Add(qgraph.Read(READ), scale=0.5)}),
        "Add(v, relative=True)": lambda: ig(ids, edits={AT: qgraph.Add(vector, scale=0.5, relative=True)}),
        "two forwards": two_forwards,
    }
    with torch.no_grad():
        times = interleaved(runs, repeats=args.repeats)
    base = times["Add(constant)"]
    for name, seconds in times.items():
        print(f"{name:24} {seconds * 1e3:9.1f} ms   ratio to Add(constant) {seconds / base:.3f}")


if __name__ == "__main__":
    main()

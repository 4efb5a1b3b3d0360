"""Patching sweeps: ``qgraph.patch(..., positions="each")`` against the naive loop, every layer_output x every position.

    python benchmarks/bench_patch.py [--shape medium|0.8b] [--tokens 16] [--repeats 3] [--every K] [--batch-sizes B ...]

The naive loop runs one full forward per location (``Replace`` of the clean value at that position,
as a researcher writes it by hand with per-call edits); the sweep runs the corrupt input once and then,
per value, only the blocks after the value's, the positions stacked along the batch. Both on batch 1,
``--tokens`` random tokens (clean and corrupt differ everywhere), metric = a logit difference at the last
position, under ``torch.no_grad()``; interleaved (naive, sweep, naive, ...) after one warm-up of each
(which builds the programs and cuts the patching program), median of ``--repeats``. Prints the load
average and the worst difference between the two (expected ~1e-6: stacked matrix products round
differently). ``--every K`` patches every K-th block's layer_output only (the naive loop on the 0.8B
shape is one full forward per location); ``--batch-sizes`` also times the sweep with that many
locations per pass.

Shapes: ``medium`` is 8 blocks (3 Gated DeltaNet + 1 attention, twice), hidden 512, 4 query / 2 key-value
heads of 128, DeltaNet 8 + 8 heads of 64, MLP 1536, vocab 32000; ``0.8b`` is Qwen3.5-0.8B's
(``common.build_0_8b``). Random weights, float32, sdpa.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_0_8b, interleaved  # noqa: E402

import qgraph  # noqa: E402


def build_medium():
    """The medium shape: Qwen3.5-0.8B's architecture at 8 blocks, hidden 512, vocab 32000."""
    return build_0_8b(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=4, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=8,
                      linear_key_head_dim=64, linear_value_head_dim=64,
                      layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("medium", "0.8b"), default="medium")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", type=int, default=1, help="patch every k-th block's layer_output (default: all)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                        help="also time the sweep with these locations per pass (default: patch's own choice)")
    args = parser.parse_args()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    model = build_medium() if args.shape == "medium" else build_0_8b()
    blocks, vocab = model.config.num_hidden_layers, model.config.vocab_size
    ig = qgraph.instrument(model)
    generator = torch.Generator().manual_seed(1)
    clean = torch.randint(0, vocab, (1, args.tokens), generator=generator)
    corrupt = torch.randint(0, vocab, (1, args.tokens), generator=generator)
    at = [f"layers.{i}.layer_output" for i in range(0, blocks, args.every)]

    def metric(logits):
        return logits[:, -1, 0].sum() - logits[:, -1, 1].sum()

    def naive():
        captured = ig.variant(at)(clean).values
        patcher = ig.variant((), edits=at)
        with torch.no_grad():
            return {name: torch.tensor([metric(patcher(corrupt, edits={name: qgraph.Replace(
                captured[name][:, [p]], positions=[p])}).logits).item() for p in range(args.tokens)]) for name in at}

    def sweep(batch_size=None):
        return qgraph.patch(ig, clean, corrupt, at, metric, positions="each", batch_size=batch_size)

    start = time.perf_counter()
    first = sweep()
    print(f"first sweep (builds the programs, cuts the patching one): {time.perf_counter() - start:.2f} s")
    expected = naive()
    worst = max((first[name] - expected[name]).abs().max().item() for name in at)
    print(f"{args.shape}: {blocks} blocks ({len(at)} layer_output patched), {args.tokens} tokens, {len(at) * args.tokens} locations; "
          f"worst |sweep - naive| = {worst:.1e}")
    print(f"load average before timing: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    runs = {"naive": naive, "sweep": sweep, **{f"sweep, batch_size={b}": (lambda b=b: sweep(b)) for b in args.batch_sizes}}
    times = interleaved(runs, repeats=args.repeats, warmup=0)
    print(f"load average after timing: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"naive loop: {times['naive']:.2f} s ({times['naive'] / (len(at) * args.tokens) * 1e3:.1f} ms per location)")
    for name in runs:
        if name != "naive":
            print(f"{name}: {times[name]:.2f} s ({times[name] / (len(at) * args.tokens) * 1e3:.1f} ms per location), "
                  f"{times[name] / times['naive']:.3f}x the naive loop")


if __name__ == "__main__":
    main()

"""qgraph.capture's throughput against the plain Hugging Face forward over the same batches (issue 14).

    python benchmarks/bench_capture.py [--context 128] [--batch-size 4] [--batches 2] [--repeats 3]

0.8B shape, random weights, float32 compute, every block's ``layer_output`` written as bfloat16.
Each capture run is one whole ``capture()`` call into a fresh temp dir (program build, packing,
forwards, writing, hashing, manifest: everything); the plain run is ``model(input_ids,
attention_mask)`` under ``torch.inference_mode`` over the same packed batches. The two are
interleaved (capture, plain, capture, plain, ...) after a warm-up, median of ``--repeats``.
Prints tokens/s of each, their ratio (goal: >= 1.0), and the bytes written against the values' bytes.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from common import build_0_8b, interleaved
from qgraph.capture import capture
from qgraph.capture.data import pack


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = build_0_8b()
    tokens = args.context * args.batch_size * args.batches
    half = max(1, args.context // 2)  # documents of half a row: boundaries inside rows, rows filled exactly
    documents = torch.randint(0, 1000, (tokens // half, half), generator=torch.Generator().manual_seed(0))
    rows = list(pack(documents.tolist(), args.context))
    batches = [(torch.stack([r.input_ids for r in rows[i:i + args.batch_size]]),
                torch.stack([r.attention_mask for r in rows[i:i + args.batch_size]]))
               for i in range(0, len(rows), args.batch_size)]
    real = sum(int(mask.sum()) for _, mask in batches)
    root = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    runs = []

    def run_capture():
        out = root / f"run{len(runs)}"
        runs.append(capture(model, None, documents, ["layers.*.layer_output"], out, context=args.context,
                            batch_size=args.batch_size, dtype=torch.bfloat16, progress=False))
        shutil.rmtree(out)

    def run_plain():
        with torch.inference_mode():
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask)

    try:
        times = interleaved({"capture": run_capture, "plain": run_plain}, repeats=args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    last = runs[-1]
    hidden, blocks = model.config.hidden_size, model.config.num_hidden_layers
    value_bytes = last.rows * args.context * hidden * blocks * torch.bfloat16.itemsize
    print(f"0.8B shape, {len(batches)} batches of {args.batch_size} x {args.context} tokens ({real} tokens), "
          f"torch threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"plain HF forward: {times['plain']:.2f} s, {real / times['plain']:.0f} tokens/s")
    print(f"capture (every layer_output, bf16, all written): {times['capture']:.2f} s, "
          f"{real / times['capture']:.0f} tokens/s")
    print(f"ratio capture / plain tokens/s: {times['plain'] / times['capture']:.2f}x")
    print(f"bytes written {last.bytes:,} = values {value_bytes:,} + metadata {last.bytes - value_bytes:,} "
          f"({(last.bytes - value_bytes) / last.bytes:.2%}); "
          f"{value_bytes / (last.rows * args.context) / blocks:,.0f} bytes per token per value")


if __name__ == "__main__":
    main()

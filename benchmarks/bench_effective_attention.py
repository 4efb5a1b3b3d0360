"""Every DeltaNet block's effective attention (and writes) vs the plain forward (issue 39).

    python benchmarks/bench_effective_attention.py [--tokens 256] [--repeats 5]

0.8B shape, random weights, batch 1, under torch.no_grad(): the plain Hugging Face forward, the
instrumented program returning the logits only, the program with every DeltaNet block's
``effective_attention``, and with every block's ``write_values`` (its kernel swapped for the writes
kernel), interleaved in one run (median of ``--repeats`` after a warm-up). Then the identity
``attention_head_outputs = A @ attention_values + initial_state_output``: its worst error per block,
relative to the block's largest output.
"""
from __future__ import annotations

import argparse

import torch

import qgraph
from common import build_0_8b, interleaved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = build_0_8b()
    ids = torch.randint(0, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    plain = qgraph.instrument(model, values=["logits"])
    attention = qgraph.instrument(model, values=["layers.*.linear_attn.effective_attention"])
    writes = qgraph.instrument(model, values=["layers.*.linear_attn.write_values"])
    with torch.no_grad():
        times = interleaved({"hf": lambda: model(input_ids=ids), "qgraph": lambda: plain(ids),
                             "effective_attention": lambda: attention(ids), "write_values": lambda: writes(ids)},
                            repeats=args.repeats)
    print(f"{args.tokens} tokens, median of {args.repeats}:")
    for name, seconds in times.items():
        print(f"  {name:>20}: {seconds:.3f} s  ({seconds / times['hf']:.2f}x the HF forward, "
              f"{seconds / times['qgraph']:.2f}x qgraph's)")
    blocks = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    names = [f"layers.{i}.linear_attn.{part}" for i in blocks
             for part in ("effective_attention", "initial_state_output", "attention_values", "attention_head_outputs")]
    with torch.no_grad():
        out = qgraph.instrument(model, values=names)(ids)
    errors = []
    for i in blocks:
        p = f"layers.{i}.linear_attn"
        rebuilt = torch.einsum("bhts,bshd->bthd", out[f"{p}.effective_attention"], out[f"{p}.attention_values"].float())
        rebuilt = rebuilt + out[f"{p}.initial_state_output"]
        outputs = out[f"{p}.attention_head_outputs"].float()
        errors.append(float((rebuilt - outputs).abs().max() / outputs.abs().max()))
    print("identity, worst error / largest output, per DeltaNet block:")
    print("  " + " ".join(f"{i}:{e:.1e}" for i, e in zip(blocks, errors)))
    print(f"  worst {max(errors):.2e}")


if __name__ == "__main__":
    main()

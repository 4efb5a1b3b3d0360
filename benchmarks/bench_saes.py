"""The forward with an SAE spliced at every block vs the plain forward (issue 15).

    python benchmarks/bench_saes.py [--tokens 128] [--compile]

0.8B shape, random weights, batch 1, under torch.no_grad(). One random TopK SAE (Qwen-Scope format,
d_sae = 16 x hidden = 16384, k = 50) is spliced at every block's layer_output, and every block's
features are captured (so every splice runs; with the error term kept the logits are the model's).
Also the sparse form (``activations`` and ``indices``, k per token) captured instead of the dense features.
Interleaved in one run, median of 3 after a warm-up; ``--compile`` adds the compiled programs.
Memory added: the SAEs' parameters (the blocks' SAEs share one SAE's weights here, so its bytes are
counted once per block as 24 separate SAEs would take) and the captured features.
"""
from __future__ import annotations

import argparse
import tempfile

import torch

import qgraph
from common import build_0_8b, interleaved
from qgraph.saes import SAE
from qgraph.saes.fixtures import write_qwen_scope


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    model = build_0_8b()
    hidden, blocks = model.config.hidden_size, model.config.num_hidden_layers
    with tempfile.TemporaryDirectory() as folder:
        sae = SAE.load(write_qwen_scope(folder, layer=0, d_in=hidden, d_sae=16 * hidden, k=50), layer=0, k=50)
    # one SAE's weights, shared by an SAE record per block (each names the value it reads)
    saes = {f"layers.{i}.layer_output": SAE(sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec, "topk", k=50,
                                            topk_relu=False, hook=f"layers.{i}.layer_output") for i in range(blocks)}
    values = [f"layers.{i}.sae.features" for i in range(blocks)]
    sparse = [f"layers.{i}.sae.{part}" for i in range(blocks) for part in ("activations", "indices")]
    ids = torch.randint(0, 1000, (1, args.tokens))
    plain = qgraph.instrument(model)
    spliced = qgraph.instrument(model, values=values, saes=saes)
    runs = {"HF forward": lambda: model(input_ids=ids), "instrumented, no SAE": lambda: plain(ids),
            "SAE at every block": lambda: spliced(ids)}
    sparse_run = qgraph.instrument(model, values=sparse, saes=saes)
    runs["SAE at every block, sparse"] = lambda: sparse_run(ids)
    if args.compile:
        plain_compiled = qgraph.instrument(model, compile=True)
        compiled = qgraph.instrument(model, values=values, saes=saes, compile=True)
        runs["instrumented, no SAE, compiled"] = lambda: plain_compiled(ids)
        runs["SAE at every block, compiled"] = lambda: compiled(ids)
    with torch.no_grad():
        assert torch.equal(spliced(ids).logits, plain(ids).logits)  # the error term is kept
        times = interleaved(runs, repeats=3)
    base = times["HF forward"]
    for name, seconds in times.items():
        print(f"{name:32s} {seconds * 1000:9.0f} ms  {seconds / base:5.2f}x")
    sae_bytes = sum(p.numel() * p.element_size() for p in sae.parameters()) * blocks
    feature_bytes = blocks * args.tokens * sae.d_sae * 4
    sparse_bytes = blocks * args.tokens * sae.k * 8
    print(f"memory added: SAE parameters {sae_bytes / 2**20:.0f} MiB ({blocks} x d_sae {sae.d_sae}), "
          f"captured features {feature_bytes / 2**20:.0f} MiB dense, {sparse_bytes / 2**20:.1f} MiB sparse")


if __name__ == "__main__":
    main()

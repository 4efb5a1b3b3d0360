"""instrument() time and node counts, and the cost of capturing every layer_output.

    python benchmarks/bench_foundation.py [--tokens 128]

On the tiny checkpoint and on the 0.8B shape (random weights): instrument() cold (export) and warm
(cached export), graph nodes, and the forward time of the program capturing every layer_output
against the plain Hugging Face forward, interleaved in one run (median of 5 after a warm-up).
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

import qgraph
from common import build_0_8b, interleaved


def measure(name, model, tokens):
    start = time.perf_counter()
    ig = qgraph.instrument(model, values=["layers.*.layer_output"])
    cold = time.perf_counter() - start
    start = time.perf_counter()
    qgraph.instrument(model, values=["layers.*.layer_output"])
    warm = time.perf_counter() - start
    exported = len(ig.exported.graph.nodes)
    ids = torch.randint(0, 200, (1, tokens))
    with torch.no_grad():
        assert torch.allclose(ig(ids).logits, model(input_ids=ids).logits, atol=1e-5)
        times = interleaved({"plain": lambda: model(input_ids=ids), "qgraph": lambda: ig(ids)})
    print(f"{name}: instrument() cold {cold:.1f} s (export {ig.exported.seconds:.1f} s), warm {warm:.2f} s; "
          f"exported graph {exported} nodes (with port markers), program {len(ig.graph.nodes)} nodes")
    print(f"{name}: {tokens} tokens: plain HF {times['plain'] * 1e3:.1f} ms, qgraph every layer_output "
          f"{times['qgraph'] * 1e3:.1f} ms, ratio {times['qgraph'] / times['plain']:.3f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM
    from qgraph.testing import tiny_qwen3_5
    with tempfile.TemporaryDirectory() as tmp:
        measure("tiny", AutoModelForCausalLM.from_pretrained(tiny_qwen3_5(tmp)).eval(), args.tokens)
    measure("0.8B shape", build_0_8b(), args.tokens)


if __name__ == "__main__":
    main()

"""``qgraph.circuits.estimate`` against the measured peak of the estimate and the call it estimates.

    python benchmarks/bench_estimate.py --shape tiny --tokens 16 --max-feature-nodes 60
    python benchmarks/bench_estimate.py --shape 8x128 --tokens 64 --max-feature-nodes 400
    python benchmarks/bench_estimate.py --shape 0.8b --tokens 16 --max-feature-nodes 64

Shapes (random weights, float32): ``tiny`` (qgraph.testing's tiny Qwen3.5: 4 blocks, hidden 64, vocab 272),
``8x128`` (the 0.8B config with 8 blocks of hidden 128, intermediate 512, vocab 248320), ``0.8b`` (24
blocks, hidden 1024, vocab 248320). Random TopK transcoders at every block (8 x hidden features, k = 32
as bench_circuits.py, or ``--k``). In one fresh process: the peak RSS is reset (``/proc/self/clear_refs`` 5), the
estimate runs, then the call; "measured" is the highest RSS of the two over the RSS just before the
estimate (``VmHWM``), what the pair adds to a process that has not exported the model; "call alone" is
the call's peak over the RSS after the estimate (the export and what the estimate's forward left held).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_circuits import _status, reset_peak, transcoders  # noqa: E402
from common import build_0_8b  # noqa: E402

import qgraph  # noqa: E402
from qgraph.circuits import attribute  # noqa: E402


def model_of(shape: str):
    if shape == "tiny":
        from transformers import Qwen3_5ForCausalLM
        from qgraph.testing import tiny_text_config
        torch.manual_seed(0)
        return Qwen3_5ForCausalLM(tiny_text_config()).eval()
    if shape == "8x128":
        return build_0_8b(hidden_size=128, intermediate_size=512, num_hidden_layers=8,
                          layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    return build_0_8b()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=("tiny", "8x128", "0.8b"), required=True)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--max-feature-nodes", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--offload", choices=("disk",), default=None)
    parser.add_argument("--k", type=int, default=32, help="the transcoders' TopK k (active features a token and block)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = model_of(args.shape)
    text = model.config
    tcs = transcoders(text.hidden_size, text.num_hidden_layers, 8 * text.hidden_size, args.k)
    ids = torch.randint(0, text.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1))
    options = dict(batch_size=args.batch_size, max_feature_nodes=args.max_feature_nodes, offload=args.offload)
    passes = []
    backward = attribute._Run._backward
    attribute._Run._backward = lambda run, chunk: passes.append(len(chunk)) or backward(run, chunk)
    gc.collect()
    before = reset_peak()
    start = time.perf_counter()
    estimate = qgraph.circuits.estimate(model, ids, tcs, **options)
    estimate_seconds = time.perf_counter() - start
    estimate_peak = _status("VmHWM") - before
    after_estimate = reset_peak()
    start = time.perf_counter()
    graph = qgraph.attribution_graph(model, ids, tcs, **options)
    seconds = time.perf_counter() - start
    peak = max(estimate_peak, _status("VmHWM") - before)
    mib = 2 ** 20
    print(json.dumps({
        "shape": args.shape, "tokens": args.tokens, "k": args.k, "load": os.getloadavg(), **options,
        "graph": repr(graph), "seconds": round(seconds, 1), "estimate_seconds": round(estimate_seconds, 1),
        "estimate_mib": round(estimate.bytes / mib, 1),
        "parts_mib": {name: round(size / mib, 1) for name, size in estimate.parts.items()},
        "measured_mib": round(peak / mib, 1), "estimate_vs_measured": round(estimate.bytes / peak - 1, 3),
        "estimate_peak_mib": round(estimate_peak / mib, 1),
        "call_alone_mib": round((_status("VmHWM") - after_estimate) / mib, 1),
        "passes": len(passes), "estimate_passes": estimate.backward_passes}))


if __name__ == "__main__":
    main()

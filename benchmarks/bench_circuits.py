"""Attribution graphs on the 0.8B shape: batched backward passes against one backward per target.

    python benchmarks/bench_circuits.py --mode batched --targets 512     # rate of batch_size rows per backward
    python benchmarks/bench_circuits.py --mode single --targets 32       # rate of one backward per target
    python benchmarks/bench_circuits.py --mode full                      # the whole graph (every active feature)
    python benchmarks/bench_circuits.py --mode full --tokens 512 --max-feature-nodes 2048   # a long prompt

The 0.8B shape (24 blocks, hidden 1024, vocab 248320) with random weights, a 16-token prompt, random TopK
transcoders at every block (8 x hidden = 8192 features, k = 32: 32 active features per token and block,
12288 feature targets and the logit targets). Each mode runs in its own process so its peak RSS is its
own; the rate modes time ``rows(targets)`` for ``--targets`` targets spread evenly over all of them
(logits, then features block by block) after the one forward of the replacement model, and
extrapolate to every target.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_0_8b  # noqa: E402

import qgraph  # noqa: E402
from qgraph.circuits.attribute import salient_logits, replacement_run  # noqa: E402


def transcoders(width: int, blocks: int, features: int, k: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    made = {}
    for block in range(blocks):
        made[block] = qgraph.Transcoder(
            torch.randn(width, features, generator=generator) / width ** 0.5, torch.zeros(features),
            torch.randn(features, width, generator=generator) / features ** 0.5, torch.zeros(width),
            "topk", k=k, layer=block)
    return made


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: resident now, VmHWM: the peak since the last reset)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status")


def reset_peak() -> int:
    """Resets the process's peak RSS to what it holds now (Linux: clear_refs 5); returns that."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _status("VmRSS")


def added_since(before: int) -> float:
    """GiB the peak RSS since ``reset_peak`` rose over ``before`` (the memory the call added)."""
    return (_status("VmHWM") - before) / 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("batched", "single", "full"), required=True)
    parser.add_argument("--targets", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--max-feature-nodes", type=int, default=None, help="--mode full: the features kept")
    parser.add_argument("--offload", choices=("disk",), default=None, help="--mode full: the rows in a file")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = build_0_8b()
    text = model.config
    tcs = transcoders(text.hidden_size, text.num_hidden_layers, 8 * text.hidden_size, 32)
    ids = torch.randint(0, text.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1))
    result = {"mode": args.mode, "tokens": args.tokens, "load": os.getloadavg()}
    if args.mode == "full":
        options = dict(batch_size=args.batch_size, max_feature_nodes=args.max_feature_nodes, offload=args.offload)
        start = time.perf_counter()
        estimate = qgraph.circuits.estimate(model, ids, tcs, **options)
        result.update(estimate_seconds=time.perf_counter() - start, estimate=repr(estimate),
                      estimate_gib=estimate.bytes / 2 ** 30, estimate_passes=estimate.backward_passes)
    before = reset_peak()
    if args.mode == "full":
        start = time.perf_counter()
        graph = qgraph.attribution_graph(model, ids, tcs, **options)
        result.update(seconds=time.perf_counter() - start, graph=repr(graph))
        rows = [i for i, node in enumerate(graph.nodes) if node.kind in ("feature", "logit")]
        total = graph.adjacency[rows].sum(1) + graph.constants[rows]
        scale = graph.adjacency[rows].abs().sum(1) + graph.constants[rows].abs()
        result["completeness"] = float(((total - graph.node_inputs[rows]).abs() / scale).max())
    else:
        batch = args.batch_size if args.mode == "batched" else 1
        start = time.perf_counter()
        run = replacement_run(model, ids, tcs, batch)
        forward = time.perf_counter() - start
        logit_ids, _ = salient_logits(run.logits[0, -1].detach(), 10, 0.95)
        active = run.active()
        targets = [("logit", int(t)) for t in logit_ids] + [("feature", tuple(f)) for f in active.tolist()]
        step = max(1, len(targets) // args.targets)
        sample = targets[::step][:args.targets]  # spread over the blocks: a deep target's backward costs more
        start = time.perf_counter()
        run.rows(sample)
        seconds = time.perf_counter() - start
        per_target = seconds / len(sample)
        result.update(forward_seconds=forward, timed_targets=len(sample), seconds=seconds,
                      per_target=per_target, all_targets=len(targets),
                      extrapolated_seconds=forward + per_target * len(targets))
    result["added_gib"] = added_since(before)  # the call's peak RSS over the process's RSS just before it
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(json.dumps(result))


if __name__ == "__main__":
    main()

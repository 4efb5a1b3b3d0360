"""Each attribution target only as long as it needs: the backward of a target at position p through the
segments up to p's (``qgraph.circuits.segments``) against the one-pass forward's backward over every
position (today's, ``SEGMENT`` set past the prompt's length), on the 0.8B shape.

    python benchmarks/bench_targets.py --tokens 128 --repeats 5 --threads 1
    python benchmarks/bench_targets.py --tokens 512 --repeats 3 --positions 8 --threads 1 --graph 8

The 0.8B shape (24 blocks, hidden 1024, vocab 248320), random weights, float32, random TopK transcoders at
every block (8192 features, k = 32: the same active features at every position), one process. Both runs
of the replacement model are made first (each forward timed, and what it adds to the peak RSS and what
autograd saves for it measured), then held together so that their targets interleave: for each of
``--positions`` positions spread over the prompt, one active feature there (at a block chosen in turn),
and the last position's logits; each target runs alone (``rows([target])``), one-pass then segmented, and
the same targets then run together through ``rows`` (its batching by position, ``--batch-size``) in each
run, ``--repeats`` rounds, the median of each. Every row of the two runs is compared (max |difference|
over the rows' largest |value|), and both runs' logits at the last position with the HF forward's.
Features are active at every position alike, so the mean over positions is the per-target time of a
realistic target set (every active feature plus the last position's logits: the logits are 10 of
tens of thousands of targets).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's qgraph
from bench_circuits import added_since, reset_peak, transcoders  # noqa: E402
from common import build_0_8b  # noqa: E402

import qgraph  # noqa: E402
from qgraph.circuits import segments  # noqa: E402
from qgraph.circuits.influence import influence  # noqa: E402
from qgraph.circuits.attribute import replacement_run, salient_logits  # noqa: E402
from qgraph.circuits.memory import SavedBytes  # noqa: E402


def make_run(model, ids, tcs, batch: int, segment: int) -> tuple:
    """The replacement run with segments of ``segment`` tokens: (run, forward seconds, GiB its peak RSS
    added, GiB autograd saved)."""
    segments.SEGMENT = segment
    counter = SavedBytes(keep=True)
    before = reset_peak()
    start = time.perf_counter()
    run = replacement_run(model, ids, tcs, batch, counter)
    seconds = time.perf_counter() - start
    return run, seconds, added_since(before), counter.bytes / 2 ** 30


def timed(run, targets) -> tuple[float, dict]:
    start = time.perf_counter()
    rows = run.rows(targets)
    return time.perf_counter() - start, rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--positions", type=int, default=8, help="positions spread over the prompt, a feature at each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--graph", type=int, default=0, help="then a graph of this many features each way, compared")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (1 on a shared machine: its ratios are the work's, not the contention's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_0_8b()
    text = model.config
    tcs = transcoders(text.hidden_size, text.num_hidden_layers, 8 * text.hidden_size, 32)
    ids = torch.randint(0, text.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1))
    result: dict = {"tokens": args.tokens, "segment": segments.SEGMENT, "threads": args.threads,
                    "load_start": os.getloadavg()}
    with torch.no_grad():
        hf_last = model(ids[None]).logits[0, -1].float()
    runs, default = {}, segments.SEGMENT
    for name, segment in (("one_pass", args.tokens + 1), ("segmented", default)):
        run, seconds, added, saved = make_run(model, ids, tcs, args.batch_size, segment)
        runs[name] = run
        result[name] = {"forward_s": seconds, "added_gib": added, "saved_gib": saved, "chunk": run.chunk,
                        "segments": len(run.starts),
                        "logits_vs_hf": float((run.logits[0, -1].float() - hf_last).abs().max())}
    segments.SEGMENT = default
    active = runs["one_pass"].active()
    assert torch.equal(active, runs["segmented"].active()), "the runs' active features differ"
    logit_ids, _ = salient_logits(runs["one_pass"].logits[0, -1], 10, 0.95)
    positions = [int((i + 0.5) * args.tokens / args.positions) for i in range(args.positions)]
    targets = []
    for i, position in enumerate(positions):
        here = active[(active[:, 1] == position) & (active[:, 0] == (5 * i + 3) % text.num_hidden_layers)]
        targets.append(("feature", tuple(here[0].tolist())))
    targets.append(("logit", int(logit_ids[0])))
    times: dict = {name: {i: [] for i in range(len(targets))} for name in runs}
    batched: dict = {name: [] for name in runs}
    worst, largest = 0.0, 0.0
    for repeat in range(args.repeats):
        for i, target in enumerate(targets):
            rows = {}
            for name, run in runs.items():
                seconds, rows[name] = timed(run, [target])
                times[name][i].append(seconds)
            for part in rows["one_pass"]:
                worst = max(worst, float((rows["one_pass"][part] - rows["segmented"][part]).abs().max()))
                largest = max(largest, float(rows["one_pass"][part].abs().max()))
        for name, run in runs.items():
            batched[name].append(timed(run, targets[:-1])[0] / (len(targets) - 1))
        print(f"round {repeat + 1} done, load {os.getloadavg()}", file=sys.stderr, flush=True)
    by_position = []
    for i, (kind, what) in enumerate(targets):
        one, cut = (statistics.median(times[name][i]) for name in ("one_pass", "segmented"))
        by_position.append({"target": kind, "position": args.tokens - 1 if kind == "logit" else what[1],
                            "block": None if kind == "logit" else what[0], "one_pass_s": one, "segmented_s": cut,
                            "ratio": cut / one})
    features = by_position[:-1]
    mean = {name: statistics.mean(row[f"{name}_s"] for row in features) for name in ("one_pass", "segmented")}
    result.update(by_position=by_position, mean_feature_s=mean, mean_ratio=mean["segmented"] / mean["one_pass"],
                  batched_per_target_s={name: statistics.median(values) for name, values in batched.items()},
                  rows_max_difference=worst, rows_largest=largest, load_end=os.getloadavg())
    result["batched_ratio"] = result["batched_per_target_s"]["segmented"] / result["batched_per_target_s"]["one_pass"]
    if args.graph:
        del runs, run
        result["graph"] = compare_graphs(model, ids, tcs, args.graph, args.batch_size, default)
    print(json.dumps(result, indent=1))


def compare_graphs(model, ids, tcs, features: int, batch: int, segment: int) -> dict:
    """The graph with ``features`` features made both ways: its nodes, and the max |difference| of its
    adjacency and of its nodes' influence on the logits, each over its largest |value|."""
    graphs, seconds = {}, {}
    for name, length in (("one_pass", len(ids) + 1), ("segmented", segment)):
        segments.SEGMENT = length
        start = time.perf_counter()
        graphs[name] = qgraph.attribution_graph(model, ids, tcs, max_feature_nodes=features, batch_size=batch)
        seconds[name] = time.perf_counter() - start
    segments.SEGMENT = segment
    one, cut = graphs["one_pass"], graphs["segmented"]
    same = [n.node_id for n in one.nodes] == [n.node_id for n in cut.nodes]
    weights = torch.tensor([n.probability if n.kind == "logit" else 0.0 for n in one.nodes])
    influences = {name: influence(graph.adjacency, weights) for name, graph in graphs.items()}
    return {"features": features, "seconds": seconds, "same_nodes": same,
            "adjacency_max_difference": float((one.adjacency - cut.adjacency).abs().max()),
            "adjacency_largest": float(one.adjacency.abs().max()),
            "influence_max_difference": float((influences["one_pass"] - influences["segmented"]).abs().max()),
            "influence_largest": float(influences["one_pass"].abs().max())}


if __name__ == "__main__":
    main()

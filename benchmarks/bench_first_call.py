"""The first value: ``qgraph.instrument`` + the first call in a fresh process, from an empty disk cache and
from the disk cache; a new edit-slot set; nnsight's first trace beside them (issue 56).

    python benchmarks/bench_first_call.py [--rounds 5] [--shape tiny|0.8b] [--before DIR] [--threads 1]

Each figure comes from a fresh Python process that has imported torch and transformers and loaded the
model (not timed: a researcher has the model before qgraph), then times ``import qgraph`` +
``qgraph.instrument(model, ["layers.*.layer_output"])`` (qgraph's modules load on first use) and the first
call on 16 tokens; then, in the same process, a call with an edit at an undeclared value (a new edit-slot
set: its program is built then) less a plain call. "empty cache" points ``$QGRAPH_CACHE`` at a new
directory (a fresh export, written to it), "from cache" at one an earlier process filled. nnsight 0.8.1
(when installed): ``NNsight(model)`` and its first trace saving every block output. ``--before DIR`` runs
the same children on another checkout of qgraph (e.g. a worktree of an older commit), interleaved with
this one round by round. Printed: the median of ``--rounds`` rounds per row, and the load average.
The tiny model is ``qgraph.testing.tiny_qwen3_5`` (4 blocks); ``--shape 0.8b`` builds the 0.8B shape with
random weights in each child (about 3 GiB; its build is not timed). The children write Python's bytecode
cache as a user's Python does (this machine sets ``PYTHONDONTWRITEBYTECODE``, which the children drop):
otherwise every process compiles qgraph's modules from source, about 0.3 s of each first call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, sys, time
root, shape, checkpoint, kind, threads = sys.argv[1:6]
sys.path.insert(0, root)
sys.path.insert(1, root + "/benchmarks")
import torch
torch.set_num_threads(int(threads))
import transformers
if shape == "tiny":
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
else:
    from common import build_0_8b
    model = build_0_8b()
ids = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(0))
times = {}
if kind == "nnsight":
    start = time.perf_counter()
    from nnsight import NNsight
    wrapped = NNsight(model)
    with torch.no_grad(), wrapped.trace(input_ids=ids):
        saved = [layer.output.save() for layer in wrapped.model.layers]
    times["first value"] = time.perf_counter() - start
else:
    start = time.perf_counter()
    import qgraph
    ig = qgraph.instrument(model, ["layers.*.layer_output"])
    times["instrument"] = time.perf_counter() - start
    with torch.no_grad():
        start = time.perf_counter()
        ig(ids)
        times["first call"] = time.perf_counter() - start
        times["first value"] = times["instrument"] + times["first call"]
        plain = []
        for _ in range(3):
            start = time.perf_counter()
            ig(ids)
            plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        ig(ids, edits={"layers.1.layer_output": qgraph.Zero(positions=[0])})
        times["new slot set"] = time.perf_counter() - start - min(plain)
    times["from cache"] = bool(ig.exported.from_cache)
print("RESULT " + json.dumps(times))
'''


def child(root: Path, shape: str, checkpoint: str, kind: str, cache: str, threads: int) -> dict:
    environment = {**os.environ, "QGRAPH_CACHE": cache, "QGRAPH_PROGRAM_CACHE": "1"}
    environment.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's Python keeps compiled modules (this machine's not)
    done = subprocess.run([sys.executable, "-c", CHILD, str(root), shape, checkpoint, kind, str(threads)],
                          capture_output=True, text=True, env=environment, cwd=tempfile.gettempdir())
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the child failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shape", choices=["tiny", "0.8b"], default="tiny")
    parser.add_argument("--before", type=Path, help="another qgraph checkout, measured the same way")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-nnsight", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from qgraph.testing import tiny_qwen3_5
    work = Path(tempfile.mkdtemp(prefix="qgraph-first-call-"))
    checkpoint = str(tiny_qwen3_5(work / "tiny")) if args.shape == "tiny" else ""
    roots = {"now": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    filled = {name: str(work / f"cache-{name}") for name in roots}
    for name, root in roots.items():  # fill each checkout's disk cache (and its modules' bytecode) once
        child(root, args.shape, checkpoint, "qgraph", filled[name], args.threads)
    rows: dict[str, list[float]] = {}
    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}")
    for round_ in range(args.rounds):
        for name, root in roots.items():
            empty = str(work / f"empty-{name}-{round_}")
            for label, cache in (("empty cache", empty), ("from cache", filled[name])):
                result = child(root, args.shape, checkpoint, "qgraph", cache, args.threads)
                assert result["from cache"] == (label == "from cache"), result
                for key in ("instrument", "first call", "first value", "new slot set"):
                    rows.setdefault(f"{name}, {label}: {key}", []).append(result[key])
        if not args.no_nnsight:
            try:
                result = child(ROOT, args.shape, checkpoint, "nnsight", filled["now"], args.threads)
                rows.setdefault("nnsight 0.8.1: NNsight(model) + first trace", []).append(result["first value"])
            except RuntimeError as error:
                print(f"nnsight: {str(error).splitlines()[-1]}")
                args.no_nnsight = True
    print(f"load average at end: {open('/proc/loadavg').read().split()[:3]}")
    print(f"\n{args.shape}, {args.threads} thread(s), median of {args.rounds} fresh processes each, interleaved\n")
    print("| what | median s |\n|---|---:|")
    for label, values in rows.items():
        print(f"| {label} | {statistics.median(values):.3f} |")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - start:.0f} s)")

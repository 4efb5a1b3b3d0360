"""The two ratios at their edges (issue 56, item 5): every standard value, and the experts op.

    python benchmarks/bench_ratios.py [--rounds 3] [--repeats 7] [--tokens 128] [--part values|experts|both]

Every standard value (``*``, ``layers.*.*``, ``layers.*.*.*``: 440 values, 566 MiB at 128 tokens) on
the 0.8B shape (random weights, float32, sdpa, batch 1, no_grad) against the plain HF forward,
interleaved (plain, qgraph, plain, ...; median of ``--repeats`` after a warm-up) in one process. Each
round runs two fresh processes one after the other (never at once), in alternating order: one with
``QGRAPH_KEEP_HEAP=0`` (glibc's heap as before ``qgraph.kernels.heap``: what the values grew is trimmed
when they are dropped, so the next call faults it in again) and one as shipped. Each prints, per call,
the median wall time, page faults (MiB faulted in) and system time of both runs, its ratio, the
resident memory after the values are dropped (what the kept heap costs) and the peak, and a digest
(sha256) of every value and of the logits; the parent checks that every process's values are the
same bit for bit and that qgraph's logits equal the plain forward's.

The experts op: a small MoE shape (``bench_moe.config_small``: hidden 512, 8 blocks, 32 experts,
top-4), 128 tokens, HF's forward with its default experts implementation (grouped_mm) against
``qgraph.instrument(model)`` with no values, interleaved, median of ``--repeats``, one fresh process a
round; the logits checked bit-equal.

Prints a markdown table of each round and the medians over rounds, with the load average
(``os.getloadavg``) before and after each process's timing.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

STANDARD = ["*", "layers.*.*", "layers.*.*.*"]


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def status_mib(field: str) -> float:
    """A field of /proc/self/status in MiB (VmRSS: resident now; VmHWM: peak resident)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024


def digest(tensors: dict) -> str:
    """sha256 over every tensor's name, shape, dtype and bytes, in name order."""
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        if isinstance(tensor, torch.Tensor):
            hasher.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            hasher.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def timed_calls(runs: dict, repeats: int) -> dict:
    """Each run in turn after a warm-up, ``repeats`` times: median wall seconds, MiB of page faults and
    system seconds per call. Each call's result is dropped before the next call."""
    for run in runs.values():
        run()
    samples: dict = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            run()
            seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            samples[name].append((seconds, (after.ru_minflt - before.ru_minflt) * 4 / 1024,
                                  after.ru_stime - before.ru_stime))
    return {name: [statistics.median(sample[i] for sample in values) for i in range(3)]
            for name, values in samples.items()}


def child_values(tokens: int, repeats: int) -> dict:
    import qgraph
    from common import build_0_8b
    model = build_0_8b()
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    ig = qgraph.instrument(model, values=STANDARD)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        out = ig(ids)
        report = {"qgraph": qgraph.__file__, "values": len(out.values),
                  "digest": digest({**out.values, "logits": out.logits}),
                  "logits equal plain": torch.equal(out.logits, plain),
                  "MiB returned": sum(t.untyped_storage().nbytes() for t in
                                      {t.untyped_storage().data_ptr(): t for t in out.values.values()
                                       if isinstance(t, torch.Tensor)}.values()) / 2**20}
        del out, plain
        report["load before"] = load()
        times = timed_calls({"plain": lambda: model(input_ids=ids), "qgraph": lambda: ig(ids)}, repeats)
        report["load after"] = load()
    report["rss after dropping (MiB)"], report["peak rss (MiB)"] = status_mib("VmRSS"), status_mib("VmHWM")
    report["times"] = times
    report["ratio"] = times["qgraph"][0] / times["plain"][0]
    return report


def child_experts(tokens: int, repeats: int) -> dict:
    import qgraph
    from bench_moe import config_small
    from transformers import Qwen3_5MoeForCausalLM
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(config_small()).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    ig = qgraph.instrument(model)
    with torch.no_grad():
        report = {"qgraph": qgraph.__file__, "implementation": model.config._experts_implementation,
                  "logits equal HF": torch.equal(ig(ids).logits, model(input_ids=ids).logits),
                  "load before": load()}
        times = timed_calls({"plain": lambda: model(input_ids=ids), "qgraph": lambda: ig(ids)}, repeats)
        report["load after"] = load()
    report["times"] = times
    report["ratio"] = times["qgraph"][0] / times["plain"][0]
    return report


def spawn(part: str, args, env: dict) -> dict:
    """One fresh child process for ``part``; its JSON report."""
    command = [sys.executable, __file__, "--child", part, "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{part} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(label: str, report: dict) -> str:
    (plain, plain_faults, plain_sys), (ours, faults, sys_seconds) = report["times"]["plain"], report["times"]["qgraph"]
    memory = (f" | {report['rss after dropping (MiB)']:.0f} | {report['peak rss (MiB)']:.0f}"
              if "peak rss (MiB)" in report else "")
    return (f"| {label} | {plain * 1e3:.0f} | {ours * 1e3:.0f} | **{report['ratio']:.3f}** | "
            f"{plain_faults:.0f} / {faults:.0f} | {plain_sys:.2f} / {sys_seconds:.2f}{memory} | "
            f"{report['load before']} → {report['load after']} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--part", choices=["values", "experts", "both"], default="both")
    parser.add_argument("--child", choices=["values", "experts"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps((child_values if args.child == "values" else child_experts)(args.tokens, args.repeats)))
        return
    os.environ.setdefault("QGRAPH_PROGRAM_CACHE", "0")  # each child exports afresh: no user cache touched
    modes = {"heap trimmed (QGRAPH_KEEP_HEAP=0, as before)": {"QGRAPH_KEEP_HEAP": "0"}, "heap kept": {}}
    ratios: dict = {}
    digests = set()
    print(f"load average at start: {load()}")
    if args.part in ("values", "both"):
        print("| every standard value | plain ms | qgraph ms | × plain | faults MiB per call, plain / qgraph | "
              "system s per call, plain / qgraph | RSS after dropping, MiB | peak RSS, MiB | load before → after |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for round_ in range(args.rounds):
            order = list(modes.items()) if round_ % 2 == 0 else list(modes.items())[::-1]
            for label, env in order:
                report = spawn("values", args, env)
                digests.add(report["digest"])
                assert report["logits equal plain"], "qgraph's logits differ from the plain forward's"
                ratios.setdefault(label, []).append(report["ratio"])
                print(row(f"round {round_ + 1}, {label}", report), flush=True)
        assert len(digests) == 1, f"the values differ between processes: {digests}"
        print(f"values: {report['values']}, {report['MiB returned']:.0f} MiB of distinct storage; every process's "
              f"values and logits equal bit for bit (sha256 {digests.pop()[:16]}…)")
    if args.part in ("experts", "both"):
        print("| experts op | HF ms | qgraph ms | × HF | faults MiB per call, HF / qgraph | "
              "system s per call, HF / qgraph | load before → after |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for round_ in range(args.rounds):
            report = spawn("experts", args, {})
            assert report["logits equal HF"], "qgraph's logits differ from HF's"
            ratios.setdefault(f"experts ({report['implementation']})", []).append(report["ratio"])
            print(row(f"round {round_ + 1}", report), flush=True)
    for label, values in ratios.items():
        print(f"{label}: median {statistics.median(values):.3f} over {len(values)} rounds "
              f"({', '.join(f'{v:.3f}' for v in values)})")
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()

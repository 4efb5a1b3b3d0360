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
same bit for bit (the logits differ from the plain forward's by float rounding: asking for the
attention's scores and probabilities computes the attention as matmul and softmax, not sdpa).

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
    """Each run in turn after a warm-up, ``repeats`` times; per run the medians of: wall seconds, CPU
    seconds (this process's, user + system), MiB of pages faulted in, and system seconds. Each call's
    result is dropped before the next call."""
    for run in runs.values():
        run()
    samples: dict = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            before, start, cpu = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
            run()
            seconds, cpu, after = time.perf_counter() - start, time.process_time() - cpu, \
                resource.getrusage(resource.RUSAGE_SELF)
            samples[name].append((seconds, cpu, (after.ru_minflt - before.ru_minflt) * 4 / 1024,
                                  after.ru_stime - before.ru_stime))
    return {name: {key: statistics.median(sample[i] for sample in values)
                   for i, key in enumerate(("wall", "cpu", "faults", "system"))} for name, values in samples.items()}


def child_values(tokens: int, repeats: int, blocks: int = 24) -> dict:
    """plain HF, qgraph every layer_output, qgraph every standard value, interleaved (as bench_peers.py)."""
    import qgraph
    from common import build_0_8b, qwen3_5_0_8b_config
    model = build_0_8b(num_hidden_layers=blocks, layer_types=qwen3_5_0_8b_config().layer_types[:blocks])
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    layers = qgraph.instrument(model, values=["layers.*.layer_output"])
    every = qgraph.instrument(model, values=STANDARD)
    with torch.no_grad():  # timed first: the checks' allocations would change the heap the timing meets
        report = {"qgraph": qgraph.__file__, "load before": load()}
        report["times"] = timed_calls({"plain": lambda: model(input_ids=ids), "layers": lambda: layers(ids),
                                       "qgraph": lambda: every(ids)}, repeats)
        report["load after"] = load()
        report["rss after dropping (MiB)"], report["peak rss (MiB)"] = status_mib("VmRSS"), status_mib("VmHWM")
        plain = model(input_ids=ids).logits
        out = every(ids)
        distinct = {t.untyped_storage().data_ptr(): t for t in out.values.values() if isinstance(t, torch.Tensor)}
        report.update({"values": len(out.values), "digest": digest({**out.values, "logits": out.logits}),
                       "logits vs plain": (out.logits.double() - plain.double()).abs().max().item(),
                       "MiB returned": sum(t.untyped_storage().nbytes() for t in distinct.values()) / 2**20})
    return report


def child_experts(tokens: int, repeats: int, blocks: int = 0) -> dict:
    """HF's forward (its default experts implementation) and qgraph with no values, interleaved."""
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
        report["times"] = timed_calls({"plain": lambda: model(input_ids=ids), "qgraph": lambda: ig(ids)}, repeats)
        report["load after"] = load()
    return report


def spawn(part: str, args, env: dict) -> dict:
    """One fresh child process for ``part``; its JSON report."""
    command = [sys.executable, __file__, "--child", part, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
               "--threads", str(args.threads), "--blocks", str(args.blocks)]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{part} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio(report: dict, key: str, run: str = "qgraph") -> float:
    return report["times"][run][key] / report["times"]["plain"][key]


def row(label: str, report: dict) -> str:
    plain, ours = report["times"]["plain"], report["times"]["qgraph"]
    cells = [label, f"{plain['wall'] * 1e3:.0f}", f"{ours['wall'] * 1e3:.0f}", f"**{ratio(report, 'wall'):.3f}**",
             f"{ratio(report, 'cpu'):.3f}"]
    if "layers" in report["times"]:
        cells.append(f"{ratio(report, 'wall', 'layers'):.3f}")
    cells += [f"{plain['faults']:.0f} / {ours['faults']:.0f}", f"{plain['system']:.2f} / {ours['system']:.2f}"]
    if "peak rss (MiB)" in report:
        cells += [f"{report['rss after dropping (MiB)']:.0f}", f"{report['peak rss (MiB)']:.0f}"]
    return "| " + " | ".join(cells + [f"{report['load before']} → {report['load after']}"]) + " |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--part", choices=["values", "experts", "both"], default="both")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads in each child")
    parser.add_argument("--blocks", type=int, default=24, help="blocks of the 0.8B shape (fewer: a smoke test)")
    parser.add_argument("--child", choices=["values", "experts"])
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(args.threads)
        child = child_values if args.child == "values" else child_experts
        print(json.dumps(child(args.tokens, args.repeats, args.blocks)))
        return
    os.environ.setdefault("QGRAPH_PROGRAM_CACHE", "0")  # each child exports afresh: no user cache touched
    modes = {"heap trimmed (QGRAPH_KEEP_HEAP=0, as before)": {"QGRAPH_KEEP_HEAP": "0"}, "heap kept": {}}
    ratios: dict = {}
    digests = set()
    print(f"load average at start: {load()}")
    if args.part in ("values", "both"):
        print("| every standard value | plain ms | qgraph ms | × plain | × plain, CPU time | every layer_output "
              "× plain | faults MiB per call, plain / qgraph | system s per call, plain / qgraph | "
              "RSS after dropping, MiB | peak RSS, MiB | load before → after |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for round_ in range(args.rounds):
            order = list(modes.items()) if round_ % 2 == 0 else list(modes.items())[::-1]
            for label, env in order:
                report = spawn("values", args, env)
                digests.add(report["digest"])
                ratios.setdefault(label, []).append(ratio(report, "wall"))
                ratios.setdefault(f"{label}, CPU time", []).append(ratio(report, "cpu"))
                print(row(f"round {round_ + 1}, {label}", report), flush=True)
        assert len(digests) == 1, f"the values differ between processes: {digests}"
        print(f"values: {report['values']}, {report['MiB returned']:.0f} MiB of distinct storage; every process's "
              f"values and logits equal bit for bit (sha256 {digests.pop()[:16]}…); logits vs the plain forward's "
              f"{report['logits vs plain']:.1e} (the attention decomposed for its scores: float rounding)")
    if args.part in ("experts", "both"):
        print("| experts op | HF ms | qgraph ms | × HF | × HF, CPU time | faults MiB per call, HF / qgraph | "
              "system s per call, HF / qgraph | load before → after |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for round_ in range(args.rounds):
            report = spawn("experts", args, {})
            assert report["logits equal HF"], "qgraph's logits differ from HF's"
            ratios.setdefault(f"experts ({report['implementation']})", []).append(ratio(report, "wall"))
            ratios.setdefault(f"experts ({report['implementation']}), CPU time", []).append(ratio(report, "cpu"))
            print(row(f"round {round_ + 1}", report), flush=True)
    for label, values in ratios.items():
        print(f"{label}: median {statistics.median(values):.3f} over {len(values)} rounds "
              f"({', '.join(f'{v:.3f}' for v in values)})")
    print(f"load average at end: {load()}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

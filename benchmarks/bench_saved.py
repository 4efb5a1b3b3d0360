"""Saved programs (``ig.save`` / ``qgraph.load``) on the 0.8B shape: write, read, first call, agreement,
and each step in a fresh process against a cold ``instrument()``.

    python benchmarks/bench_saved.py [--tokens 128] [--repeats 3] [--keep DIR]

On the 0.8B shape (``common.build_0_8b``: random weights, float32, sdpa), with the request
``qgraph.instrument(model, values=["layers.*.layer_output"], edits=["layers.5.layer_output"])``:

A. Fresh processes (``python bench_saved.py --child ...``, each building its own model first, not
   timed; ``QGRAPH_PROGRAM_CACHE=0`` and an empty ``$QGRAPH_CACHE``): (1) a cold ``instrument()``;
   (2) ``instrument()`` then ``ig.save(f)`` and ``ig.save(f2, weights=True)``, each timed; (3)
   ``qgraph.load(f2)`` (weights from its ``.safetensors``), in a process that builds no model, then
   one call of 8 tokens and whether any ``modeling_qwen*`` module was imported; (4) ``qgraph.load(f,
   weights=model)``. Printed: each time, the ratios load / cold and save / cold, and the load average
   (``os.getloadavg()``) at each step.
B. In this process:
1. ``ig.save(p, weights=False)``: wall time and the ``.qgraph`` file's size.
2. ``ig.save(p2, weights=True)``: wall time, the ``.qgraph`` and the ``.safetensors`` written beside it.
3. ``qgraph.load(p2)`` (weights read from that ``.safetensors``) and ``qgraph.load(p, weights=model)``
   (the model's own parameters, read at each call): wall time of each load.
4. Batch 1, ``--tokens`` tokens, under ``torch.no_grad()``: the first call of each loaded program, and
   the in-memory ``ig``'s call (after one warm call), then the three interleaved, median of
   ``--repeats`` (no warm-up: the first calls came before).
5. Checks: max abs difference of the logits and of every captured value (24 layer_output) between
   ``ig`` and each loaded program (expected 0), and the same with a per-call edit at the saved slot
   (``edits={"layers.5.layer_output": qgraph.Zero()}``); and the file saved in the fresh process of
   A(2), loaded with this process's model (the same seeded weights), against ``ig`` (expected 0).

Programs are built with a temporary ``$QGRAPH_CACHE`` and ``QGRAPH_PROGRAM_CACHE=0`` (no disk cache:
the instrument call exports), and the files are written to a temporary folder, removed at the end
(``--keep DIR`` writes them there instead and leaves them).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import build_0_8b, interleaved


def mib(path: Path) -> float:
    return path.stat().st_size / 2**20


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def timed(run):
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def max_diff(a, b) -> float:
    """Max abs difference of the logits and of every value of two outputs (inf if the names differ)."""
    if set(a.values) != set(b.values):
        return float("inf")
    diffs = [(a.logits - b.logits).abs().max().item()] if a.logits is not None else []
    diffs += [(a.values[name] - b.values[name]).abs().max().item() for name in a.values]
    return max(diffs)


REQUEST = dict(values=["layers.*.layer_output"], edits=["layers.5.layer_output"])


def child(step: str, folder: Path) -> None:
    """One step in this fresh process; prints its seconds (and what it found) as one JSON line."""
    import qgraph
    fresh, fresh_weights = folder / "fresh.qgraph", folder / "fresh_weights.qgraph"
    found = {"load_average": os.getloadavg()[0]}
    if step == "load-file":  # no model in this process: the file's weights, and no modeling file
        program, found["load"] = timed(lambda: qgraph.load(fresh_weights))
        with torch.no_grad():
            program(torch.randint(0, 1000, (1, 8)))
        found["modeling"] = [name for name in sys.modules if ".modeling_qwen" in name]
    else:
        model = build_0_8b()
        found["load_average"] = os.getloadavg()[0]
        if step == "cold":
            _, found["instrument"] = timed(lambda: qgraph.instrument(model, **REQUEST))
        elif step == "save":
            ig, found["instrument"] = timed(lambda: qgraph.instrument(model, **REQUEST))
            _, found["save"] = timed(lambda: ig.save(fresh))
            _, found["save_weights"] = timed(lambda: ig.save(fresh_weights, weights=True))
        else:
            _, found["load"] = timed(lambda: qgraph.load(fresh, weights=model))
    print(json.dumps(found))


def fresh_processes(folder: Path) -> dict:
    """Each step of A in a fresh process, with the disk cache off and an empty ``$QGRAPH_CACHE``."""
    results = {}
    for step in ("cold", "save", "load-file", "load-model"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "QGRAPH_CACHE": cache, "QGRAPH_PROGRAM_CACHE": "0"}
            done = subprocess.run([sys.executable, __file__, "--child", step, "--folder", str(folder)], env=env,
                                  capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the {step} step failed:\n{done.stderr[-3000:]}")
        results[step] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  fresh process, {step}: {results[step]}", flush=True)
    cold = results["cold"]["instrument"]
    save, save_weights = results["save"]["save"], results["save"]["save_weights"]
    load_file, load_model = results["load-file"]["load"], results["load-model"]["load"]
    print(f"fresh processes: cold instrument() {cold:.2f} s; ig.save {save:.2f} s (weights=True {save_weights:.2f} s); "
          f"qgraph.load weights=model {load_model:.2f} s, weights from the file {load_file:.2f} s")
    print(f"ratios to the cold instrument(): save {save / cold:.2f}x (weights=True {save_weights / cold:.2f}x), "
          f"load weights=model {load_model / cold:.2f}x, load from the file {load_file / cold:.2f}x")
    averages = ", ".join(f"{step} {found['load_average']:.2f}" for step, found in results.items())
    print(f"modeling modules imported by the loading process: {results['load-file']['modeling'] or 'none'}; "
          f"load average at each step: {averages}")
    return results


def run(args, folder: Path) -> None:
    import qgraph
    print(f"load average before the fresh processes: {os.getloadavg()[0]:.2f}")
    fresh_processes(folder)
    model, build = timed(build_0_8b)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"0.8B shape built in {build:.1f} s: {parameters / 1e6:.0f} M parameters "
          f"({parameters * 4 / 2**20:.0f} MiB in float32); torch threads {torch.get_num_threads()}")
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens))
    ig, seconds = timed(lambda: qgraph.instrument(model, **REQUEST))
    print(f"instrument(): {seconds:.1f} s (disk cache off: exports)")

    p, p2 = folder / "probe.qgraph", folder / "probe_weights.qgraph"
    _, save_plain = timed(lambda: ig.save(p, weights=False))
    print(f"ig.save(p, weights=False): {save_plain:.2f} s, {p.name} {mib(p):.2f} MiB")
    _, save_weights = timed(lambda: ig.save(p2, weights=True))
    weights_file = p2.with_suffix(".safetensors")
    print(f"ig.save(p2, weights=True): {save_weights:.2f} s, {p2.name} {mib(p2):.2f} MiB, "
          f"{weights_file.name} {mib(weights_file):.0f} MiB")
    print(f"peak RSS after saving: {maxrss_mib():.0f} MiB")

    from_file, load_file = timed(lambda: qgraph.load(p2))
    print(f"qgraph.load(p2) (weights from {weights_file.name}): {load_file:.2f} s")
    from_model, load_model = timed(lambda: qgraph.load(p, weights=model))
    print(f"qgraph.load(p, weights=model): {load_model:.2f} s")
    print(f"peak RSS after loading: {maxrss_mib():.0f} MiB")

    with torch.no_grad():
        out_file, first_file = timed(lambda: from_file(ids))
        out_model, first_model = timed(lambda: from_model(ids))
        out_ig, first_ig = timed(lambda: ig(ids))
        print(f"first call, {args.tokens} tokens: loaded (weights from file) {first_file * 1e3:.0f} ms, "
              f"loaded (weights=model) {first_model * 1e3:.0f} ms, ig's first call {first_ig * 1e3:.0f} ms")
        print(f"values: {len(out_ig.values)} in ig's output, {len(out_file.values)} / {len(out_model.values)} "
              f"in the loaded programs'")
        print(f"max abs diff (logits and every value): loaded from file vs ig {max_diff(out_ig, out_file):.1e}, "
              f"loaded with model vs ig {max_diff(out_ig, out_model):.1e}")
        edit = {"layers.5.layer_output": qgraph.Zero()}
        edited_ig = ig(ids, edits=edit)
        edited_file = from_file(ids, edits=edit)
        edited_model = from_model(ids, edits=edit)
        changed = (edited_ig.logits - out_ig.logits).abs().max().item()
        print(f"with edits={{'layers.5.layer_output': Zero()}}: loaded from file vs ig "
              f"{max_diff(edited_ig, edited_file):.1e}, loaded with model vs ig {max_diff(edited_ig, edited_model):.1e} "
              f"(the edit moves ig's logits by up to {changed:.1e})")
        saved_fresh = qgraph.load(folder / "fresh.qgraph", weights=model)
        print(f"saved in a fresh process, loaded with this model, vs ig: {max_diff(out_ig, saved_fresh(ids)):.1e}, "
              f"edited {max_diff(edited_ig, saved_fresh(ids, edits=edit)):.1e}")
        del saved_fresh
        del out_file, out_model, out_ig, edited_ig, edited_file, edited_model
        load = os.getloadavg()
        times = interleaved({"ig (in memory)": lambda: ig(ids),
                             "loaded, weights from file": lambda: from_file(ids),
                             "loaded, weights=model": lambda: from_model(ids)}, repeats=args.repeats, warmup=0)
    base = times["ig (in memory)"]
    print(f"interleaved, median of {args.repeats}:")
    for name, seconds in times.items():
        print(f"  {name:28s} {seconds * 1e3:8.0f} ms  {seconds / base:5.3f}x")
    print(f"first call / ig median: loaded from file {first_file / base:.2f}x, loaded with model "
          f"{first_model / base:.2f}x")
    print(f"load average before timing {load[0]:.2f}, after {os.getloadavg()[0]:.2f}; peak RSS {maxrss_mib():.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="write the saved files here and keep them")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one step of A, in a fresh process
    parser.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.folder)
        return
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["QGRAPH_CACHE"] = cache
        os.environ["QGRAPH_PROGRAM_CACHE"] = "0"
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            run(args, args.keep)
        else:
            with tempfile.TemporaryDirectory() as folder:
                run(args, Path(folder))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

"""Saved programs (``ig.save`` / ``qgraph.load``) on the 0.8B shape: write, read, first call, agreement.

    python benchmarks/bench_saved.py [--tokens 128] [--repeats 3] [--keep DIR]

On the 0.8B shape (``common.build_0_8b``: random weights, float32, sdpa), with
``ig = qgraph.instrument(model, values=["layers.*.layer_output"], edits=["layers.5.layer_output"])``:

1. ``ig.save(p, weights=False)``: wall time and the ``.pt2`` file's size.
2. ``ig.save(p2, weights=True)``: wall time, the ``.pt2`` and the ``.safetensors`` written beside it.
3. ``qgraph.load(p2)`` (weights read from that ``.safetensors``) and ``qgraph.load(p, weights=model)``
   (the model's own parameters, read at each call): wall time of each load.
4. Batch 1, ``--tokens`` tokens, under ``torch.no_grad()``: the first call of each loaded program, and
   the in-memory ``ig``'s call (after one warm call), then the three interleaved, median of
   ``--repeats`` (no warm-up: the first calls came before).
5. Checks: max abs difference of the logits and of every captured value (24 layer_output) between
   ``ig`` and each loaded program (expected 0), and the same with a per-call edit at the saved slot
   (``edits={"layers.5.layer_output": qgraph.Zero()}``).

Programs are built with a temporary ``$QGRAPH_CACHE`` and ``QGRAPH_PROGRAM_CACHE=0`` (no disk cache:
the instrument call exports), and the files are written to a temporary folder, removed at the end
(``--keep DIR`` writes them there instead and leaves them).
"""
from __future__ import annotations

import argparse
import os
import resource
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


def run(args, folder: Path) -> None:
    import qgraph
    model, build = timed(build_0_8b)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"0.8B shape built in {build:.1f} s: {parameters / 1e6:.0f} M parameters "
          f"({parameters * 4 / 2**20:.0f} MiB in float32); torch threads {torch.get_num_threads()}")
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens))
    ig, seconds = timed(lambda: qgraph.instrument(model, values=["layers.*.layer_output"],
                                                  edits=["layers.5.layer_output"]))
    print(f"instrument(): {seconds:.1f} s (disk cache off: exports)")

    p, p2 = folder / "probe.pt2", folder / "probe_weights.pt2"
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
    args = parser.parse_args()
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

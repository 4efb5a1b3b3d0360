"""The first compiled call by model depth, whole-graph against regional compilation (issue 56, item 3).

    python benchmarks/bench_compile.py [--blocks 4,8,16] [--big] [--steady 4] [--repeats 15] [--threads 1]
                                       [--compile-threads N] [--ways whole,regional]

``compile=True`` used to wrap the whole program in one ``torch.compile`` (``whole`` here: that code, kept in
this file); it now compiles each group of alike regions once (``regional``: ``qgraph.compile``). For each
depth (the tiny Qwen3.5 of ``qgraph.testing``, its 3 DeltaNet + 1 attention pattern repeated to ``B``
blocks via ``num_hidden_layers``; ``--big``: the 0.8B shape of ``common.build_0_8b``, random weights), each
way runs in a fresh process with a fresh, empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` pointed at a
new temporary directory; dynamo's in-memory caches start empty in a fresh process), and reports:

- the first call's seconds (batch 2, 16 tokens, every block's output and the logits, no_grad), the compile
  included; ``instrument()`` before it is not counted; and its CPU seconds, the C++ compiler's included
  (``--compile-threads 1``, ``TORCHINDUCTOR_COMPILE_THREADS=1``: inductor runs the compiler from this
  process, so its time is counted; with more, its worker processes' time is not), a figure that depends
  less on what else the machine runs than the wall time;
- the largest difference from the eager program over every value and the logits, relative to the value's
  largest magnitude, and the logits' against the Hugging Face forward;
- the graphs dynamo compiled on the first call, and the ones it compiled after it for calls of other
  lengths and batches (batch 2 at 40 tokens, batch 3 at 9, batch 1 at 16 after batch 2), and then under
  grad mode (batch 1 at 12 tokens, then 30): 0 is no recompile (grad mode itself is guarded, so its
  first call compiles its own graphs);
- the process's peak resident memory (the model, the eager program's calls and the compile).

``--steady B`` then times calls (batch 1, 16 tokens; ``big``: the 0.8B shape at 128 tokens) in one process
on ``--threads`` threads, eager, whole and regional interleaved (each compiled first, not timed), medians of
``--repeats`` after a warm-up. The whole-graph first call of the 0.8B shape takes minutes, so ``--big``
measures the regional one alone unless ``--big-whole``.
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

ROOT = Path(__file__).resolve().parent.parent  # this checkout's qgraph, not an installed one
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

VALUES = ["layers.*.layer_output"]
LATER = [(2, 40), (3, 9), (1, 16)]  # after the first call (2, 16): other lengths, batches, batch 1 after 2
GRAD = [(1, 12), (1, 30)]  # under grad mode: the first compiles grad mode's graphs, the second must not


def build(blocks: int | None, directory: str):
    """The tiny model grown to ``blocks`` blocks, or (None) the 0.8B shape; eval mode, sdpa."""
    if blocks is None:
        from common import build_0_8b
        return build_0_8b()
    from transformers import AutoModelForCausalLM

    from qgraph.testing import tiny_qwen3_5
    path = tiny_qwen3_5(Path(directory) / f"tiny-{blocks}", num_hidden_layers=blocks,
                        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (blocks // 4))
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


class WholeGraph:
    """The compile before issue 56 (``qgraph.compile`` as it was): the program's GraphModule in one
    ``torch.compile(fullgraph=True)``, its inputs' symbolic dims marked dynamic on every call."""

    def __init__(self, module):
        import torch

        from qgraph.compat import inductor_symbolic_strides_fix
        inductor_symbolic_strides_fix()
        self.compiled = torch.compile(module, fullgraph=True)
        self.dynamic = []
        for index, node in enumerate(module.graph.find_nodes(op="placeholder")):
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                dims = [dim for dim, size in enumerate(value.shape) if not isinstance(size, int)]
                if dims:
                    self.dynamic.append((index, dims))

    def __call__(self, *args):
        import torch
        for index, dims in self.dynamic:
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(args[index], dim)
        return self.compiled(*args)


def instrumented(model, way: str):
    """``model`` instrumented for every block's output and the logits, compiled the ``way`` asked."""
    import qgraph
    from qgraph.runners import Compiled
    if way == "regional":
        return qgraph.instrument(model, values=VALUES, compile=True)
    if way == "eager":
        return qgraph.instrument(model, values=VALUES)
    ig = qgraph.instrument(model, values=VALUES)
    for program in ig._programs.values():
        program.runs_on(Compiled(WholeGraph(program.module)))
    return ig


def ids_of(model, batch: int, seq: int):
    import torch
    generator = torch.Generator().manual_seed(batch * 1000 + seq)
    return torch.randint(0, min(model.config.vocab_size, 50_000), (batch, seq), generator=generator)


def relative_difference(got, want) -> float:
    """The largest difference over every value and the logits, each relative to its largest magnitude."""
    pairs = [(got.logits, want.logits)] + [(got[name], want[name]) for name in want.values]
    return max(((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in pairs)


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children waited for (the compiler runs inductor starts)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def first_call(blocks: int | None, way: str, directory: str) -> dict:
    """One fresh process's figures (see the module's docstring)."""
    import torch
    from torch._dynamo.utils import counters
    model = build(blocks, directory)
    eager, ig = instrumented(model, "eager"), instrumented(model, way)
    graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
    ids = ids_of(model, 2, 16)
    with torch.no_grad():
        start, cpu = time.perf_counter(), cpu_seconds()
        out = ig(ids)
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        first = graphs()
        difference = relative_difference(out, eager(ids))
        hf = model(input_ids=ids).logits
        against_hf = ((out.logits - hf).abs().max() / hf.abs().max()).item()
        for batch, seq in LATER:
            later = ids_of(model, batch, seq)
            difference = max(difference, relative_difference(ig(later), eager(later)))
    later_graphs = graphs() - first
    grad_graphs = []
    for batch, seq in GRAD:  # grad mode: the parameters require grad, so the compiled graphs are training graphs
        before = graphs()
        later = ids_of(model, batch, seq)
        difference = max(difference, relative_difference(ig(later), eager(later)))
        grad_graphs.append(graphs() - before)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux
    return dict(way=way, blocks=blocks or "0.8B", first_call_s=round(seconds, 1), cpu_s=round(cpu, 1), graphs=first,
                later_graphs=later_graphs, grad_graphs=grad_graphs, max_relative_difference=difference,
                logits_vs_hf=against_hf, peak_rss_mib=peak)


def steady(blocks: int | None, ways: list[str], repeats: int, directory: str, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)

    from common import interleaved
    model = build(blocks, directory)
    ids = ids_of(model, 1, 128 if blocks is None else 16)
    runs = {}
    with torch.no_grad():
        for way in ways:
            ig = instrumented(model, way)
            ig(ids)  # compiles (not timed)
            runs[way] = lambda ig=ig: ig(ids)
        times = interleaved(runs, repeats=repeats, warmup=2)
    return {way: round(seconds * 1000, 2) for way, seconds in times.items()}


def child(arguments: list[str], compile_threads: int | None) -> dict:
    """Run this file in a fresh process with an empty inductor cache; its last line is the result."""
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as directory:
        environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(directory, "inductor")}
        if compile_threads:
            environment["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
        done = subprocess.run([sys.executable, __file__, "--child", *arguments, "--dir", directory],
                              env=environment, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{arguments} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", default="4,8,16", help="depths of the tiny model, comma-separated ('' for none)")
    parser.add_argument("--big", action="store_true", help="the 0.8B shape too (regional; whole with --big-whole)")
    parser.add_argument("--big-whole", action="store_true")
    parser.add_argument("--steady", default="4", help="depths to time calls at (tiny; 'big' for the 0.8B shape)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads for the timed calls")
    parser.add_argument("--compile-threads", type=int, default=None,
                        help="inductor's compile workers (1: the compiler's CPU time is counted; default: torch's)")
    parser.add_argument("--ways", default="whole,regional")
    parser.add_argument("--child", nargs="*")
    parser.add_argument("--dir")
    options = parser.parse_args()
    if options.child is not None:
        kind, blocks, *ways = options.child
        depth = None if blocks == "big" else int(blocks)
        result = first_call(depth, ways[0], options.dir) if kind == "first" else \
            steady(depth, ways, options.repeats, options.dir, options.threads)
        print(json.dumps(result))
        return
    import torch
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load()}")
    depths = [b for b in options.blocks.split(",") if b] + (["big"] if options.big else [])
    for blocks in depths:
        for way in options.ways.split(","):
            if blocks == "big" and way == "whole" and not options.big_whole:
                continue
            result = child(["first", blocks, way], options.compile_threads)
            print(json.dumps(result), f"load {load()}", flush=True)
    for blocks in [b for b in options.steady.split(",") if b]:
        ways = ["eager", *options.ways.split(",")]
        result = child(["steady", blocks, *ways, "--repeats", str(options.repeats), "--threads", str(options.threads)],
                       options.compile_threads)
        print(f"steady ms, {blocks} blocks:", json.dumps(result), f"load {load()}", flush=True)


def load() -> str:
    return open("/proc/loadavg").read().split()[0]


if __name__ == "__main__":
    main()

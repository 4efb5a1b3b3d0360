"""What one call adds over the plain forward: qgraph's fixed cost per call beside nnsight's (issue 56, item 2).

    PYTHONPATH=. python benchmarks/bench_overhead.py [--rounds 40] [--tokens 16] [--big] [--big-tokens 4] \
        [--big-rounds 15]

(``PYTHONPATH=.`` imports the qgraph of this checkout; without it, the installed one. The report names it.)

In ONE process, interleaved (each round runs every callable once, in turn), under ``torch.no_grad()``
(as a qgraph call runs) and with ``torch.set_num_threads(1)``:

* the plain Hugging Face forward, ``model(input_ids=ids)``;
* a qgraph call with no values (``qgraph.instrument(model)``), and one with every block output
  (``values=["layers.*.layer_output"]``);
* nnsight (``NNsight(model)``, as ``bench_peers.py`` drives it): an empty trace, and a trace saving every
  block's output (``model.layers[i].output.save()``).

Each figure is the median over rounds of (the callable's time - the plain forward's time in the same
round): what a call adds over the plain forward, in milliseconds; by the wall clock, and by the thread's
CPU time (``time.thread_time``: on a shared machine, other processes' turns on the core do not count).
nnsight wraps every module's forward of the model it is given, which slows that model's plain forward as
well, so it gets a twin of the model sharing its parameters and buffers. Before timing, the values are
compared: qgraph's logits equal the plain forward's (bit for bit), its block outputs nnsight's, and
nnsight's logits the plain forward's. The tiny Qwen3.5 (``qgraph.testing.tiny_qwen3_5``: 4 blocks) at
``--tokens`` tokens always; with ``--big`` the 0.8B shape too (``common.build_0_8b``: random weights, about
3.5 GiB; check ``free -g`` first) at ``--big-tokens`` tokens, where the forward is long and the
difference noisier. For the qgraph calls also the fixed cost alone: a call whose program's forward is taken
away (``fixed_cost``). Prints a markdown table per model and the load average beside it.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def paired(runs: dict, rounds: int, warmup: int = 3) -> tuple[dict, dict]:
    """Seconds of each callable in each round, run in turn (a, b, c, a, b, c, ...) after a warm-up: by the
    wall clock and by this thread's CPU time (which another process's turn on the core does not add to)."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            run()
            cpu[name].append(time.thread_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    return wall, cpu


def runs_for(model, ids) -> tuple[dict, dict, dict]:
    """The callables to time, what each returned once (for the checks), and the instruments by label."""
    import qgraph
    from nnsight import NNsight

    blocks = model.config.num_hidden_layers
    plain = qgraph.instrument(model)
    layers = qgraph.instrument(model, values=["layers.*.layer_output"])
    # nnsight wraps every module's forward in the model it is given (an instance attribute), which slows that
    # model's plain forward too: it gets a twin of its own, sharing the parameters and buffers (no memory)
    wrapped = NNsight(copy.deepcopy(model, memo={id(t): t for t in [*model.parameters(), *model.buffers()]}))

    def nnsight_empty():
        with wrapped.trace(input_ids=ids):
            pass

    def nnsight_blocks():
        saved = []  # made outside the trace: nnsight runs the block's body in a frame of its own
        with wrapped.trace(input_ids=ids):
            for index in range(blocks):
                saved.append(wrapped.model.layers[index].output.save())
            saved.append(wrapped.output.save())
        return saved[:-1], saved[-1]

    runs = {
        "plain HF forward": lambda: model(input_ids=ids),
        "qgraph, no values": lambda: plain(ids),
        "qgraph, every layer_output": lambda: layers(ids),
        "nnsight, empty trace": nnsight_empty,
        "nnsight, every block output": nnsight_blocks,
    }
    instruments = {"qgraph, no values": plain, "qgraph, every layer_output": layers}
    return runs, {name: run() for name, run in runs.items()}, instruments


class _Outputs(torch.nn.Module):
    """Stands for a program's module: returns what the module returned once (its forward taken away)."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs = outputs

    def forward(self, *args):
        return self.outputs


def fixed_cost(ig, ids, calls: int = 300) -> float:
    """Median CPU seconds of a call of ``ig`` with its program's forward taken away: what the call does
    around the forward (checks, inputs, arguments, outputs), measured apart from the forward's noise."""
    program = ig.program_for(False)
    module = program.module
    program.module = _Outputs(module(*program.arguments({"input_ids": ids, "attention_mask": torch.ones_like(ids)})))
    try:
        spent = []
        for _ in range(calls):
            start = time.thread_time()
            ig(ids)
            spent.append(time.thread_time() - start)
    finally:
        program.module = module
    return statistics.median(spent)


def check(results: dict, blocks: int) -> str:
    """The values every timed callable returns agree: qgraph's logits are the plain forward's, its block
    outputs nnsight's."""
    plain = results["plain HF forward"].logits
    saved, nnsight_logits = results["nnsight, every block output"]
    nnsight_logits = getattr(nnsight_logits, "logits", nnsight_logits)
    layers = results["qgraph, every layer_output"]
    assert torch.equal(results["qgraph, no values"].logits, plain), "qgraph's logits differ from the plain forward's"
    assert torch.equal(layers.logits, plain), "qgraph's logits (every layer_output) differ from the plain forward's"
    assert torch.equal(nnsight_logits, plain), "nnsight's logits differ from the plain forward's"
    worst = max((layers[f"layers.{i}.layer_output"] - (s[0] if isinstance(s, tuple) else s)).abs().max().item()
                for i, s in enumerate(saved))
    assert worst == 0.0, f"qgraph's block outputs differ from nnsight's by {worst}"
    return "qgraph's logits == the plain forward's == nnsight's (bit for bit); every block output == nnsight's"


def measure(name: str, model, tokens: int, rounds: int) -> str:
    ids = torch.randint(0, min(200, model.config.vocab_size), (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        runs, results, instruments = runs_for(model, ids)
        checked = check(results, model.config.num_hidden_layers)
        del results
        before = load()
        wall, cpu = paired(runs, rounds)
        fixed = {label: fixed_cost(ig, ids) for label, ig in instruments.items()}
        after = load()
    import qgraph
    lines = [f"### {name}, {tokens} tokens, batch 1, one thread ({rounds} paired rounds; load {before} -> {after})",
             "", f"qgraph from `{Path(qgraph.__file__).parent}`; torch {torch.__version__}.",
             "", "| call | median ms | ms over plain | ms over plain, CPU time | × plain | fixed cost alone, ms |",
             "|---|---:|---:|---:|---:|---:|"]
    plain, plain_cpu = wall["plain HF forward"], cpu["plain HF forward"]
    for label, spent in wall.items():
        over = _over(spent, plain) if spent is not plain else ""
        over_cpu = _over(cpu[label], plain_cpu) if spent is not plain else ""
        alone = f"{fixed[label] * 1e3:.3f}" if label in fixed else ""
        lines.append(f"| {label} | {statistics.median(spent) * 1e3:.2f} | {over} | {over_cpu} | "
                     f"{statistics.median(spent) / statistics.median(plain):.3f} | {alone} |")
    lines += ["", f"Checks: {checked}. Fixed cost alone: the median CPU time of a qgraph call whose program's "
              f"forward is taken away (it returns the outputs it returned once), over 300 calls.", ""]
    return "\n".join(lines)


def _over(spent: list[float], plain: list[float]) -> str:
    """The median of the paired differences (this call's time - the plain forward's in the same round), in ms."""
    return f"{statistics.median(t - p for t, p in zip(spent, plain)) * 1e3:+.2f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--big", action="store_true", help="the 0.8B shape too (about 3.5 GiB)")
    parser.add_argument("--big-tokens", type=int, default=4)
    parser.add_argument("--big-rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM
    from qgraph.testing import tiny_qwen3_5

    with tempfile.TemporaryDirectory() as tmp:
        tiny = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5(tmp)).eval()
    print(measure("tiny Qwen3.5 (4 blocks)", tiny, args.tokens, args.rounds))
    if args.big:
        from common import build_0_8b
        print(measure("0.8B shape (24 blocks, random weights)", build_0_8b(), args.big_tokens, args.big_rounds))


if __name__ == "__main__":
    main()

"""What a key holder can still make the server compute (issue 53): the work bound on function edits.

    python benchmarks/bench_serve_work.py [--rows 16] [--length 512] [--repeats 3]

The tiny Qwen3.5, one request at the server's default --max-batch-tokens (rows x length = 8192), run as
the server runs it (serve.run.Runner): the plain request, and the request with the costliest function
edit the bound lets through (a chain of hidden x hidden products at one slot, as many as
--max-edit-work 1 allows), interleaved, median of --repeats. Then the issue's attack (100 chained
2048 x 2048 products): the time the server takes to count and refuse it.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from common import interleaved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from qgraph.serve.function import export_function, load_function
    from qgraph.serve.limits import Limits
    from qgraph.serve.request import Request, TooLarge
    from qgraph.serve.run import Runner
    from qgraph.serve.work import check_edit_work
    from qgraph.testing import tiny_qwen3_5

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5(Path(tempfile.mkdtemp()))).eval()
    runner = Runner(model)
    parameters = sum(p.numel() for p in model.parameters())
    hidden = model.config.hidden_size
    ids = torch.randint(0, 256, (args.rows, args.length), generator=torch.Generator().manual_seed(0))
    weight = torch.randn(hidden, hidden) / hidden**0.5
    slot = "layers.1.layer_output"

    def request(edits):
        return Request(["layers.2.layer_output"], edits, ids, torch.ones_like(ids), True, None, None, None)

    def chain(count):
        def fn(x):
            for _ in range(count):
                x = x @ weight
            return x
        return load_function(*export_function(fn, torch.randn(2, 5, hidden), ("batch", "seq", "hidden"), "e"), "e")

    count = 1
    while True:  # the longest chain the bound lets through
        try:
            check_edit_work(request({slot: chain(count + 1)}), runner.base.resolve, parameters, Limits())
        except TooLarge:
            break
        count += 1
    edit = chain(count)
    work = check_edit_work(request({slot: edit}), runner.base.resolve, parameters, Limits())
    plain, edited = request({}), request({slot: edit})
    runner.run([plain]), runner.run([edited])  # programs built, warm
    times = interleaved({"plain request": lambda: runner.run([plain]),
                         f"{count} chained {hidden}x{hidden} products": lambda: runner.run([edited])},
                        repeats=args.repeats)
    def attack(x):
        y = x.new_ones(16, 16)
        for _ in range(100):
            y = y @ y
        return x + y[0, 0] * 0
    data, _ = export_function(attack, torch.randn(2, 5, hidden), ("batch", "seq", "hidden"), "attack")
    data = json.loads(json.dumps(data).replace("[16, 16]", "[2048, 2048]"))
    start = time.perf_counter()
    try:
        check_edit_work(request({slot: load_function(data, {}, "attack")}), runner.base.resolve, parameters, Limits())
        refused = "not refused"
    except TooLarge as error:
        refused = str(error)[:90]
    took = time.perf_counter() - start
    print(f"tiny Qwen3.5 ({parameters:,} parameters), {args.rows} x {args.length} tokens, median of {args.repeats}:")
    print(f"  forward work {2 * parameters * args.rows * args.length:.3g}, the edit's {work:.3g}")
    for name, seconds in times.items():
        print(f"  {name:>34}: {seconds:.3f} s ({seconds / times['plain request']:.2f}x)")
    print(f"  the issue's attack: loaded, counted and refused in {took * 1000:.0f} ms ({refused}...)")


if __name__ == "__main__":
    main()

"""Stages across two processes against one process, on the 0.8B shape.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_stages.py \
        [--tokens 128] [--batch 4] [--microbatches 1 2 4] [--repeats 3]
    python benchmarks/bench_stages.py --single [--threads 2] [--tokens 128] [--batch 4]   # the unsplit program alone

Both ranks build the 0.8B shape with the same random weights (seeded). Rank 0 times the unsplit
program (``qgraph.instrument(model, values=["layers.*.layer_output"])``, torch's threads = the
machine's cores) while rank 1 waits at a barrier; then both time the same program cut into two
stages of 12 blocks (``stages=qgraph.Stages(2, microbatches=M)``, one thread per rank), for each M,
each call timed from a barrier before it to a barrier after it (the last stage's end). Rank 1 waits
in a barrier while rank 0 runs the unsplit program, which may cost it a core: ``--single`` times the
unsplit program in a process of its own, the baseline to trust.
Interleaved (single, staged M..., single, ...), median of ``--repeats``, under ``torch.no_grad()``;
the logits of rank 1 are checked against rank 0's unsplit ones (sent over). Prints one line per run
and the ratios to the unsplit program.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import build_0_8b  # noqa: E402

import qgraph  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--single", action="store_true", help="time the unsplit program alone (no torchrun)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of --single")
    args = parser.parse_args()
    if args.single:
        return single_alone(args)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cores = os.cpu_count() or 1
    model = build_0_8b()
    values = ["layers.*.layer_output"]
    single = qgraph.instrument(model, values=values) if rank == 0 else None
    staged = {m: qgraph.instrument(model, values=values, stages=qgraph.Stages(2, microbatches=m))
              for m in args.microbatches}
    ids = torch.randint(0, 248320, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    times = {"single": [], **{f"stages=2, microbatches={m}": [] for m in args.microbatches}}

    def run_single():
        torch.set_num_threads(cores)
        dist.barrier()
        start = time.perf_counter()
        logits = single(ids).logits if rank == 0 else None
        dist.barrier()
        return time.perf_counter() - start, logits

    def run_staged(m):
        torch.set_num_threads(max(1, cores // 2))
        dist.barrier()
        start = time.perf_counter()
        out = staged[m](ids)
        dist.barrier()  # the call is done when the last stage is
        return time.perf_counter() - start, out.logits

    with torch.no_grad():
        reference = run_single()[1]  # warm-up, and the logits to compare with
        for m in args.microbatches:
            run_staged(m)
        for _ in range(args.repeats):
            times["single"].append(run_single()[0])
            for m in args.microbatches:
                elapsed, logits = run_staged(m)
                times[f"stages=2, microbatches={m}"].append(elapsed)
    # rank 1 holds the staged logits: send them to rank 0 to compare with the unsplit program's
    if rank == 1:
        dist.send(logits.contiguous(), 0)
    else:
        received = torch.empty_like(reference)
        dist.recv(received, 1)
        difference = (received - reference).abs().max().item()
        base = statistics.median(times["single"])
        print(f"0.8B shape, batch {args.batch} x {args.tokens} tokens, 2 processes on {cores} cores")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"{name:32s} {median * 1000:8.0f} ms  {median / base:5.2f}x")
        print(f"max |logits difference| staged vs single: {difference:.2e}")
    dist.destroy_process_group()


def single_alone(args) -> None:
    """The unsplit program in this process alone, with ``--threads`` torch threads."""
    torch.set_num_threads(args.threads)
    model = build_0_8b()
    single = qgraph.instrument(model, values=["layers.*.layer_output"])
    ids = torch.randint(0, 248320, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        single(ids)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            single(ids)
            times.append(time.perf_counter() - start)
    print(f"single process alone, {torch.get_num_threads()} threads: {statistics.median(times) * 1000:.0f} ms")


if __name__ == "__main__":
    main()

"""Stages across two processes against one process, on the 0.8B shape: forward, and forward+backward.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_stages.py \
        [--tokens 32] [--batch 2] [--microbatches 1 2] [--repeats 3] [--threads 1] [--skip-backward]
    python benchmarks/bench_stages.py --single [--threads 2] [--tokens 32] [--batch 2]   # the unsplit program alone

Both ranks build the 0.8B shape with the same random weights (seeded). Rank 0 times the unsplit
program (``qgraph.instrument(model, values=["layers.*.layer_output"])``, torch's threads =
``--threads``, the machine's cores by default) while rank 1 waits at a barrier; then both time the
same program cut into two stages of 12 blocks (``stages=qgraph.Stages(2, microbatches=M,
schedule=S)``, one thread per rank), each call timed from a barrier before it to a barrier after it
(the last stage's end):

- forward (under ``torch.no_grad()``), on torch's engine (``torch.distributed.pipelining``, "gpipe"
  forward-only). qgraph's own point-to-point protocol, which ran the forward before, measured against
  it here (same 2 x 32 tokens, 5 repeats, load average 5.6 to 6.3, unsplit on 1 thread): p2p 3185 ms
  and 3431 ms, torch 3118 ms and 3238 ms with 1 and 2 micro-batches (0.98x, 0.94x), so it went;
- forward+backward: ``ig(ids, loss=fn)`` with ``fn = logits[:, -1].logsumexp(-1).sum()`` on torch's
  "gpipe" and "1f1b" (1f1b needs micro-batches >= stages), against the unsplit program's
  ``fn(ig(ids).logits).backward()``; the parameters' gradients are dropped after each call.

Interleaved (single, staged ..., single, ...), median of ``--repeats``. The load average
(``os.getloadavg()``) is printed at the start and the end. Rank 1's logits and loss are checked
against rank 0's unsplit ones (sent over). Prints one line per run with its ratio to the unsplit
program, and the ratio of each backward schedule to gpipe. ``--single`` times the unsplit
forward in a process of its own (rank 1's barrier may cost rank 0 a core).
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


def loss_fn(logits):
    return logits[:, -1].logsumexp(-1).sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-backward", action="store_true", help="time the forward runs only")
    parser.add_argument("--single", action="store_true", help="time the unsplit program alone (no torchrun)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the unsplit program (on rank 0, or alone with --single); on a loaded "
                             "machine 1 avoids oversubscription")
    args = parser.parse_args()
    if args.single:
        return single_alone(args)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cores = os.cpu_count() or 1
    load_start = os.getloadavg()
    model = build_0_8b()
    values = ["layers.*.layer_output"]
    single = qgraph.instrument(model, values=values) if rank == 0 else None
    ids = torch.randint(0, 248320, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))

    def staged(m, schedule):
        return qgraph.instrument(model, values=values, stages=qgraph.Stages(2, microbatches=m, schedule=schedule))

    runs = {}  # name -> (kind, function returning (logits, loss))
    runs["unsplit forward"] = ("single", lambda: (single(ids).logits if rank == 0 else None, None))
    for m in args.microbatches:
        ig = staged(m, "gpipe")
        runs[f"forward, M={m}"] = ("staged", lambda ig=ig: (ig(ids).logits, None))
    if not args.skip_backward:
        def single_backward():
            if rank != 0:
                return None, None
            logits = single(ids).logits
            loss = loss_fn(logits)
            loss.backward()
            return logits.detach(), loss.detach()
        runs["unsplit forward+backward"] = ("single", single_backward)
        for m in args.microbatches:
            for schedule in ("gpipe", "1f1b"):
                if schedule == "1f1b" and m < 2:
                    continue
                ig = staged(m, schedule)
                runs[f"forward+backward, {schedule}, M={m}"] = ("staged", lambda ig=ig: _loss_call(ig, ids))
    times = {name: [] for name in runs}
    results = {}

    def timed(name):
        kind, run = runs[name]
        torch.set_num_threads(args.threads if kind == "single" else max(1, cores // 2))
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad() if name.startswith(("forward,", "unsplit forward")) and "backward" not in name \
                else torch.enable_grad():
            got = run()
        dist.barrier()  # the call is done when the last stage is
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start, got

    for name in runs:  # warm-up (builds the stages' programs), and what to compare
        results[name] = timed(name)[1]
    for _ in range(args.repeats):
        for name in runs:
            times[name].append(timed(name)[0])
    # rank 1 holds the staged logits and losses: send them to rank 0 to compare with the unsplit program's
    staged_names = [name for name in runs if runs[name][0] == "staged"]
    if rank == 1:
        for name in staged_names:
            logits, loss = results[name]
            dist.send(logits.contiguous(), 0)
            if loss is not None:
                dist.send(loss.reshape(1), 0)
    else:
        reference, reference_loss = results["unsplit forward"][0], results.get("unsplit forward+backward", (0, None))[1]
        worst_logits, worst_loss = 0.0, 0.0
        for name in staged_names:
            received = torch.empty_like(reference)
            dist.recv(received, 1)
            worst_logits = max(worst_logits, (received - reference).abs().max().item())
            if name.startswith("forward+backward"):
                loss = torch.empty(1)
                dist.recv(loss, 1)
                worst_loss = max(worst_loss, abs(loss.item() - reference_loss.item()))
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(f"0.8B shape, batch {args.batch} x {args.tokens} tokens, 2 processes on {cores} cores (the unsplit "
              f"program on {args.threads} threads, each stage on {max(1, cores // 2)}), "
              f"load average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
        for name, median in medians.items():
            base = medians["unsplit forward+backward" if "backward" in name else "unsplit forward"]
            print(f"{name:36s} {median * 1000:8.0f} ms  {median / base:5.2f}x unsplit")
        for m in args.microbatches:
            if f"forward+backward, 1f1b, M={m}" in medians:
                ratio = medians[f"forward+backward, 1f1b, M={m}"] / medians[f"forward+backward, gpipe, M={m}"]
                print(f"forward+backward, M={m}: 1f1b / gpipe = {ratio:.3f}")
        print(f"max |logits difference| staged vs unsplit: {worst_logits:.2e}; max |loss difference|: {worst_loss:.2e}")
    dist.destroy_process_group()


def _loss_call(ig, ids):
    out = ig(ids, loss=loss_fn)
    return out.logits, out.loss


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

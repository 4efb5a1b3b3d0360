"""``qgraph serve`` under load: requests per second and latency for 1, 4 and 8 concurrent clients.

A medium checkpoint (8 blocks, hidden 512, MLP 1024, vocab 8192, random weights) is served by ``qgraph
serve`` in a subprocess on 127.0.0.1; each client sends one 8-token prompt per request through
``qgraph.remote`` (values: the last block's layer_output, and the logits). Rounds are interleaved (1, 4, 8
clients, then again); throughput is the best round's, latencies (p50, p99) are pooled over the rounds.
The batcher's goal: 8 concurrent clients get at least 2x the requests per second of one client sending
the same requests one after another. For scale, one in-process forward at batch 8 against batch 1.

    python benchmarks/bench_serve.py [--requests 96] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

MEDIUM = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, vocab_size=8192, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_key_head_dim=64, linear_value_head_dim=64,
              layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])


def checkpoint(folder: Path) -> Path:
    from qgraph.testing import tiny_qwen3_5
    return tiny_qwen3_5(folder / "medium", **MEDIUM)


def start(path: Path, log: Path):
    command = [sys.executable, "-m", "qgraph", "serve", str(path), "--port", "0", "--max-batch-tokens", "4096",
               "--max-queue", "256"]
    with open(log, "w") as sink:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=sink, text=True)
    line = process.stdout.readline()
    if not line.startswith("qgraph serve: listening on "):
        raise SystemExit(f"the server did not start: {line!r} {log.read_text()[-2000:]}")
    return process, line.split()[4]


def load(url: str, clients: int, requests: int, prompts: list[torch.Tensor], logits: bool = True):
    """``(requests per second, each request's seconds, forwards the server ran)`` of ``clients`` threads
    sharing ``requests``."""
    import httpx

    import qgraph
    instruments = [qgraph.remote(url).instrument(values=["layers.7.layer_output"], logits=logits)
                   for _ in range(clients)]
    for ig in instruments:  # each client's connection and the server's program, warm
        ig(prompts[0])
    latencies: list[float] = []
    lock = threading.Lock()

    def client(index: int):
        ig = instruments[index]
        for n in range(index, requests, clients):
            start = time.perf_counter()
            out = ig(prompts[n % len(prompts)])
            assert out["layers.7.layer_output"].shape == (1, 8, MEDIUM["hidden_size"])
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    before = httpx.get(f"{url}/v1/health").json()["forwards"]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rate = requests / (time.perf_counter() - start)
    return rate, latencies, httpx.get(f"{url}/v1/health").json()["forwards"] - before


def forward_ratio(path: Path, prompts: list[torch.Tensor]) -> float:
    """One in-process forward at batch 8 over one at batch 1 (median of interleaved runs)."""
    import qgraph
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, str(Path(__file__).parent))
    from common import interleaved
    ig = qgraph.instrument(AutoModelForCausalLM.from_pretrained(path).eval(), values=["layers.7.layer_output"])
    one, eight = prompts[0], torch.cat(prompts[:8])
    with torch.no_grad():
        times = interleaved({"1": lambda: ig(one), "8": lambda: ig(eight)}, repeats=9, warmup=2)
    return times["8"] / times["1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-logits", action="store_true", help="replies without the logits (the value only)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the clients' side: the server's process has the cores
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, MEDIUM["vocab_size"], (1, 8), generator=generator) for _ in range(16)]
    with tempfile.TemporaryDirectory() as folder:
        path = checkpoint(Path(folder))
        process, url = start(path, Path(folder) / "server.log")
        try:
            best = {1: 0.0, 4: 0.0, 8: 0.0}
            pooled: dict[int, list[float]] = {1: [], 4: [], 8: []}
            forwards = {1: 0, 4: 0, 8: 0}
            for _ in range(args.rounds):
                for clients in best:
                    rate, latencies, ran = load(url, clients, args.requests, prompts, not args.no_logits)
                    best[clients] = max(best[clients], rate)
                    pooled[clients] += latencies
                    forwards[clients] += ran
        finally:
            process.terminate()
            process.wait(60)
        ratio = forward_ratio(path, prompts)
    print(f"`python benchmarks/bench_serve.py --requests {args.requests} --rounds {args.rounds}"
          f"{' --no-logits' if args.no_logits else ''}`, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, 2 cores")
    print("\n| concurrent clients | requests/s (best round) | x one-by-one | p50 ms | p99 ms | requests per forward |\n"
          "|---:|---:|---:|---:|---:|---:|")
    for clients, rate in best.items():
        latencies = sorted(pooled[clients])
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print(f"| {clients} | {rate:.1f} | {rate / best[1]:.2f} | {statistics.median(latencies) * 1e3:.0f} | "
              f"{p99 * 1e3:.0f} | {args.requests * args.rounds / max(1, forwards[clients]):.1f} |")
    print(f"\none in-process forward at batch 8 costs {ratio:.2f}x one at batch 1 (so {8 / ratio:.2f}x is the most "
          f"batching can give)")


if __name__ == "__main__":
    main()

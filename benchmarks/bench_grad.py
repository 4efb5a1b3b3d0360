"""Forward + backward through the instrumented program vs the plain model (issue 12).

    python benchmarks/bench_grad.py [--tokens 128] [--repeats 3]

0.8B shape, random weights, batch 1, grad enabled: the next-token cross-entropy of the logits,
``backward()`` into every parameter's ``.grad`` (cleared between runs), for the plain Hugging Face
model, the program with no values (``values=[]``) and the program capturing every block's
``layer_output``; interleaved in one run (median after a warm-up). The program's delta-rule
backward recomputes each DeltaNet kernel's forward (``qgraph/kernels/grad.py``), as activation
checkpointing does, so its extra cost is about one more forward of those kernels.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import qgraph
from common import build_0_8b, interleaved


def step(model, call, ids):
    """One forward + backward of the next-token loss; the parameters' grads are cleared first."""
    model.zero_grad(set_to_none=True)
    logits = call(ids)
    loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = build_0_8b()
    ids = torch.randint(0, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    plain = qgraph.instrument(model, values=[])
    captures = qgraph.instrument(model, values=["layers.*.layer_output"])
    runs = {
        "hf": lambda: step(model, lambda x: model(input_ids=x).logits, ids),
        "qgraph values=[]": lambda: step(model, lambda x: plain(x).logits, ids),
        "qgraph every layer_output": lambda: step(model, lambda x: captures(x).logits, ids),
    }
    times = interleaved(runs, repeats=args.repeats)
    print(f"0.8B shape, {args.tokens} tokens, batch 1, forward + backward (median of {args.repeats}):")
    for name, seconds in times.items():
        print(f"  {name:<28} {seconds:6.2f} s   {seconds / times['hf']:.2f}x hf")


if __name__ == "__main__":
    main()

"""The ``qgraph`` command: ``qgraph demo`` instruments a checkpoint and shows what it captured;
``qgraph render`` draws a block or the model."""
from __future__ import annotations

import argparse
import sys
import time

from .render.cli import add_render_command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qgraph", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="instrument a checkpoint and print its values for a prompt")
    demo.add_argument("--model", help="a local checkpoint dir (default: the embedded tiny Qwen3.5, built on first use)")
    demo.add_argument("--prompt", default="The Eiffel Tower is in the city of")
    demo.add_argument("--values", nargs="*", default=["layers.*.layer_output", "layers.*.*.*", "next_token_probs"],
                      help="names or globs of the values to capture")
    demo.add_argument("--attn-implementation", default="eager",
                      help="how to load attention: eager (has attention_scores) or sdpa")
    demo.set_defaults(handler=_demo)
    add_render_command(commands)
    args = parser.parse_args(argv)
    return args.handler(args)


def _demo(args) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()  # its kernel fallback notice is not news here

    import qgraph
    from qgraph.testing import cached_tiny_qwen3_5

    path = args.model or cached_tiny_qwen3_5()
    print(f"checkpoint: {path}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=args.attn_implementation)

    start = time.perf_counter()
    instrumented = qgraph.instrument(model, values=args.values)
    seconds = time.perf_counter() - start
    print(f"instrument(): {seconds:.1f} s, {len(instrumented.graph.nodes)} graph nodes, "
          f"{len(instrumented.values)} values\n")
    print("== support table ==")
    print(qgraph.SupportTable(instrumented.catalogue, instrumented.family.block_mixers(model.config)))
    print("\n== annotated module tree (* = captured) ==")
    print(instrumented)

    inputs = tokenizer(args.prompt, return_tensors="pt")
    with torch.no_grad():
        out = instrumented(**inputs)
    print(f"\n== captured for {args.prompt!r} ({inputs['input_ids'].shape[1]} tokens) ==")
    print(f"{'value':48} {'shape':22} {'mean':>10} {'std':>10} {'max |x|':>10}")
    for name, value in out.values.items():
        if not isinstance(value, torch.Tensor):
            print(f"{name:48} {str(tuple(value)):22}")
            continue
        x = value.float()
        x = x[x.isfinite()]  # masked scores are -inf
        print(f"{name:48} {str(tuple(value.shape)):22} {x.mean().item():10.4f} "
              f"{x.std().item() if x.numel() > 1 else 0:10.4f} {x.abs().max().item():10.4f}")
    top = out["next_token_probs"][0].topk(5) if "next_token_probs" in out else None
    if top is not None:
        tokens = [tokenizer.decode([i]) for i in top.indices.tolist()]
        print("\nnext token:", ", ".join(f"{t!r} {p:.3f}" for t, p in zip(tokens, top.values.tolist())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

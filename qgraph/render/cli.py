"""``qgraph render``: draw a block or the model of a checkpoint (default: the embedded tiny Qwen3.5).

    qgraph render --block 3 --out block3.svg
    qgraph render --block 0 --detail ops --out block0-ops.png
    qgraph render --what model --out model.svg --model /path/to/checkpoint
"""
from __future__ import annotations

import sys


def add_render_command(subparsers) -> None:
    """Add ``render`` to the ``qgraph`` command's subparsers (``run_render`` runs it)."""
    render = subparsers.add_parser(
        "render", help="draw a block (every value on it) or the model, as svg, png, pdf or dot",
        description="Draw a block or the model from the exported graph; the --out extension picks the format.")
    render.add_argument("--model", help="a local checkpoint dir (default: the embedded tiny Qwen3.5, built on first use)")
    render.add_argument("--what", choices=("block", "model", "vision_block"), default="block")
    render.add_argument("--block", type=int, default=None,
                        help="the block to draw (default: the first attention block); negative counts from the end")
    render.add_argument("--detail", choices=("modules", "ops"), default="modules",
                        help="modules: modules, the ops between them and every value; ops: every graph node")
    render.add_argument("--out", required=True, help="the file to write: .svg, .png, .pdf or .dot")
    render.add_argument("--values", nargs="*", default=[],
                        help="values to mark as instrumented (names or globs, e.g. 'layers.3.self_attn.*')")
    render.add_argument("--attn-implementation", default="sdpa", help="how to load attention: sdpa or eager")
    render.set_defaults(handler=run_render)


def run_render(args) -> int:
    import transformers
    from transformers import AutoModelForCausalLM

    import qgraph
    from qgraph.render import GraphvizNotFound, render
    from qgraph.testing import cached_tiny_qwen3_5

    transformers.logging.set_verbosity_error()
    path = args.model or cached_tiny_qwen3_5()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=args.attn_implementation).eval()
    subject = qgraph.instrument(model, values=args.values, logits=True) if args.values else model
    try:
        written = render(subject, what=args.what, layer=args.block, path=args.out, detail=args.detail)
    except GraphvizNotFound as error:
        print(f"qgraph render: {error}", file=sys.stderr)
        return 2
    except (NotImplementedError, IndexError, ValueError) as error:
        print(f"qgraph render: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m qgraph.render.cli ...``: the render command alone (until ``qgraph`` wires it in)."""
    import argparse
    parser = argparse.ArgumentParser(prog="qgraph")
    add_render_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

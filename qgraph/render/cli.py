"""``qgraph render``: draw a block or the model of a checkpoint (default: the embedded tiny Qwen3.5).

    qgraph render --block 3 --out block3.svg
    qgraph render --block 0 --detail ops --out block0-ops.png
    qgraph render --what model --out model.svg --model /path/to/checkpoint
    qgraph render --what vision_block --out vision0.svg --model /path/to/image-text-checkpoint
"""
from __future__ import annotations

import sys

from . import DETAIL, WHAT


def add_render_command(subparsers) -> None:
    """Add ``render`` to the ``qgraph`` command's subparsers (``run_render`` runs it)."""
    from ..cli import HelpFormatter, add_model_arguments
    render = subparsers.add_parser(
        "render", help="draw a block (every value on it) or the model, as svg, png, pdf or dot",
        description="Draw a block or the model from the exported graph; the --out extension picks the format.",
        formatter_class=HelpFormatter)
    add_model_arguments(render, attn_default="sdpa")
    render.add_argument("--what", choices=WHAT, default="block",
                        help="a text block, the model, or a vision block (image-text checkpoints)")
    render.add_argument("--block", type=int, default=None,
                        help="the block to draw (default: the first attention block; vision: 0); "
                             "negative counts from the end")
    render.add_argument("--detail", choices=DETAIL, default="modules",
                        help="modules: modules, the ops between them and every value; ops: every graph node")
    render.add_argument("--out", required=True, help="the file to write: .svg, .png, .pdf or .dot")
    render.add_argument("--values", nargs="+", default=[],
                        help="values to mark as instrumented (names or globs, e.g. 'layers.3.self_attn.*')")
    render.set_defaults(handler=run_render)


def run_render(args) -> int:
    """Draw what ``args`` asks for; qgraph's errors (a bad block, no Graphviz) reach ``qgraph.cli.main``,
    which prints them as one line."""
    import qgraph
    from qgraph.render import render

    from ..cli import checkpoint_path, load_model
    from ..progress import progress
    model = load_model(checkpoint_path(args.model), args.attn_implementation)
    subject = qgraph.instrument(model, values=args.values, logits=True) if args.values else model
    with progress(f"drawing {args.out}"):
        written = render(subject, what=args.what, layer=args.block, path=args.out, detail=args.detail)
    print(f"wrote {written}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m qgraph.render.cli render ...``: the same as ``qgraph render ...``."""
    from ..cli import main as qgraph_main
    return qgraph_main(argv)


if __name__ == "__main__":
    sys.exit(main())

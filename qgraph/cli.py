"""The ``qgraph`` command: ``qgraph demo`` instruments a checkpoint and shows what it captured;
``qgraph support`` prints a checkpoint's value table; ``qgraph render`` draws a block or the model::

    qgraph render --block 3 --out block3.svg
    qgraph render --block 0 --detail ops --out block0-ops.png
    qgraph render --what vision_block --out vision0.svg --model /path/to/image-text-checkpoint

Every command defaults to the embedded tiny Qwen3.5 (built on first use); ``--model PATH`` takes a
local checkpoint dir, text (``Qwen3_5ForCausalLM``) or image-text (``Qwen3_5ForConditionalGeneration``).

The arguments are parsed, and the paths and the prompt checked, before torch or transformers is
imported: ``--version``, ``--help`` and a mistake on the command line answer at once."""
from __future__ import annotations

import argparse
import linecache
import os
import sys
from pathlib import Path

from .errors import InternalError, QgraphError, UsageError
from .render import DETAIL, WHAT  # the render package imports graphviz and torch only when it draws
from .capture.cli import add_arguments, main as run_capture
from .serve.cli import add_arguments as add_serve_arguments
from . import __version__
import qgraph
from qgraph.render import render

ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every default shown, but for options whose default is "nothing given"."""

    def _get_help_string(self, action):
        if action.default in (None, [], False):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake on the command line answered in one line (exit 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> Parser:
    """The ``qgraph`` parser with its subcommands."""
    parser = Parser(prog="qgraph", formatter_class=HelpFormatter,
                    epilog="'qgraph COMMAND --help' shows a command's options.",
                    description="Read and edit what happens inside Qwen3.5 / Qwen3.6 models. Every command runs on "
                                "the embedded tiny Qwen3.5 (built on first use) unless --model PATH names a local "
                                "checkpoint dir, text or image-text.")
    parser.add_argument("--version", action="version", version=f"qgraph {version()}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    demo = commands.add_parser("demo", help="one screen: a checkpoint's values for a prompt and an edit's effect",
                               description="Instrument a checkpoint and print, on one screen, what it loaded, "
                                           "statistics of the values captured for a prompt, one edit (a head "
                                           "zeroed) and its effect on the logits, and where to go next.",
                               formatter_class=HelpFormatter)
    add_model_arguments(demo)
    demo.add_argument("--prompt", default="The Eiffel Tower is in the city of", help="the text to run")
    demo.add_argument("--values", nargs="+",
                      help="names or globs of the values to capture (default: the residual stream at up to 4 "
                           "blocks, the first DeltaNet block's decays, the last attention block's pattern, "
                           "next_token_probs)")
    demo.add_argument("--table", action="store_true", help="also print the support table: every standard value")
    demo.add_argument("--tree", action="store_true", help="also print the module tree annotated with every value")
    demo.set_defaults(handler=run_demo)
    support = commands.add_parser("support", help="print the value table: every value, its layout, shape and blocks",
                                  description="Print every standard value of a checkpoint with its layout, shape "
                                              "and per-block availability (qgraph.support(model)).",
                                  formatter_class=HelpFormatter)
    add_model_arguments(support)
    support.set_defaults(handler=run_support)
    add_render_command(commands)
    check = commands.add_parser("check", help="check a saved program (.qgraph) as qgraph.load does, reading no weights",
                                description="Check a saved program as qgraph.load does (its members, every field, the "
                                            "positive list of ops, the sandbox's fake run), without its weights: one "
                                            "line says what it is, or why it is refused.",
                                formatter_class=HelpFormatter)
    check.add_argument("path", help="the .qgraph file")
    check.set_defaults(handler=run_check)
    capture = commands.add_parser(
        "capture", help="capture values over a dataset to sharded safetensors (resumable; torchrun splits it)",
        description="Capture values over a dataset into --out (manifest.json and shards/); rerun the same command "
                    "to resume. Under 'torchrun --nproc_per_node N -m qgraph capture ...' each rank takes its share.",
        formatter_class=HelpFormatter)
    add_arguments(capture)
    capture.set_defaults(handler=run_capture)
    serve = commands.add_parser(
        "serve", help="serve a model over HTTP to many researchers (values, edits as data, generate)",
        description="Serve MODEL over HTTP (GET /v1/health, GET /v1/info, POST /v1/run; docs/serving.md): clients "
                    "call it with qgraph.remote(url, api_key). Prints 'qgraph serve: listening on http://HOST:PORT' "
                    "when ready; SIGTERM ends it cleanly.", formatter_class=HelpFormatter)
    add_serve_arguments(serve)
    add_attention_argument(serve)  # here, not in serve/cli.py: every command loads attention alike
    serve.set_defaults(handler=run_serve)
    return parser


def run_serve(args) -> int:
    """``qgraph serve``: the model is loaded (after the command's own checks) here, as the other commands load it."""
    from .serve.cli import main  # lazy: at module level main would shadow this module's own

    def load():
        path = checkpoint_path(args.model)
        return path, load_model(path, args.attn_implementation).to(args.device)
    return main(args, load)


def run_check(args) -> int:
    from .saved.read import check  # lazy: keeps safetensors, sympy, torch, tqdm, transformers out until this is used
    meta, _, module, bounds = check(args.path)
    calls = sum(node.op == "call_function" for node in module.graph.nodes)
    print(f"{args.path}: a {meta['model_class']} program of {calls} op calls, {len(meta['values'])} values, "
          f"{len(meta['slots'])} edit slots; every op on the positive list, every tensor it makes bounded "
          f"({len(bounds.sizes)} sizes): loads with qgraph.load(path, weights=...)")
    return 0


def add_model_arguments(parser) -> None:
    """``--model`` and ``--attn-implementation``, shared by the subcommands."""
    parser.add_argument("--model", metavar="PATH",
                        help="a local checkpoint dir, text or image-text (default: the embedded tiny Qwen3.5, "
                             "built on first use)")
    add_attention_argument(parser)


def add_attention_argument(parser) -> None:
    """``--attn-implementation``: by default none is asked, so transformers picks (sdpa), as for
    ``from_pretrained(path)``, the load ``qgraph.instrument`` gets in every example: the command line and
    the library run one attention implementation, chosen in one place."""
    parser.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS,
                        help="how transformers loads attention (attn_implementation; default: from_pretrained's "
                             "own, sdpa, the load qgraph.instrument gets in every example)")


def main(argv: list[str] | None = None) -> int:
    """Run ``qgraph`` with ``argv`` (default: the process's arguments); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version, or a usage error already printed
        return stop.code if isinstance(stop.code, int) else 2
    if args.command is None:  # `qgraph` alone: what it can do
        parser.print_help()
        return 0
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("qgraph: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if not is_user_error(error):
            raise
        print(f"qgraph: error: {one_line(error)}", file=sys.stderr)
        return 2


def version() -> str:
    """The installed qgraph's version."""
    return __version__


def is_user_error(error: BaseException) -> bool:
    """Whether ``error`` is a mistake in what the user asked for (then the CLI prints one line),
    not a bug (then it raises with its traceback): every ``QgraphError`` but ``InternalError`` (a
    broken invariant of qgraph's own, a bug), a missing or unreadable file, and the
    ValueError/TypeError/IndexError/KeyError that qgraph's own argument checks raise."""
    if isinstance(error, InternalError):
        return False
    if isinstance(error, (QgraphError, OSError)):  # before the imports below, which load torch
        return True
    return isinstance(error, (ValueError, TypeError, IndexError, KeyError)) and _raised_by_qgraph(error)


def _raised_by_qgraph(error: BaseException) -> bool:
    """Whether ``error`` comes from a ``raise`` statement in qgraph's own code (an argument check),
    rather than from inside torch or transformers or from a failed operation in qgraph."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    filename = traceback.tb_frame.f_code.co_filename
    package = Path(__file__).resolve().parent
    if not Path(filename).resolve().is_relative_to(package):
        return False
    return linecache.getline(filename, traceback.tb_lineno).strip().startswith("raise")


def one_line(error: BaseException) -> str:
    """The error's message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


# -- loading -------------------------------------------------------------------------------------------------------
def checkpoint_path(model: str | None) -> Path:
    """``--model``, checked (a local dir with a config.json; before transformers loads), or the
    embedded tiny checkpoint."""
    if model is None:
        quiet_transformers()
        from .testing import cached_tiny_model  # lazy: keeps torch out until this is used
        return cached_tiny_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise UsageError(f"--model {model}: no such directory (give a local checkpoint dir, the one "
                         f"save_pretrained wrote, or leave --model out for the embedded tiny model)")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {model}: not a checkpoint dir, it has no config.json (give the dir "
                         f"save_pretrained wrote)")
    quiet_transformers()
    return path


def quiet_transformers() -> None:
    """Keep transformers' notices off stderr, and its progress bars too where qgraph's are off
    (stderr not a terminal, or QGRAPH_PROGRESS=0)."""
    import transformers

    from .progress import enabled  # lazy: keeps tqdm out until this is used
    transformers.logging.set_verbosity_error()  # its kernel fallback notice is not news here
    if not enabled():
        transformers.utils.logging.disable_progress_bar()


def is_image_text(path: Path) -> bool:
    """Whether the checkpoint at ``path`` is an image-text model (its config has a vision_config)."""
    from transformers import AutoConfig
    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def load_model(path: Path, attn_implementation: str | None = None):
    """The checkpoint's model in eval mode: ``AutoModelForImageTextToText`` for an image-text
    checkpoint, ``AutoModelForCausalLM`` otherwise; ``attn_implementation`` None: transformers' choice."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    quiet_transformers()
    loader = AutoModelForImageTextToText if is_image_text(path) else AutoModelForCausalLM
    chosen = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    return loader.from_pretrained(path, **chosen).eval()


def print_table(table) -> None:
    """Print a rich table: fitted to the terminal (styled) on a tty, plain at its natural width otherwise."""
    from .values.support import plain_text  # lazy: keeps sympy, torch, transformers out until this is used
    if sys.stdout.isatty() and os.environ.get("TERM") != "dumb":
        from rich.console import Console
        Console().print(table)
    else:
        print(plain_text(table))


# -- the subcommands -------------------------------------------------------------------------------------------
def run_support(args) -> int:
    """``qgraph support``: the value table of a checkpoint."""
    path = checkpoint_path(args.model)
    model = load_model(path, args.attn_implementation)
    table = qgraph.support(model)
    from .compat import attn_implementation  # lazy: keeps torch out until this is used
    print(f"checkpoint: {path} ({type(model).__name__}, attn_implementation={attn_implementation(model.config)})")
    print_table(table.to_rich())
    print(f"\n{table.footer()}")
    return 0


def run_demo(args) -> int:
    """``qgraph demo``: one screen on a checkpoint (qgraph/demo.py), then the long forms asked for."""
    if not args.prompt.strip():
        raise UsageError("--prompt is empty: give some text to run (or leave --prompt out for the default)")
    path = checkpoint_path(args.model)
    from transformers import AutoTokenizer

    from .demo import Demo  # lazy: keeps torch out until this is used
    from .progress import progress  # lazy: keeps tqdm out until this is used
    model = load_model(path, args.attn_implementation)
    demo = Demo(model, AutoTokenizer.from_pretrained(path), path, args.values, embedded=args.model is None)
    with progress("running the prompt"):
        print("\n".join(demo.lines(args.prompt)))
    if args.table:
        print("\n== support table ==")
        table = qgraph.SupportTable(demo.ig.catalogue, demo.ig.family, model.config)
        print_table(table.to_rich())
        print(f"\n{table.footer()}")
    if args.tree:
        print("\n== annotated module tree (* = captured) ==")
        print(demo.ig.tree())
    return 0


def add_render_command(subparsers) -> None:
    """Add ``render`` to the ``qgraph`` command's subparsers (``run_render`` runs it)."""
    render = subparsers.add_parser(
        "render", help="draw a block (every value on it) or the model, as svg, png, pdf or dot",
        description="Draw a block or the model from the exported graph; the --out extension picks the format.",
        formatter_class=HelpFormatter)
    add_model_arguments(render)
    render.add_argument("--what", choices=WHAT, default="block",
                        help="a text block, the model, or a vision block (image-text checkpoints)")
    render.add_argument("--block", type=int, default=None,
                        help="the block to draw (default: the first attention block; vision: 0); "
                             "negative counts from the end")
    render.add_argument("--detail", choices=DETAIL, default="modules",
                        help="modules: modules, the ops between them and every value; ops: every graph node")
    render.add_argument("--out", required=True, help="the file to write: .svg, .png, .pdf or .dot")
    render.add_argument("--values", nargs="+", default=[],
                        help="values to mark as instrumented (names or globs, e.g. 'layers.3.mlp.*')")
    render.set_defaults(handler=run_render)


def run_render(args) -> int:
    """Draw what ``args`` asks for; qgraph's errors (a bad block, no Graphviz) reach ``qgraph.cli.main``,
    which prints them as one line."""
    path = checkpoint_path(args.model)

    from .progress import progress  # lazy: keeps tqdm out until this is used
    model = load_model(path, args.attn_implementation)
    # qgraph.instrument: the function at run time (qgraph/__init__.py's _Package); mypy sees the submodule
    subject = (qgraph.instrument(model, values=args.values, logits=True)  # type: ignore[operator]
               if args.values else model)
    with progress(f"drawing {args.out}"):
        written = render(subject, what=args.what, layer=args.block, path=args.out, detail=args.detail)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

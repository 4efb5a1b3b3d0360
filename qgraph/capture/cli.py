"""``qgraph capture``: the command line of ``qgraph.capture``.

    qgraph capture --model PATH --data FILE_OR_DIR --values 'layers.*.layer_output' --out acts/ \\
        --context 1024 --batch-size 8 --dtype bfloat16 --max-tokens 1e7 [--shard-rows N] [--text-column text] \\
        [--sae layers.5.layer_output=SAE_PATH --values 'layers.5.sae.indices' 'layers.5.sae.activations']

Under ``torchrun --nproc_per_node N -m qgraph capture ...`` each rank loads the model (on GPU
``LOCAL_RANK`` when CUDA is there) and captures its share of the rows.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import InvalidArgument, MissingFile

DTYPES = ("bfloat16", "float16", "float32")  # --dtype: torch's dtypes of these names (torch loads in main)


def add_arguments(parser) -> None:
    """The ``capture`` subcommand's options."""
    parser.add_argument("--model", metavar="PATH", required=True, help="a local checkpoint dir (save_pretrained's)")
    parser.add_argument("--data", metavar="FILE_OR_DIR", required=True,
                        help="a parquet, jsonl/json or text file (one document per line), or a dir that "
                             "datasets' save_to_disk wrote")
    parser.add_argument("--values", nargs="+", default=["layers.*.layer_output"], help="names or globs of the values")
    parser.add_argument("--out", metavar="DIR", required=True, help="the capture dir (rerun to resume)")
    parser.add_argument("--context", type=int, default=1024, help="tokens per row")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="the values' dtype on disk")
    parser.add_argument("--max-tokens", type=_count, default=None, help="stop after this many tokens (1e7 works)")
    parser.add_argument("--shard-rows", type=int, default=None,
                        help="rows per shard, a multiple of --batch-size (default: about 256 MB a shard)")
    parser.add_argument("--text-column", default="text", help="the dataset's text column")
    parser.add_argument("--chat-template", action="store_true", help="apply the tokenizer's chat template")
    parser.add_argument("--compile", action="store_true", help="run the program under torch.compile")
    parser.add_argument("--sae", action="append", default=[], metavar="VALUE=PATH",
                        help="splice the SAE at PATH (Qwen-Scope, SAELens or sparsify; a folder of layers is read "
                             "at VALUE's block) at VALUE, so its values (layers.i.sae.*) can be captured; repeatable")


def main(args) -> int:
    """Run ``qgraph capture`` with parsed ``args``; print a one-line summary (rank 0). The paths and
    numbers are checked before torch and transformers load."""
    model_path = Path(args.model).expanduser()
    if not (model_path / "config.json").is_file():
        raise MissingFile(f"--model {args.model}: no checkpoint there (no config.json); give the dir "
                          f"save_pretrained wrote")
    data = Path(args.data).expanduser()
    if not data.exists():
        raise MissingFile(f"--data {args.data}: no such file or directory")
    for label, value in (("--context", args.context), ("--batch-size", args.batch_size)):
        if value < 1:
            raise InvalidArgument(f"{label} must be at least 1, got {value}")
    if args.shard_rows is not None and (args.shard_rows < 1 or args.shard_rows % args.batch_size):
        raise InvalidArgument(f"--shard-rows must be a positive multiple of --batch-size ({args.batch_size}), "
                              f"got {args.shard_rows}")
    saes = _saes(args.sae)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .run import capture  # lazy: keeps safetensors, sympy, torch, tqdm, transformers out until this is used
    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    if torch.cuda.is_available():
        model.to(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    run = capture(model, tokenizer, data, args.values, args.out, context=args.context, batch_size=args.batch_size,
                  dtype=getattr(torch, args.dtype), max_tokens=args.max_tokens, shard_rows=args.shard_rows,
                  text_column=args.text_column, chat_template=args.chat_template, compile=args.compile,
                  saes=saes)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"captured {run.rows} rows ({run.tokens} tokens) in {run.shards} shard(s), "
              f"{run.bytes / 1e6:.1f} MB, to {run.out} ({run.seconds:.1f} s, {run.skipped} shards already done)")
    return 0


def _saes(specs: list[str]) -> dict:
    """``{value: SAE}`` from ``--sae VALUE=PATH`` options (the layer of a folder of layers is VALUE's block)."""
    import re

    from ..saes import SAE  # lazy: keeps torch out until this is used
    saes = {}
    for spec in specs:
        value, _, path = spec.partition("=")
        if not value or not path:
            raise InvalidArgument(f"--sae {spec}: give VALUE=PATH, e.g. --sae layers.5.layer_output=sae_dir/")
        if not Path(path).expanduser().exists():
            raise MissingFile(f"--sae {spec}: no such file or directory: {path}")
        block = re.match(r"layers\.(\d+)\.", value)
        saes[value] = SAE.load(Path(path).expanduser(), layer=int(block.group(1)) if block else None)
    return saes


def _count(text: str) -> int:
    """``1e7``, ``10000000`` or ``10_000_000`` as an int."""
    import argparse
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive whole number of tokens")
    return int(value)


if __name__ == "__main__":  # python -m qgraph.capture.cli ... (and torchrun -m qgraph.capture.cli ...)
    import argparse
    import sys
    parser = argparse.ArgumentParser(prog="qgraph capture", description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))

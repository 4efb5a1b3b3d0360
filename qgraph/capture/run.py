"""``qgraph.capture``: values over a whole dataset, written to sharded safetensors, resumable.

One program is built (``logits=False``: nothing after the last value asked for runs); rows are
packed from the dataset (see ``data``), run ``batch_size`` at a time under ``torch.inference_mode``,
cast to ``dtype`` and handed shard by shard to the writer thread (see ``writer``), which writes and
hashes while the next forwards run. Shards hold ``shard_rows`` rows (a multiple of ``batch_size``,
so a resumed run batches every row as an uninterrupted one did and computes the same bytes).
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InvalidArgument
from ..instrument import instrument
from ..interface import Instrument
from ..saved.fields import integer
from .data import documents, open_dataset, pack
from ..distributed.world import join
from .integrity import shard_file
from .manifest import META, CaptureMismatch, check, done_shards, merge, new_manifest, recorded_shard_rows, \
    tokenizer_identity, write_json
from .writer import ShardJob, ShardWriter
from ..progress import progress

_SHARD_BYTES = 256 << 20  # the default shard size aimed at


@dataclass
class CaptureRun:
    """What a capture holds once this call returns (all ranks' shards) and how long this call took."""

    out: Path
    rows: int
    tokens: int  # real tokens (attention_mask 1)
    shards: int
    bytes: int  # the shards' bytes on disk
    seconds: float  # this call's wall time
    skipped: int = 0  # shards of this rank that an earlier run had already written
    manifest: dict = field(default_factory=dict, repr=False)


def capture(model, tokenizer, dataset, values, out, context: int = 1024, batch_size: int = 8,
            dtype: torch.dtype = torch.bfloat16, max_tokens: int | None = None, shard_rows: int | None = None,
            text_column: str = "text", chat_template: bool = False, compile=False, progress: bool = True,
            saes=None, splice: str = "error") -> CaptureRun:
    """Capture ``values`` (names, globs, or ``{name: options}``) of ``model`` (a model, or any
    ``qgraph.Instrument``: a local, remote or loaded one, its values read through it) over ``dataset`` into
    ``out``: ``manifest.json`` and ``shards/r{rank}-{index:05d}.safetensors``, one tensor per value
    (``[rows, ...]`` in the value's layout, floats cast to ``dtype``) plus ``input_ids``,
    ``attention_mask``, ``doc_id`` and ``position`` (``[rows, context]``).

    ``dataset``: a ``datasets.Dataset`` / ``IterableDataset``, a path (a ``save_to_disk`` dir, a
    parquet, jsonl or text file), a list of texts or token id lists, or a ``[documents, tokens]``
    tensor. Rerunning the same call resumes, after checking each finished shard against its
    recorded sha256 (one that fails is captured again); another setup in the same ``out`` is refused
    (``CaptureMismatch``) unless the capture there failed before finishing a shard. Under torchrun
    each rank captures rows ``rank::world``.

    ``saes={value: sae}`` splices SAEs as ``qgraph.instrument`` does, so their values can be captured:
    ``layers.5.sae.activations`` and ``layers.5.sae.indices`` (int32) are a TopK SAE's features in
    sparse form, ``[rows, context, k]``, where ``layers.5.sae.features`` would be ``d_sae`` wide.
    """
    started = time.perf_counter()
    if isinstance(max_tokens, float) and max_tokens.is_integer():
        max_tokens = int(max_tokens)  # 1e7
    _check_arguments(context, batch_size, dtype, max_tokens, shard_rows)
    if isinstance(model, Instrument) and (saes is not None or compile):
        raise InvalidArgument("saes= and compile= set up the instrument capture makes of a model: an instrument given "
                              "has its own (qgraph.instrument(model, saes=..., compile=...))")
    device = model.device if isinstance(model, Instrument) else next(model.parameters()).device
    world = join(device)
    try:
        out = Path(out)
        examples, source = open_dataset(dataset, text_column)
        request = {values: {}} if isinstance(values, str) else values
        request = dict(request) if isinstance(request, Mapping) else dict.fromkeys(request, {})
        ig = model.variant(request, logits=False) if isinstance(model, Instrument) else \
            instrument(model, values=request, logits=False, compile=compile, saes=saes, splice=splice)
        names, records = _values(ig, request, context, dtype)
        shard_rows = shard_rows or recorded_shard_rows(out) or _default_shard_rows(records, context, batch_size)
        identity = {**ig.identity(),
                    "values": [{k: r[k] for k in ("name", "layout", "options")}
                                                                for r in records],
                    "dtype": str(dtype).removeprefix("torch."), "context": context, "batch_size": batch_size,
                    "shard_rows": shard_rows, "max_tokens": max_tokens, "world_size": world.size,
                    "tokenizer": tokenizer_identity(tokenizer),
                    "data": {**source, "text_column": text_column, "chat_template": chat_template}}
        begun = check(out, identity)
        world.barrier()
        if world.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if begun is None:  # a new capture, or one that finished no shard: (re)start its manifest
                write_json(out / "manifest.json", new_manifest(identity, _description(records, world.size)))
            (out / "shards").mkdir(exist_ok=True)
        world.barrier()
        pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        rows = pack(documents(examples, tokenizer, text_column, chat_template), context, max_tokens, pad_id)
        skipped = _run(ig, names, rows, out, world, device, dtype, batch_size, shard_rows, max_tokens,
                       progress and world.rank == 0)
        world.barrier()
        if world.rank == 0:
            merge(out, world.size)
        world.barrier()
    finally:
        world.close()
    manifest = json.loads((out / "manifest.json").read_text())
    return CaptureRun(out, manifest["rows"], manifest["tokens"], len(manifest["shards"]), manifest["bytes"],
                      time.perf_counter() - started, skipped, manifest)


def _run(ig, names, rows, out, world, device, dtype, batch_size, shard_rows, max_tokens, show) -> int:
    """The capture loop of one rank; returns how many of its shards were already done."""
    done = {shard["index"]: shard for shard in done_shards(out, world.rank, verify=True)}
    writer = ShardWriter(out, world.rank, [done[i] for i in sorted(done)])
    mine = ((index, row) for index, row in enumerate(rows) if index % world.size == world.rank)
    total = -(-max_tokens // world.size) if max_tokens else None  # this rank's share
    with progress("capturing", total=total, unit="tok") if show else _quiet() as bar:
        if total is None:  # a counter: show the rate too
            bar.bar_format = "{desc}: {n_fmt} tok [{elapsed}, {rate_fmt}{postfix}]"
        try:
            return _loop(ig, names, mine, out, done, writer, bar, device, dtype, batch_size, shard_rows, world)
        finally:
            writer.close()  # the shards already computed are written even if the loop stopped


def _loop(ig, names, mine, out, done, writer, bar, device, dtype, batch_size, shard_rows, world) -> int:
    skipped = 0
    for index, chunk in enumerate(_chunks(mine, shard_rows)):
        meta = {name: torch.stack([getattr(row, name) for _, row in chunk]) for name in META}
        record = {"file": shard_file(world.rank, index), "rank": world.rank, "index": index,
                  "rows": len(chunk), "row_start": chunk[0][0], "row_step": world.size,
                  "tokens": int(meta["attention_mask"].sum()), "tokens_sha256": _tokens_sha256(meta)}
        if index in done:
            if done[index]["tokens_sha256"] != record["tokens_sha256"]:
                raise CaptureMismatch(f"{out} holds a capture of other data: the tokens of {record['file']} "
                                      f"differ from this dataset's. Capture into another out dir, or delete "
                                      f"{out} to start over")
            skipped += 1
            bar.update(record["tokens"])
            continue
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        for start in range(0, len(chunk), batch_size):
            ids, mask = (meta[key][start:start + batch_size].to(device) for key in ("input_ids", "attention_mask"))
            with torch.inference_mode():
                output = ig(input_ids=ids, attention_mask=mask)
                for name in names:
                    tensor = output[name]
                    parts[name].append(tensor.to("cpu", dtype) if tensor.is_floating_point() else tensor.cpu())
            bar.update(int(mask.sum()))
            bar.set_postfix_str(f"{writer.mb_per_s():.1f} MB/s written", refresh=False)
        parts.update({name: [tensor] for name, tensor in meta.items()})
        writer.put(ShardJob(record, parts))
    return skipped


def _values(ig, request: dict, context: int, dtype: torch.dtype):
    """The value names the request selects, and for each its layout, options and estimated bytes per row."""
    options = {}
    for pattern, option in request.items():
        for name in ig.resolve(pattern):
            options[name] = {key: str(value) if isinstance(value, torch.dtype) else value
                             for key, value in (option or {}).items()}
    names = ig.resolve(list(request))
    if not names:
        raise InvalidArgument(f"values={list(request)} selects no value")
    table = ig.catalogue
    records = []
    for name in names:
        entry = table[name]
        dims = [1 if dim == "batch" else dim if isinstance(dim, int) else context for dim in entry.shape]
        records.append({"name": name, "layout": entry.layout, "options": options.get(name, {}),
                        "row_bytes": _prod(dims) * dtype.itemsize})
    return names, records


def _default_shard_rows(records, context: int, batch_size: int) -> int:
    """Rows per shard near ``_SHARD_BYTES``, a multiple of ``batch_size``."""
    row_bytes = sum(r["row_bytes"] for r in records) + len(META) * 8 * context
    return max(1, _SHARD_BYTES // row_bytes // batch_size) * batch_size


def _description(records, world_size: int) -> dict:
    """How to read the shards, for the manifest."""
    return {"tensors": {**{r["name"]: f"{r['layout']}, rows first" for r in records},
                        **{name: "int64 [rows context]" for name in META}},
            "packing": "documents laid end to end in context-token rows (a text document ends with the tokenizer's "
                       "eos token); doc_id is the document's index in the dataset, position the token's index in its "
                       "document; the last row is padded (attention_mask 0, doc_id and position -1)",
            "row_order": f"shard rows are the global rows row_start + k * row_step (rank r of {world_size} takes rows "
                    f"r::{world_size})"}


def _chunks(iterable, size: int):
    chunk = []
    for item in iterable:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _tokens_sha256(meta: dict) -> str:
    digest = hashlib.sha256()
    for name in META:
        digest.update(meta[name].numpy().tobytes())
    return digest.hexdigest()


def _prod(dims) -> int:
    result = 1
    for dim in dims:
        result *= dim
    return result


class _quiet:
    """A stand-in progress bar that shows nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass

    def set_postfix_str(self, *args, **kwargs):
        pass


def _check_arguments(context, batch_size, dtype, max_tokens, shard_rows) -> None:
    positive = integer(1)
    for label, value in (("context", context), ("batch_size", batch_size)):
        if not positive(value):
            raise InvalidArgument(f"{label} must be a positive int, got {value!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgument(f"dtype must be a floating torch dtype (torch.bfloat16, torch.float32), got {dtype!r}")
    if max_tokens is not None and not positive(max_tokens):
        raise InvalidArgument(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    if shard_rows is not None and (not positive(shard_rows) or shard_rows % batch_size):
        raise InvalidArgument(f"shard_rows must be a positive multiple of batch_size ({batch_size}), got "
                              f"{shard_rows!r}")

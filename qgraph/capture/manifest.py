"""The capture dir's ``manifest.json``: what was captured, from what, and which shards are done.

``identity`` holds everything the shards' bytes depend on (the model's config and weights, the
values, dtype, context, batching, tokenizer, dataset, world size); a rerun with another identity
in the same dir is refused with ``CaptureMismatch``, naming each difference, unless the dir has
no finished shard yet (a capture that failed before its first shard): then the new call takes it
over. Each rank records its finished shards (with their sizes and sha256) in
``shards/r{rank}-done.json`` as it goes; rank 0 merges those into the manifest at the end. Every
file here is written to a temporary name and renamed, and holds no time stamp, so a resumed capture
writes the same bytes as an uninterrupted one.
"""
from __future__ import annotations

import json
import os
import warnings
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING


from ..errors import CaptureMismatch
from ..identity import sha
from .integrity import damage

if TYPE_CHECKING:  # a type only: transformers is imported with the model
    pass

FORMAT = "qgraph-capture/2"  # 2: every weight hashed, shards carry their place in their metadata
META = ("input_ids", "attention_mask", "doc_id", "position")  # int64 [rows, context] in every shard


def tokenizer_identity(tokenizer) -> dict | None:
    if tokenizer is None:
        return None
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    return {"class": type(tokenizer).__name__, "name": str(getattr(tokenizer, "name_or_path", "") or ""),
            "vocab_sha256": sha(vocab), "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}


def versions() -> dict:
    found: dict[str, str | None] = {}
    for package in ("qgraph", "torch", "transformers", "safetensors", "datasets"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


# -- comparing ---------------------------------------------------------------------------------------
def recorded_shard_rows(out: Path) -> int | None:
    """The shard size of the capture in ``out``, if it has finished shards: a rerun that leaves
    ``shard_rows`` to the default resumes with it (the default depends on the dtype and values, so
    it is read, not redone)."""
    if not has_shards(out):
        return None
    try:
        return json.loads((out / "manifest.json").read_text())["identity"]["shard_rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def has_shards(out: Path) -> bool:
    """Whether ``out`` holds a finished shard (a temporary one of a shard being written does not count)."""
    return any((out / "shards").glob("r*-*.safetensors"))


def check(out: Path, identity: dict) -> dict | None:
    """The manifest in ``out`` if it records this identity; None if ``out`` holds no capture yet,
    or a capture manifest with no finished shard (a run that failed early: this call takes it over).
    Raises ``CaptureMismatch`` naming what differs (or that ``out`` is not a capture dir)."""
    path = out / "manifest.json"
    if out.exists() and not out.is_dir():
        raise CaptureMismatch(f"{out} is a file, not a dir: capture into a new or empty dir")
    if not path.exists():
        stray = [p.name for p in out.iterdir()] if out.is_dir() else []
        if stray:
            raise CaptureMismatch(f"{out} is not empty and has no manifest.json (it has {sorted(stray)[:5]}): "
                                  f"capture into a new or empty dir")
        return None
    try:
        manifest = json.loads(path.read_text())
        kind = str(manifest.get("format"))
    except (ValueError, AttributeError):
        kind = None
    if kind is None or not kind.startswith("qgraph-capture/"):
        raise CaptureMismatch(f"{path} is not a qgraph capture manifest ({FORMAT}); capture into another dir")
    if not has_shards(out):
        return None
    if kind != FORMAT:
        raise CaptureMismatch(f"{out} holds a capture of another qgraph version (format {kind}; this one writes "
                              f"{FORMAT}): capture into another out dir, or delete {out} to start over")
    differences = list(_differences(manifest["identity"], identity))
    if differences:
        raise CaptureMismatch(f"{out} holds a capture of another setup: {'; '.join(differences)}. Capture into "
                              f"another out dir, or delete {out} to start over")
    return manifest


# Recorded, not compared: the same weights and vocabulary under another path or class name resume.
_NOT_COMPARED = {"model.name", "tokenizer.name", "tokenizer.class"}


def _differences(old, new, path=""):
    """Human-readable differences between two identities (nested dicts)."""
    if path in _NOT_COMPARED:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            yield from _differences(old.get(key), new.get(key), f"{path}.{key}" if path else key)
    elif old != new:
        if path == "values":
            had = [v["name"] for v in old or []]
            asked = [v["name"] for v in new or []]
            if had == asked:
                yield f"the values' options differ (it has {old}, this call asks {new})"
            else:
                yield f"the values differ (it has {_short(had)}, this call asks {_short(asked)})"
        elif path.endswith("_sha256"):
            yield f"{path.replace('_sha256', '').replace('.', ' ')} differ"
        else:
            yield f"{path} differs (it has {old!r}, this call has {new!r})"


def _short(names: list, limit: int = 6) -> str:
    return str(names[:limit])[:-1] + (f", ... {len(names) - limit} more]" if len(names) > limit else "]")


# -- writing -----------------------------------------------------------------------------------------
def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON to a temporary name, then rename it to ``path``."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(temporary, path)


def new_manifest(identity: dict, records: dict) -> dict:
    """The manifest of a capture that has begun: ``records`` says how it reads its inputs."""
    return {"format": FORMAT, "identity": identity, **records, "versions": versions(), "complete": False,
            "rows": 0, "tokens": 0, "bytes": 0, "shards": []}


def done_path(out: Path, rank: int) -> Path:
    return out / "shards" / f"r{rank}-done.json"


def done_shards(out: Path, rank: int, verify: bool = False) -> list[dict]:
    """The shards ``rank`` finished, each still on disk with its recorded size and (``verify``: a
    resuming run, which skips them) its recorded sha256; one that fails is left out, with a warning
    when ``verify``, so it is captured again."""
    path = done_path(out, rank)
    if not path.exists():
        return []
    kept = []
    for shard in json.loads(path.read_text()):
        problem = damage(out, shard, hashed=verify)
        if problem is None:
            kept.append(shard)
        elif verify:
            warnings.warn(f"qgraph: {out / shard['file']} {problem}; capturing it again", stacklevel=3)
    return kept


def merge(out: Path, world: int) -> dict:
    """Rank 0's last step: the manifest with every rank's finished shards, marked complete."""
    manifest = json.loads((out / "manifest.json").read_text())
    shards = [shard for rank in range(world) for shard in done_shards(out, rank)]
    shards.sort(key=lambda s: (s["rank"], s["index"]))
    manifest.update(shards=shards, complete=True,
                    rows=sum(s["rows"] for s in shards), tokens=sum(s["tokens"] for s in shards),
                    bytes=sum(s["bytes"] for s in shards))
    write_json(out / "manifest.json", manifest)
    return manifest

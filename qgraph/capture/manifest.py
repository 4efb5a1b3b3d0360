"""The capture dir's ``manifest.json``: what was captured, from what, and which shards are done.

``identity`` holds everything the shards' bytes depend on (the model's config and weights, the
values, dtype, context, batching, tokenizer, dataset, world size); a rerun with another identity
in the same dir is refused with ``CaptureMismatch``, naming each difference. Each rank records its
finished shards in ``shards/r{rank}-done.json`` as it goes; rank 0 merges those into the manifest
at the end. Every file here is written to a temporary name and renamed, and holds no time stamp,
so a resumed capture writes the same bytes as an uninterrupted one.
"""
from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

import torch

FORMAT = "qgraph-capture/1"
_SAMPLE = 4096  # elements of each parameter hashed for the weights' hash


class CaptureMismatch(ValueError):
    """The out dir holds a capture of another setup (model, values, dataset...)."""


def model_identity(model: torch.nn.Module) -> dict:
    """The model's class, name, a hash of its config and a hash of a sample of every parameter
    (``_SAMPLE`` evenly spaced elements, with names, shapes and dtypes): any fine-tune, reload of
    other weights or dtype change gives another hash, without reading gigabytes."""
    config = model.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "_attn_implementation_autoset"):
        config.pop(key, None)
    return {"class": type(model).__name__, "name": str(getattr(model.config, "_name_or_path", "") or ""),
            "config_sha256": _sha(json.dumps(config, sort_keys=True, default=str)),
            "weights_sha256": _weights_sha256(model)}


def saes_identity(saes: dict) -> dict:
    """For each spliced SAE (``{hook: (sae, splice)}``): where it came from, its form and a hash of its weights."""
    return {hook: {"source": sae.source, "splice": splice, "form": sae.extra_repr(), "weights_sha256": _weights_sha256(sae)}
            for hook, (sae, splice) in sorted(saes.items())}


def _weights_sha256(module: torch.nn.Module) -> str:
    weights = hashlib.sha256()
    for name, parameter in module.state_dict().items():
        flat = parameter.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // _SAMPLE)][:_SAMPLE].to("cpu").contiguous()
        weights.update(f"{name}{tuple(parameter.shape)}{parameter.dtype}".encode())
        weights.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return weights.hexdigest()


def tokenizer_identity(tokenizer) -> dict | None:
    if tokenizer is None:
        return None
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    return {"class": type(tokenizer).__name__, "name": str(getattr(tokenizer, "name_or_path", "") or ""),
            "vocab_sha256": _sha(vocab), "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}


def versions() -> dict:
    found = {}
    for package in ("qgraph", "torch", "transformers", "safetensors", "datasets"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- comparing ---------------------------------------------------------------------------------------
def recorded_shard_rows(out: Path) -> int | None:
    """The shard size of the capture in ``out``, if any: a rerun that leaves ``shard_rows`` to the
    default resumes with it (the default depends on the dtype and values, so it is read, not redone)."""
    try:
        return json.loads((out / "manifest.json").read_text())["identity"]["shard_rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check(out: Path, identity: dict) -> dict | None:
    """The manifest in ``out`` if it records this identity; None if ``out`` holds no capture yet.
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
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise CaptureMismatch(f"{path} is not a qgraph capture manifest ({FORMAT}); capture into another dir")
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


def done_shards(out: Path, rank: int) -> list[dict]:
    """The shards ``rank`` finished, each still on disk with its recorded size."""
    path = done_path(out, rank)
    if not path.exists():
        return []
    shards = json.loads(path.read_text())
    return [s for s in shards if (out / s["file"]).is_file() and (out / s["file"]).stat().st_size == s["bytes"]]


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

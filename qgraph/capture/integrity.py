"""Whether a capture dir holds what its manifest says: the shards' bytes and the manifest's layout.

Each shard's manifest entry records its size and sha256, and each shard file carries its own
``rank``, ``index``, ``row_start``, ``row_step`` and ``rows`` in its safetensors metadata (key
``qgraph_capture``), so a shard file is bound to its entry both ways: by its bytes (the hash) and
by what it says it is (the metadata). ``check_layout`` checks the manifest alone: the entries are
laid out as ``capture`` writes them and cover the rows once each. Everything wrong is a
``CaptureCorrupt`` naming the file and what is inconsistent.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import CaptureCorrupt

METADATA_KEY = "qgraph_capture"  # the one metadata key of a shard (one key: the header is deterministic)
PLACE = ("rank", "index", "row_start", "row_step", "rows")  # what a shard's metadata says it is
REPAIR = ("rerun the capture that wrote this dir (the same call or command, the same out): it checks every "
          "shard, captures damaged ones again and rewrites the manifest; or capture into a new dir")


def shard_file(rank: int, index: int) -> str:
    """The path, in the capture dir, of shard ``index`` of ``rank``."""
    return f"shards/r{rank}-{index:05d}.safetensors"


def shard_metadata(record: dict) -> dict[str, str]:
    """The safetensors metadata a shard is written with: its place (``PLACE``) as one sorted JSON string."""
    return {METADATA_KEY: json.dumps({key: record[key] for key in PLACE}, sort_keys=True)}


def file_sha256(path: Path, sync: bool = False) -> str:
    """The sha256 of the file at ``path``, read in 16 MiB chunks (``sync``: fsync it too)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
        if sync:
            os.fsync(file.fileno())
    return digest.hexdigest()


def damage(out: Path, shard: dict, hashed: bool = True) -> str | None:
    """What is wrong with the bytes of ``shard``'s file against its entry (missing, another size,
    another sha256 when ``hashed``), or None."""
    path = out / shard["file"]
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != shard["bytes"]:
        return f"has {size} bytes where its manifest entry records {shard['bytes']} (truncated or rewritten)"
    if hashed and file_sha256(path) != shard["sha256"]:
        return "does not have the sha256 its manifest entry records: its bytes changed after it was written"
    return None


def check_bytes(out: Path, shard: dict, hashed: bool = True) -> None:
    """Raise ``CaptureCorrupt`` if ``damage`` finds something."""
    problem = damage(out, shard, hashed)
    if problem:
        raise CaptureCorrupt(f"{out / shard['file']} {problem}: {REPAIR}")


def check_header(out: Path, shard: dict, names: list[str]) -> None:
    """Raise ``CaptureCorrupt`` unless the shard file's metadata says it is the shard its entry
    describes and it holds the tensors ``names``, each ``rows`` first (reads the header only)."""
    from safetensors import safe_open
    path = out / shard["file"]
    check_bytes(out, shard, hashed=False)
    try:
        with safe_open(str(path), "pt") as file:
            metadata = (file.metadata() or {}).get(METADATA_KEY)
            shapes = {name: file.get_slice(name).get_shape() for name in file.keys()}
    except Exception as error:  # noqa: BLE001 (safetensors' errors do not name the file)
        raise CaptureCorrupt(f"{path} is not a readable safetensors file ({error}): {REPAIR}") from None
    try:
        says = json.loads(metadata) if metadata is not None else None
    except (TypeError, ValueError):
        says = None
    if not isinstance(says, dict):
        raise CaptureCorrupt(f"{path} has no '{METADATA_KEY}' metadata: it is not a shard this qgraph wrote; "
                             f"{REPAIR}")
    wrong = [f"{key} {says.get(key)!r} in the file, {shard.get(key)!r} in the manifest" for key in PLACE
             if says.get(key) != shard.get(key)]
    if sorted(shapes) != sorted(names):
        wrong.append(f"tensors {sorted(shapes)} in the file, the manifest's values and row data are {sorted(names)}")
    rows = sorted({shape[0] if shape else 0 for shape in shapes.values()})
    if rows != [shard.get("rows")]:
        wrong.append(f"its tensors have {' or '.join(map(str, rows))} rows, the manifest records {shard.get('rows')!r}")
    if wrong:
        raise CaptureCorrupt(f"{path} is not the shard its manifest entry describes ({'; '.join(wrong)}): {REPAIR}")


def check_layout(out: Path, manifest: dict) -> None:
    """Raise ``CaptureCorrupt`` unless the manifest's shards are laid out as ``capture`` writes them:
    rank r's shards are ``shard_file(r, i)`` for i = 0, 1, ...; shard i holds ``shard_rows`` rows
    (the last one of a rank at most that), the global rows ``r + (i * shard_rows + k) * world``;
    and all ranks' rows together are 0 .. ``rows`` - 1, each once."""
    try:
        _check_layout(out / "manifest.json", manifest)
    except (KeyError, TypeError, AttributeError) as error:
        raise CaptureCorrupt(f"{out / 'manifest.json'} is malformed ({type(error).__name__}: {error}): "
                             f"{REPAIR}") from None


def _check_layout(path: Path, manifest: dict) -> None:
    per, world = manifest["identity"]["shard_rows"], manifest["identity"]["world_size"]
    ranks: dict[int, list] = {rank: [] for rank in range(world)}
    for shard in manifest["shards"]:
        if shard["rank"] not in ranks:
            raise CaptureCorrupt(f"{path}'s entry for {shard['file']} gives rank {shard['rank']!r}, but the capture "
                                 f"ran on {world} rank(s): {REPAIR}")
        ranks[shard["rank"]].append(shard)
    total = sum(shard["rows"] for shard in manifest["shards"])
    for rank, shards in ranks.items():
        shards.sort(key=lambda shard: shard["index"])
        for index, shard in enumerate(shards):
            expected = {"file": shard_file(rank, index), "index": index, "row_step": world,
                        "row_start": rank + index * per * world}
            wrong = [f"{key} {shard[key]!r} where shard {index} of rank {rank} has {value!r}"
                     for key, value in expected.items() if shard[key] != value]
            last = index == len(shards) - 1
            if not (shard["rows"] == per or last and 0 < shard["rows"] < per):
                wrong.append(f"rows {shard['rows']!r} where a shard holds {per}" + (" or fewer (the last)" * last))
            if wrong:
                raise CaptureCorrupt(f"{path}'s entry for {shard['file']} is inconsistent: {'; '.join(wrong)}: "
                                     f"{REPAIR}")
        want = len(range(rank, total, world))
        have = sum(shard["rows"] for shard in shards)
        if have != want:
            where = f"its last shard {shards[-1]['file']}" if shards else "no shard"
            raise CaptureCorrupt(f"{path} gives rank {rank} {have} rows ({where}), but {total} rows in all put "
                                 f"{want} on rank {rank} (rows {rank}::{world}): a shard is missing or its row count "
                                 f"was changed: {REPAIR}")
    if manifest["rows"] != total:
        raise CaptureCorrupt(f"{path} says rows {manifest['rows']!r}, but its shards hold {total}: {REPAIR}")

"""Dictionaries by name: ``SAE.load("org/repo", sae_id=...)``, ``Transcoder.load("org/repo", layer=i)`` and
``CrossLayerTranscoder.load("org/repo", subfolder=...)`` read a Hugging Face Hub repository through
``huggingface_hub``: only the files the dictionary needs are fetched into the Hub's cache, then read as a
local folder by the format readers (``formats``, ``transcoder_formats``, ``clt_formats``).

``local`` tells a name's readings apart. A path that exists (a str or a Path) is read as before (the
folder named by ``sae_id=`` / ``subfolder=`` joined to it); a str ``org/repo`` that is no path is a repo
id; anything else is refused, naming both readings. An SAELens release name
(``gemma-scope-2b-pt-res-canonical``) is no repo id, and qgraph keeps no table of releases: SAELens's
``pretrained_saes.yaml`` gives each release's ``repo_id`` and each SAE's folder in it (its ``path``), the
two to pass.

What each loader fetches of its folder (``LAYOUTS``; a numbered file's group is its layer, and only the
layer asked is fetched: a folder of one layer needs none asked):

* SAE: SAELens's ``cfg.json`` + ``sae_weights.safetensors`` (a release's SAE sits in the folder named by
  its sae_id), sparsify's ``cfg.json`` + ``sae.safetensors`` (or ``layers.{i}/`` of them), Qwen-Scope's
  ``layer{i}.sae.pt`` (its k from the ``L0_<k>`` of the repo's name, which the cache's folder keeps);
* transcoder: circuit-tracer's ``config.yaml`` + ``layer_{i}.safetensors``, or the file its
  ``transcoders`` list names in the repo for the layer; SAELens's ``cfg.json`` + ``sae_weights.safetensors``
  (or ``layer_{i}/`` of them);
* cross-layer transcoder: every ``W_enc_{i}`` / ``W_dec_{i}`` (circuit-tracer) or ``params_layer_{i}``
  (Gemma Scope 2) ``.safetensors``, and a ``config.yaml``.

Online, the repo's tree is listed first with each file's size, and each file to fetch is checked against
``bounds`` before it is downloaded (``snapshot_download`` with ``allow_patterns`` of exactly those files),
then again by its size on disk. Offline (``HF_HUB_OFFLINE=1``), or where the Hub cannot be reached, the
cached snapshot is read (``local_files_only``), its files and sizes listed from the disk.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import huggingface_hub
from huggingface_hub import HfApi, constants, scan_cache_dir
from huggingface_hub.errors import (HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import validate_repo_id

from ..errors import InvalidArgument, MissingFile
from . import bounds
from .formats import read_yaml
from .transcoder_formats import set_files

LAYOUTS = {
    "SAE": (r"cfg\.json", r"sae_weights\.safetensors", r"sae\.safetensors", r"layer(\d+)\.sae\.pt",
            r"layers\.(\d+)/(?:cfg\.json|sae\.safetensors)"),
    "transcoder": (r"config\.yaml", r"cfg\.json", r"sae_weights\.safetensors", r"layer_(\d+)\.safetensors",
                   r"layer_(\d+)/(?:cfg\.json|sae_weights\.safetensors)"),
    "cross-layer transcoder": (r"config\.yaml", r"(?:W_enc|W_dec|params_layer)_\d+\.safetensors"),
}
_SHOWN = 12  # names a message lists before "..."
_RELEASES = ("; an SAELens release name (such as 'gemma-scope-2b-pt-res-canonical') is no repo id: pass the "
             "release's repo_id and the SAE's folder in it, as SAELens's pretrained_saes.yaml lists them")


def local(name, kind: str, folder: str | None = None, revision: str | None = None, layer: int | None = None,
          argument: str = "subfolder"):
    """What the reader of ``kind`` (a key of ``LAYOUTS``) reads for ``name``: a path that exists, as given
    (``folder`` joined to it); else the cached copy of the Hub repository ``name`` (``org/repo``) at
    ``revision``, ``folder`` in it, fetched as needed (``layer``: the one layer of a numbered layout).
    ``argument`` is what the caller calls ``folder`` (``sae_id``, ``subfolder``), for its messages."""
    if folder is not None and not (isinstance(folder, str) and _inside(folder)):
        raise InvalidArgument(f"{argument}={folder!r}: give a folder inside the repository as a relative path "
                              f"('layer_3/width_16k')")
    if not isinstance(name, str) or Path(name).exists():
        if revision is not None:
            raise InvalidArgument(f"revision={revision!r} picks a version of a Hub repository; {name} is a local path")
        return Path(name) / folder if folder else name
    if not _repo_id(name):
        raise MissingFile(f"no {kind} at {name!r}: nothing is at that local path, and it is no Hub repository id "
                          f"('org/repo'){_RELEASES if '/' not in name else ''}: give a local file or folder, or a "
                          f"repo id (with {argument}= for the {kind}'s folder in it)")
    return _fetch(name, kind, folder.strip("/") if folder else "", revision, layer, argument)


def _fetch(repo: str, kind: str, folder: str, revision: str | None, layer: int | None, argument: str) -> Path:
    files, source = _listing(repo, revision)
    where = repo + (f"/{folder}" if folder else "") + (f" (revision {revision})" if revision else "")
    prefix = f"{folder}/" if folder else ""
    inside = {path[len(prefix):]: size for path, size in files.items() if path.startswith(prefix)}
    wanted = _wanted(inside, LAYOUTS[kind], layer, kind, where)
    if not wanted:
        homes = [home or "(the repo's root: no folder)" for home in _homes(files, LAYOUTS[kind])]
        held = f"its folders holding {_a(kind)} are {_names(homes)}" if homes else f"it holds no {kind} qgraph reads"
        raise MissingFile(f"{where}: no {kind} there ({source}); {held}: give {argument}= one of them")
    root = _download(repo, revision, [prefix + name for name in wanted], files, source)
    if kind == "transcoder" and "config.yaml" in wanted:  # a circuit-tracer set's config may name its layer files
        listed = [path for path in _listed(repo, root, folder, layer) if path not in (prefix + name for name in wanted)]
        if listed:
            root = _download(repo, revision, listed, files, source)
    return root / folder


def _wanted(inside: dict[str, int], patterns: tuple[str, ...], layer: int | None, kind: str, where: str) -> list[str]:
    """The files of the folder (``inside``: names within it) that the layout needs: every unnumbered one
    and the layer's numbered ones; an InvalidArgument naming the layers where the layer is not one of them."""
    plain: list[str] = []
    numbered: dict[int, list[str]] = {}
    for name in sorted(inside):
        match = next((found for pattern in patterns if (found := re.fullmatch(pattern, name))), None)
        if match is not None and match.groups():
            numbered.setdefault(int(match[1]), []).append(name)
        elif match is not None:
            plain.append(name)
    if layer is None and len(numbered) == 1:
        layer = next(iter(numbered))
    if numbered and layer not in numbered and all(PurePosixPath(name).suffix in bounds.SETTINGS for name in plain):
        said = "no layer= was given" if layer is None else f"layer={layer} is not there"
        raise InvalidArgument(f"{where} holds {kind}s of layers {_names(sorted(numbered))}; {said}: give layer= "
                              f"one of them")
    return plain + (numbered.get(layer, []) if layer is not None else [])


def _listed(repo: str, root: Path, folder: str, layer: int | None) -> list[str]:
    """The repo path of the layer file a circuit-tracer ``config.yaml`` in ``root / folder`` lists (the
    layer asked's, or the set's one): a file of the repo itself (an ``hf://`` one of another repo, or no such
    layer, is left to the reader to name)."""
    home = root / folder
    config = read_yaml(home / "config.yaml")
    if not isinstance(config.get("transcoders"), list):
        return []
    entries = set_files(home, config)
    if layer is None and len(entries) == 1:
        layer = next(iter(entries))
    entry = entries.get(layer) if layer is not None else None
    if isinstance(entry, Path):  # in the snapshot already (fetched before, or offline)
        return [entry.relative_to(root).as_posix()] if entry.is_relative_to(root) else []
    if entry is None or not entry.startswith("hf://"):
        return [] if entry is None else [str(PurePosixPath(folder, entry))]
    url = urlparse(entry)
    parts = PurePosixPath(url.path.lstrip("/")).parts
    return ["/".join(parts[1:])] if len(parts) > 1 and f"{url.netloc}/{parts[0]}" == repo else []


def _download(repo: str, revision: str | None, paths: list[str], files: dict[str, int], source: str) -> Path:
    """The snapshot folder holding ``paths`` (repo paths), each size checked against ``bounds`` before it is
    fetched (the Hub's, or the cache's on disk) and again on disk after."""
    for path in paths:
        if path not in files:
            raise MissingFile(f"{repo} has no file {path} ({source})")
        bounds.check(f"{repo}/{path}", files[path])
    patterns = [glob.escape(path) for path in paths]  # exactly these files (fnmatch patterns, escaped)
    root = Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=patterns,
                                                  local_files_only=source != "the Hub"))
    for path in paths:
        bounds.check(root / path)
    return root


def _listing(repo: str, revision: str | None) -> tuple[dict[str, int], str]:
    """``({repo path: bytes}, where from)``: the Hub's tree, or (offline, or the Hub out of reach) the
    cached snapshot's files on disk."""
    unreachable = None
    if not constants.HF_HUB_OFFLINE:
        try:
            tree = HfApi().list_repo_tree(repo, recursive=True, revision=revision)
            return {entry.path: entry.size for entry in tree if isinstance(entry, RepoFile)}, "the Hub"
        except RevisionNotFoundError:
            raise MissingFile(f"{repo} has no revision {revision!r} on the Hub: give a branch, tag or commit of "
                              f"it") from None
        except RepositoryNotFoundError:  # gated and private ones too, without a token that reads them
            raise MissingFile(f"no local path {repo!r}, and the Hub has no repository {repo!r} this machine can "
                              f"read (a private or gated one needs `hf auth login`): give a local folder or a repo "
                              f"id that exists") from None
        except Exception as error:  # no network, a timeout, the Hub down: the cached copy, as huggingface_hub does
            unreachable = error
    root = _cached(repo, revision, unreachable)
    files = (file for file in root.rglob("*") if file.is_file())
    return {file.relative_to(root).as_posix(): file.stat().st_size for file in files}, "as the local cache holds it"


def _cached(repo: str, revision: str | None, unreachable: Exception | None) -> Path:
    """The cached snapshot of ``repo`` at ``revision``, or a MissingFile naming the repos the cache holds."""
    try:
        return Path(huggingface_hub.snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError as error:
        partial = getattr(error, "snapshot_path", None)  # a snapshot fetched in part: its files are what there is
        if partial:
            return Path(partial)
    why, way = ("HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE to download it") if unreachable is None else (
        f"the Hub could not be reached: {type(unreachable).__name__}: {str(unreachable)[:200]}", "download it online")
    try:
        repos = scan_cache_dir(constants.HF_HUB_CACHE).repos
        cached = sorted(entry.repo_id for entry in repos if entry.repo_type == "model")
    except Exception:  # no cache folder yet, or one it cannot read: nothing to name
        cached = []
    at = f" at revision {revision!r}" if revision else ""
    raise MissingFile(f"no local path {repo!r}, and the Hub repository {repo!r}{at} is not in the local cache ({why}; "
                      f"it holds {_names(cached) if cached else 'no repository'}): {way}, or give a local folder")


def _homes(files: dict[str, int], patterns: tuple[str, ...]) -> list[str]:
    """The folders of the repo whose files fit the layout (``""``: its root)."""
    found = set()
    for path in files:
        parts = path.split("/")
        for cut in range(len(parts)):
            if any(re.fullmatch(pattern, "/".join(parts[cut:])) for pattern in patterns):
                found.add("/".join(parts[:cut]))
    return sorted(found)


def _repo_id(name: str) -> bool:
    """Whether ``name`` is a Hub repository id with its owner: ``org/repo``."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return name.count("/") == 1


def _inside(folder: str) -> bool:
    """Whether ``folder`` is a relative path that stays inside the folder it is joined to."""
    path = PurePosixPath(folder)
    return bool(folder.strip("/")) and not path.is_absolute() and ".." not in path.parts and "\\" not in folder


def _a(kind: str) -> str:
    return f"an {kind}" if kind == "SAE" else f"a {kind}"


def _names(items: list) -> str:
    shown = ", ".join(map(str, items[:_SHOWN]))
    return shown + (f", ... ({len(items)} in all)" if len(items) > _SHOWN else "")

"""Reading cross-layer transcoders from disk into the keyword arguments of ``CrossLayerTranscoder(...)``
(the record's conventions are in ``clt.py``). A CLT is a folder; ``read`` tells its two layouts apart:

* **circuit-tracer** (``circuit_tracer/transcoder/cross_layer_transcoder.py``: ``to_safetensors``
  writes it, ``load_clt`` reads it): per block i, ``W_enc_{i}.safetensors`` holding ``W_enc_{i}
  [d_transcoder, d_model]`` (encoded ``x @ W_enc_i.T``), ``b_enc_{i} [d_transcoder]``, ``b_dec_{i}
  [d_model]`` and, for JumpReLU, ``threshold_{i} [d_transcoder]``; ``W_dec_{i}.safetensors`` holding
  ``W_dec_{i} [d_transcoder, n - i, d_model]``. The blocks are ``W_enc_0`` to ``W_enc_{n-1}``
  (circuit-tracer counts the ``W_enc_*`` files), each with its ``W_dec_{i}``. An optional
  ``config.yaml`` beside (circuit-tracer's, ``model_kind: cross_layer_transcoder``) names
  ``feature_input_hook`` and ``feature_output_hook``; without one the CLT reads ``mlp_input``
  (circuit-tracer's ``load_clt`` itself defaults to ``hook_resid_mid``: give ``reads="layer_mid"``
  for such a folder). circuit-tracer's format has no skip path.
* **Gemma Scope 2** (``google/gemma-scope-2-{270m,1b}-{pt,it}``, folders ``clt/width_262k_l0_medium``
  and ``..._affine``): per block i, ``params_layer_{i}.safetensors`` holding ``w_enc [d_model,
  d_transcoder]`` (``x @ w_enc``), ``b_enc``, ``b_dec``, ``threshold`` (JumpReLU), ``w_dec [d_transcoder,
  n, d_model]`` (a decoder to every block: its ``[:, i:]`` is kept, the rest dropped, as circuit-tracer
  drops it) and, in the ``_affine`` sets, ``affine_skip_connection [d_model, d_model]`` (``x @ it``).
  The keys, shapes and conventions follow circuit-tracer 0.5's ``load_gemma_scope_2_clt`` (which is
  given one file per block from a config's ``transcoders`` list); the file names are those public
  scripts read from the Hub. The ``config.json`` beside is not read (its fields are not documented
  where qgraph could check them); a ``config.yaml`` beside, where there is one, is read as circuit-tracer's.

Both are untrusted data: safetensors only (never a pickle), each file one of the folder's own (a link
out of the folder is refused, but for a Hub cache snapshot's links to its repo's blobs), each file's size
bounded (``bounds``), the tensors named above and no others read, each tensor's shape and
dtype checked from the header before its bytes are read, and the blocks numbered 0 to n - 1 with
every file there. circuit-tracer casts to the dtype asked (bfloat16 by default) and may read the
decoders lazily; qgraph keeps the files' dtype unless ``dtype=`` says otherwise, and reads every
decoder (the splice decodes densely).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import InvalidArgument, MissingFile, NotSupported
from . import bounds
from .formats import read_yaml
from .transcoder_formats import hooks_read, hooks_written, reads_of, writes_mlp

MAX_BLOCKS = 4096  # a bound on the files a folder may name
_LAYOUTS = ("circuit-tracer's W_enc_{i}.safetensors + W_dec_{i}.safetensors (config.yaml optional) or Gemma "
            "Scope 2's params_layer_{i}.safetensors")


def read(path, dtype: torch.dtype | None = None, reads: str | None = None) -> dict:
    """The ``CrossLayerTranscoder(...)`` keyword arguments of the CLT in the folder ``path`` (a file of
    it stands for its folder)."""
    path = Path(path)
    if not path.exists():
        raise MissingFile(f"no cross-layer transcoder at {path}: the path does not exist (give a local folder: "
                          f"{_LAYOUTS})")
    if path.is_file():
        if path.suffix not in (".safetensors", ".yaml", ".json"):
            raise InvalidArgument(f"{path}: not a file of a cross-layer transcoder qgraph reads (safetensors only: "
                                  f"{_LAYOUTS})")
        path = path.parent
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgument(f"dtype={dtype!r}: give a floating-point torch.dtype, or None for the files' own")
    config = _config(path / "config.yaml") if (path / "config.yaml").is_file() else {}
    hook_in, hook_out = config.get("feature_input_hook"), config.get("feature_output_hook")
    said = reads_of(hook_in) if isinstance(hook_in, str) else None  # the value of each block it reads
    if hook_in is not None and said is None:
        raise NotSupported(f"{path / 'config.yaml'}: feature_input_hook {hook_in!r}: qgraph splices cross-layer "
                           f"transcoders that read one of {', '.join(hooks_read())}")
    if hook_out is not None and not (isinstance(hook_out, str) and writes_mlp(hook_out)):
        raise NotSupported(f"{path / 'config.yaml'}: feature_output_hook {hook_out!r}: qgraph splices cross-layer "
                           f"transcoders that write {' or '.join(hooks_written())} (each block's MLP output)")
    if said is not None and reads is not None and said != reads:
        raise InvalidArgument(f"reads={reads!r}, but {path / 'config.yaml'} says it reads {hook_in!r} ({said})")
    reads = said or reads or "mlp_input"
    files = {entry.name: entry for entry in path.iterdir()}
    others = sorted(name for name in files if re.fullmatch(r"(W_enc|W_dec|params_layer)_\d+\..+", name)
                    and not name.endswith(".safetensors"))
    if others:
        raise NotSupported(f"{path}: {', '.join(others[:3])}: qgraph reads cross-layer transcoders from safetensors "
                           f"files only ({_LAYOUTS})")
    encoders = numbered(path, files, r"W_enc_(\d+)\.safetensors")
    gemma = numbered(path, files, r"params_layer_(\d+)\.safetensors")
    if encoders and gemma:
        raise InvalidArgument(f"{path} holds both circuit-tracer's W_enc_{{i}} files and Gemma Scope 2's "
                              f"params_layer_{{i}} files: keep one cross-layer transcoder per folder")
    if encoders:
        record = _circuit_tracer(path, encoders, numbered(path, files, r"W_dec_(\d+)\.safetensors",
                                                                  complete=False))
    elif gemma:
        record = _gemma_scope_2(path, gemma)
    else:
        raise MissingFile(f"no cross-layer transcoder in {path}: expected {_LAYOUTS}")
    return {**record, "reads": reads, "dtype": dtype}


def _circuit_tracer(folder: Path, encoders: dict, decoders: dict) -> dict:
    n = len(encoders)
    extra = sorted(set(decoders) - set(encoders))
    if extra:
        raise InvalidArgument(f"{folder}: W_dec_{extra[0]}.safetensors has no W_enc_{extra[0]}.safetensors: the "
                              f"encoders name {n} blocks (0 to {n - 1}), each with one decoder file")
    record: dict[str, list[torch.Tensor]] = {name: [] for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")}
    sizes: dict[str, int] = {}
    jumprelu = None
    for i in range(n):
        if i not in decoders:
            raise MissingFile(f"{folder}: no W_dec_{i}.safetensors beside W_enc_{i}.safetensors (circuit-tracer "
                              f"writes one decoder file per block)")
        with _open(encoders[i]) as file:
            has = f"threshold_{i}" in file.keys()
            if jumprelu is not None and has != jumprelu:
                raise InvalidArgument(f"{encoders[i]}: " + (f"threshold_{i}, but W_enc_0.safetensors has no threshold_0"
                                      if has else f"no threshold_{i}, but W_enc_0.safetensors has threshold_0") +
                                      ": every block of a JumpReLU CLT has a threshold, a ReLU CLT's none")
            jumprelu = has
            layout = {f"W_enc_{i}": "d_transcoder d_model", f"b_enc_{i}": "d_transcoder", f"b_dec_{i}": "d_model"}
            if has:
                layout[f"threshold_{i}"] = "d_transcoder"
            tensors = _tensors(encoders[i], file, layout, sizes)
        record["W_enc"].append(tensors[f"W_enc_{i}"].T.contiguous())
        record["b_enc"].append(tensors[f"b_enc_{i}"])
        record["b_dec"].append(tensors[f"b_dec_{i}"])
        if has:
            record["threshold"].append(tensors[f"threshold_{i}"])
        with _open(decoders[i]) as file:
            sizes["outputs"] = n - i
            decoder = _tensors(decoders[i], file, {f"W_dec_{i}": "d_transcoder outputs d_model"}, sizes)
        record["W_dec"].append(decoder[f"W_dec_{i}"])
    return {**record, "threshold": record["threshold"] or None, "source": f"circuit-tracer CLT {folder}"}


def _gemma_scope_2(folder: Path, files: dict) -> dict:
    n = len(files)
    record: dict[str, list[torch.Tensor]] = {
        name: [] for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")}
    sizes: dict[str, int] = {"blocks": n}
    skip = None
    for i in range(n):
        with _open(files[i]) as file:
            has = "affine_skip_connection" in file.keys()
            if skip is not None and has != skip:
                raise InvalidArgument(f"{files[i]}: " + ("an" if has else "no") + " affine_skip_connection, unlike "
                                      "params_layer_0.safetensors: every block has one or none does")
            skip = has
            layout = {"w_enc": "d_model d_transcoder", "b_enc": "d_transcoder", "b_dec": "d_model",
                      "threshold": "d_transcoder", "w_dec": "d_transcoder blocks d_model"}
            if has:
                layout["affine_skip_connection"] = "d_model d_model"
            tensors = _tensors(files[i], file, layout, sizes)
        record["W_enc"].append(tensors["w_enc"])
        record["W_dec"].append(tensors["w_dec"][:, i:].contiguous())
        for name in ("b_enc", "b_dec", "threshold"):
            record[name].append(tensors[name])
        if has:
            record["W_skip"].append(tensors["affine_skip_connection"])
    return {**record, "W_skip": record["W_skip"] or None, "source": f"Gemma Scope 2 CLT {folder}"}


def numbered(folder: Path, files: dict, pattern: str, complete: bool = True) -> dict[int, Path]:
    """``{i: file}`` of the folder's files named by ``pattern``, numbered 0 to n - 1 with none missing
    (where ``complete``); each a plain file of the folder itself (a link out of it is refused, but for a
    Hub cache's own links: ``own``)."""
    found = {}
    for name, entry in files.items():
        if match := re.fullmatch(pattern, name):
            if not entry.is_file() or not own(entry, folder):
                raise InvalidArgument(f"{entry}: not a file of {folder} (a link out of the folder, or a folder): "
                                      f"qgraph reads a cross-layer transcoder's own files only")
            found[int(match[1])] = entry
    if len(found) > MAX_BLOCKS:
        raise InvalidArgument(f"{folder}: {len(found)} block files; qgraph reads at most {MAX_BLOCKS} blocks")
    missing = sorted(set(range(len(found))) - set(found))
    if missing and complete:
        example = pattern.replace(r"(\d+)", str(missing[0])).replace("\\", "")
        raise MissingFile(f"{folder}: no {example}: the blocks are numbered from 0 with none missing (it holds "
                          f"{', '.join(map(str, sorted(found)))})")
    return found


def own(entry: Path, folder: Path) -> bool:
    """Whether ``entry`` (named in ``folder``) is a file of the folder itself: there, or, in a Hugging Face
    cache's snapshot (``<repo>/snapshots/<commit>/...``), a link to one of that repo's own blobs
    (``<repo>/blobs/``), as the cache keeps every file it fetched (``hub.py``)."""
    target = entry.resolve()
    if target.parent == folder.resolve():
        return True
    store = target.parent
    return store.name == "blobs" and any(above.name == "snapshots" and above.parent.resolve() == store.parent
                                         for above in entry.absolute().parents)


def _open(file: Path):
    from safetensors import safe_open
    bounds.check(file)
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as error:
        raise InvalidArgument(f"{file}: not a safetensors file that can be read ({error})") from error


def _tensors(file: Path, handle, layout: dict[str, str], sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """The tensors of ``layout`` (name -> its dims, e.g. ``"d_transcoder d_model"``) from the open file,
    each shape checked against the sizes known so far (``sizes``, updated) before it is read."""
    keys = set(handle.keys())
    tensors = {}
    for name, spec in layout.items():
        if name not in keys:
            raise InvalidArgument(f"{file}: no tensor '{name}' (it holds {', '.join(sorted(keys)) or 'none'}); "
                                  f"expected {', '.join(layout)}")
        piece = handle.get_slice(name)
        shape, dims, known = list(piece.get_shape()), spec.split(), dict(sizes)
        if not (len(shape) == len(dims) and all(sizes.setdefault(dim, size) == size for dim, size in zip(dims, shape))):
            expected = [known.get(dim, dim) for dim in dims]
            said = ", ".join(f"{dim}={size}" for dim, size in known.items() if dim in dims)
            raise InvalidArgument(f"{file}: '{name}' has shape {shape}, expected [{', '.join(map(str, expected))}] "
                                  f"([{', '.join(dims)}]" + (f"; {said} from the tensors before it)" if said else ")"))
        dtype = piece.get_dtype()
        if dtype not in ("F16", "BF16", "F32", "F64"):
            raise InvalidArgument(f"{file}: '{name}' is {dtype}, not a floating-point tensor")
        tensors[name] = handle.get_tensor(name)
    return tensors


def _config(file: Path) -> dict:
    config = read_yaml(file)
    kind = config.get("model_kind", "cross_layer_transcoder")
    if kind != "cross_layer_transcoder":
        hint = ": a per-layer set loads with qgraph.Transcoder.load(path, layer=i)" if kind == "transcoder_set" else ""
        raise NotSupported(f"{file}: model_kind {kind!r}, not a cross_layer_transcoder{hint}")
    return config

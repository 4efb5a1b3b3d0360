"""Reading per-layer transcoders from disk into the keyword arguments of ``Transcoder(...)`` (the
record's conventions are in ``transcoder.py``). ``read`` tells the formats apart:

* **circuit-tracer** (``circuit_tracer/transcoder/single_layer_transcoder.py``, ``utils/hf_utils.py``):
  a set's folder holds ``config.yaml`` (``model_kind: transcoder_set``, ``model_name``,
  ``feature_input_hook``, ``feature_output_hook``, optionally ``activation`` / ``k`` and a
  ``transcoders`` list of per-layer files, index = layer) and ``layer_{i}.safetensors`` files, each
  ``W_enc [d_transcoder, d_model]`` (encoded with ``F.linear``: ``x @ W_enc.T + b_enc``), ``W_dec
  [d_transcoder, d_model]``, ``b_enc [d_transcoder]``, ``b_dec [d_model]``, optionally
  ``activation_function.threshold [d_transcoder]`` (JumpReLU, ``pre * (pre > threshold)``), ``W_skip
  [d_model, d_model]`` (``x @ W_skip.T``) and ``k`` (TopK, raw top-k values: ``pre * gate``).
* **SAELens 6** (``sae_lens/saes/transcoder.py``): ``cfg.json`` (``architecture`` ``transcoder`` /
  ``skip_transcoder`` / ``jumprelu_transcoder`` / ``jumprelu_skip_transcoder``, ``d_in``, ``d_sae``,
  ``d_out``, ``apply_b_dec_to_input: false``, ``metadata.hook_name`` / ``hook_name_out``) +
  ``sae_weights.safetensors`` (``W_enc [d_in, d_sae]``, ``b_enc``, ``W_dec [d_sae, d_out]``, ``b_dec
  [d_out]``, ``threshold [d_sae]``, ``W_skip [d_out, d_in]``: ``x @ W_skip.T``); several layers as
  ``layer_{i}/`` folders of them.

Hook names (TransformerLens', with or without ``blocks.{i}.``) are read with the family's table
(``values.aliases``): those of ``mlp_input`` (``mlp.hook_in``, ``ln2.hook_normalized``) or ``layer_mid``
(``hook_resid_mid``, ``hook_mlp_in``: before the MLP's norm) in, those of the MLP's output out.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import torch

from ..errors import InvalidArgument, MissingFile, NotSupported
from ..values.aliases import tl_names, tl_split, tl_value
from .formats import read_json, numbered, read_safetensors, read_yaml

READS = ("mlp_input", "layer_mid")  # the values of a block a transcoder may read
WRITES = "mlp.mlp_output"  # the value of a block it writes

# SAELens architectures -> (activation, has W_skip)
SAELENS = {"transcoder": ("relu", False), "skip_transcoder": ("relu", True), "jumprelu_transcoder": ("jumprelu", False),
           "jumprelu_skip_transcoder": ("jumprelu", True)}
_LAYOUTS = ("a circuit-tracer transcoder set (config.yaml + layer_{i}.safetensors, or one layer_{i}.safetensors), "
            "a SAELens transcoder (cfg.json + sae_weights.safetensors) or a folder of layer_{i}/ folders of them")


def read(path, layer: int | None = None, k: int | None = None) -> dict:
    """The ``Transcoder(...)`` keyword arguments of the transcoder at ``path``: ``layer`` picks one of a
    set (and must agree with the transcoder's own where the format says it); ``k`` overrides a TopK
    transcoder's k."""
    path = Path(path)
    if not path.exists():
        raise MissingFile(f"no transcoder at {path}: the path does not exist (give a local file or folder: {_LAYOUTS})")
    if path.is_file():
        if path.name in ("cfg.json", "sae_weights.safetensors", "config.yaml"):
            return read(path.parent, layer, k)
        if path.suffix != ".safetensors":
            raise InvalidArgument(f"{path}: not a file of a transcoder format qgraph reads ({_LAYOUTS})")
        config = path.parent / "config.yaml"
        record = _circuit_tracer(path, _config(config) if config.is_file() else {}, k, _number(path.name))
    elif (path / "cfg.json").is_file() and (path / "sae_weights.safetensors").is_file():
        record = _saelens(path, k)
    elif (path / "cfg.json").is_file():
        raise MissingFile(f"{path}: cfg.json has no sae_weights.safetensors beside it")
    elif (path / "config.yaml").is_file():
        config = _config(path / "config.yaml")
        number, file = _pick(set_files(path, config), layer, path, "layer files (config.yaml)")
        record = _circuit_tracer(file, config, k, number)
    elif files := numbered(path, r"layer_(\d+)\.safetensors", want_dir=False):
        number, file = _pick(files, layer, path, "layer_{i}.safetensors files")
        record = _circuit_tracer(file, {}, k, number)
    elif folders := numbered(path, r"layer_(\d+)", want_dir=True):
        return read(_pick(folders, layer, path, "layer_{i} folders")[1], layer, k)
    else:
        raise MissingFile(f"no transcoder in {path}: expected {_LAYOUTS}")
    if layer is not None:
        if record["layer"] is not None and record["layer"] != layer:
            raise InvalidArgument(f"{record['source']} is the transcoder of layer {record['layer']}, not layer={layer}")
        record["layer"] = layer
    return record


def _circuit_tracer(file: Path, config: dict, k: int | None, layer: int | None) -> dict:
    tensors = read_safetensors(file)
    layout = {"b_enc": "d_transcoder", "b_dec": "d_model", "W_enc": "d_transcoder d_model",
              "W_dec": "d_transcoder d_model"}
    if "W_skip" in tensors:
        layout["W_skip"] = "d_model d_model"
    sizes = _check_layout(file, tensors, layout)
    activation = config.get("activation")
    threshold = tensors.get("activation_function.threshold", tensors.get("threshold"))
    if activation == "topk" or (activation is None and "k" in tensors):
        k = k if k is not None else config.get("k", tensors["k"].item() if "k" in tensors else None)
        if k is None:
            raise InvalidArgument(f"{file}: a TopK transcoder with no k (config.yaml's k, or a 'k' tensor): give k=")
        activation, threshold = "topk", None
    elif activation == "relu" or threshold is None:  # circuit-tracer: a threshold makes it JumpReLU, else relu
        activation, threshold = "relu", None
    else:
        activation = "jumprelu"
        if threshold.dim() == 0:  # one threshold for every feature
            threshold = threshold.expand(sizes["d_transcoder"])
        _check_layout(file, {"activation_function.threshold": threshold}, {"activation_function.threshold":
                                                                         "d_transcoder"}, sizes)
        if (threshold < 0).any():  # circuit-tracer's pre * (pre > t) is relu(pre) * (pre > t) only where t >= 0
            raise NotSupported(f"{file}: {int((threshold < 0).sum())} JumpReLU thresholds are negative; qgraph's "
                               f"JumpReLU is relu(pre) * (pre > threshold), circuit-tracer's pre * (pre > threshold)")
    if activation != "topk" and k is not None:
        raise InvalidArgument(f"{file}: k={k!r} is for TopK transcoders; this one is {activation}")
    reads, own = _hooks(file.parent / "config.yaml", config.get("feature_input_hook"),
                        config.get("feature_output_hook"))
    return dict(W_enc=tensors["W_enc"].T.contiguous(), b_enc=tensors["b_enc"], W_dec=tensors["W_dec"],
                b_dec=tensors["b_dec"], activation=activation, k=_int(k), threshold=threshold,
                W_skip=tensors["W_skip"].T.contiguous() if "W_skip" in tensors else None, topk_relu=False,
                layer=layer if layer is not None else own, reads=reads, source=f"circuit-tracer {file}")


def _saelens(folder: Path, k: int | None) -> dict:
    cfg, where = read_json(folder / "cfg.json"), folder / "cfg.json"
    architecture = cfg.get("architecture", "standard")
    if architecture not in SAELENS:
        raise InvalidArgument(f"{where}: architecture {architecture!r} is not a transcoder's ({', '.join(SAELENS)}): "
                              f"an SAE loads with qgraph.SAE.load")
    if k is not None:
        raise InvalidArgument(f"{where}: k={k!r} is for TopK transcoders; SAELens's {architecture} is not one")
    if cfg.get("apply_b_dec_to_input"):
        raise NotSupported(f"{where}: apply_b_dec_to_input=true: a transcoder's b_dec is its output's (SAELens "
                           f"refuses it too)")
    for key in ("normalize_activations", "reshape_activations"):
        if cfg.get(key) not in (None, "none"):
            raise NotSupported(f"{where}: {key}={cfg[key]!r} is not supported (only 'none')")
    activation, skip = SAELENS[architecture]
    weights = folder / "sae_weights.safetensors"
    tensors = read_safetensors(weights)
    layout = {"b_enc": "d_sae", "b_dec": "d_out", "W_enc": "d_in d_sae", "W_dec": "d_sae d_out"}
    if activation == "jumprelu":
        layout["threshold"] = "d_sae"
    if skip:
        layout["W_skip"] = "d_out d_in"
    sizes = _check_layout(weights, tensors, layout)
    for key in ("d_in", "d_sae", "d_out"):
        if cfg.get(key) is not None and cfg[key] != sizes[key]:
            raise InvalidArgument(f"{where}: says {key}={cfg[key]} but the weights have {sizes[key]}")
    metadata = cfg.get("metadata") or {}
    hook_in = cfg.get("hook_name", metadata.get("hook_name"))
    reads, layer = _hooks(where, hook_in, cfg.get("hook_name_out", metadata.get("hook_name_out")))
    return dict(W_enc=tensors["W_enc"], b_enc=tensors["b_enc"], W_dec=tensors["W_dec"], b_dec=tensors["b_dec"],
                activation=activation, threshold=tensors.get("threshold"),
                W_skip=tensors["W_skip"].T.contiguous() if skip else None, layer=layer, reads=reads,
                source=f"SAELens {folder}")


def _hooks(where: Path, hook_in: str | None, hook_out: str | None) -> tuple[str, int | None]:
    """``(the value of its block it reads, its block or None)`` from the hooks it reads and writes
    (TransformerLens names, ``blocks.{i}.`` optional)."""
    (layer_in, name_in), (layer_out, name_out) = _split(hook_in), _split(hook_out)
    reads = reads_of(name_in) if name_in is not None else "mlp_input"
    if reads is None:
        raise NotSupported(f"{where}: the transcoder reads '{hook_in}'; qgraph splices transcoders that read a block's "
                           f"MLP input ({', '.join(hooks_read())})")
    if name_out is not None and not writes_mlp(name_out):
        raise NotSupported(f"{where}: the transcoder writes '{hook_out}'; qgraph splices transcoders that write a "
                           f"block's MLP output ({', '.join(hooks_written())})")
    if None not in (layer_in, layer_out) and layer_in != layer_out:
        raise InvalidArgument(f"{where}: reads block {layer_in} ('{hook_in}') but writes block {layer_out} "
                              f"('{hook_out}'): a per-layer transcoder reads and writes one block")
    return reads, layer_in if layer_in is not None else layer_out


def reads_of(hook: str) -> str | None:
    """The value of a block (one of ``transcoder.READS``) that a transcoder reading the TransformerLens
    hook ``hook`` (named within a block: ``mlp.hook_in``) reads; None where qgraph splices none."""
    value = tl_value(hook)
    return value if value in READS else None


def writes_mlp(hook: str) -> bool:
    """Whether the TransformerLens hook ``hook`` (named within a block) is the MLP's output (``WRITES``)."""
    return tl_value(hook) == WRITES


def hooks_read() -> list[str]:
    """The hooks within a block that a transcoder qgraph splices may read, as the family's table names them."""
    return [hook for value in READS for hook in tl_names(value)]


def hooks_written() -> list[str]:
    """The hooks within a block that a transcoder qgraph splices may write: the MLP output's names."""
    return tl_names(WRITES)


def _split(hook: str | None) -> tuple[int | None, str | None]:
    return tl_split(hook) if isinstance(hook, str) else (None, None)


def set_files(folder: Path, config: dict) -> Mapping[int, Path | str]:
    """``{layer: file}`` of a circuit-tracer set: its ``transcoders`` list (index = layer; older sets list
    ``{layer, filepath}``), else the ``layer_{i}.safetensors`` in the folder. An ``hf://`` entry is read
    from the folder under its file name, and stays a string (to be named) where it is not there."""
    listed = config.get("transcoders")
    if listed is None:
        return numbered(folder, r"layer_(\d+)\.safetensors", want_dir=False)
    files: dict[int, Path | str] = {}
    for index, entry in enumerate(listed if isinstance(listed, list) else []):
        number, where = ((entry.get("layer", index), entry.get("filepath")) if isinstance(entry, dict)
                         else (index, entry))
        if not isinstance(where, str):
            raise InvalidArgument(f"{folder / 'config.yaml'}: transcoders[{index}] is {entry!r}, not a file path")
        if where.startswith("hf://"):  # hf://org/repo/path/in/repo?revision=...: that path, or its name, here
            inside = PurePosixPath(urlparse(where).path.lstrip("/")).parts[1:]
            local = next((candidate for candidate in (folder.joinpath(*inside), folder / inside[-1])
                          if candidate.is_file()), None) if inside else None
        else:
            local = folder / where
        files[int(number)] = local if local is not None and local.is_file() else where
    return files


def _pick(found: Mapping[int, Path | str], layer: int | None, folder: Path, what: str) -> tuple[int, Path]:
    if layer is None and len(found) == 1:
        layer = next(iter(found))
    if layer is None or layer not in found:
        have = ", ".join(map(str, sorted(found))) or "none"
        said = "no layer= was given" if layer is None else f"layer={layer} is not there"
        raise InvalidArgument(f"{folder} holds {what} for layers {have}; {said}: give layer= one of them")
    file = found[layer]
    if isinstance(file, str):
        raise MissingFile(f"{folder / 'config.yaml'} names {file} for layer {layer}, which is not in {folder}: qgraph "
                          f"reads local files (download it there first)")
    if file.is_file() and file.suffix != ".safetensors":
        raise NotSupported(f"{file}: qgraph reads circuit-tracer's safetensors transcoders, not {file.suffix} files "
                           f"(GemmaScope's params.npz): convert it with circuit-tracer's to_safetensors first")
    return layer, file


def _config(file: Path) -> dict:
    config = read_yaml(file)
    kind = config.get("model_kind", "transcoder_set")
    if kind != "transcoder_set":
        raise NotSupported(f"{file}: model_kind {kind!r}: qgraph reads per-layer transcoders (transcoder_set), "
                           f"each reading and writing one block")
    return config


def _check_layout(file: Path, tensors: dict, layout: dict[str, str], sizes: dict | None = None) -> dict[str, int]:
    """The sizes of the dims in ``layout`` (name -> its dims, e.g. ``"d_transcoder d_model"``), after
    checking that each tensor is there and that the sizes agree: a ValueError naming the file, the
    tensor, the shape found and the shape expected otherwise."""
    sizes = dict(sizes or {})
    for name, spec in layout.items():
        if not isinstance(tensors.get(name), torch.Tensor):
            raise InvalidArgument(f"{file}: no tensor '{name}' (it holds {', '.join(sorted(map(str, tensors)))}); "
                                  f"expected {', '.join(layout)}")
        shape, dims, known = list(tensors[name].shape), spec.split(), dict(sizes)
        if not (len(shape) == len(dims) and all(sizes.setdefault(dim, size) == size for dim, size in zip(dims, shape))):
            expected = [known.get(dim, dim) for dim in dims]
            said = ", ".join(f"{dim}={size}" for dim, size in known.items())
            raise InvalidArgument(f"{file}: '{name}' has shape {shape}, expected [{', '.join(map(str, expected))}] "
                                  f"([{', '.join(dims)}]" + (f"; {said} from the tensors before it)" if said else ")"))
    return sizes


def _number(name: str) -> int | None:
    match = re.fullmatch(r"layer_(\d+)\.safetensors", name)
    return int(match[1]) if match else None


def _int(k):
    return int(k) if isinstance(k, float) and k.is_integer() else k

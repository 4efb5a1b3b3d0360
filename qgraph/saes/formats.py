"""Reading SAEs from disk: Qwen-Scope, SAELens and sparsify, each into the keyword arguments of
``SAE(...)`` (the record's conventions are in ``sae.py``). ``read`` tells the formats apart:

* **Qwen-Scope** (``Qwen/SAE-Res-Qwen3.5-*``): a folder of ``layer{i}.sae.pt`` files (or one of them),
  each a dict of ``W_enc [d_sae, d_in]``, ``b_enc``, ``W_dec [d_in, d_sae]``, ``b_dec``: both matrices
  transposed against the record. TopK, k not stored: from ``k=`` or the ``L0_<k>`` of the repo name.
  The model card's encoder is ``topk(x @ W_enc.T + b_enc)``: b_dec is not subtracted and the kept
  values are not relu'd. It reads the residual stream after block i: ``layers.{i}.layer_output``.
* **SAELens**: ``cfg.json`` + ``sae_weights.safetensors`` (``W_enc [d_in, d_sae]``, as the record).
* **sparsify** (EleutherAI): ``cfg.json`` + ``sae.safetensors`` (``encoder.weight [d_sae, d_in]``),
  or a folder of ``layers.{i}/`` of them. TopK of ``relu(x - b_dec) ...``: b_dec is subtracted.

Every file's size is bounded before it is read (``bounds.py``); ``hub.py`` fetches a Hub repository's
files into its cache first, where the load is given a repo id.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..errors import InvalidArgument, MissingFile, NotSupported
from ..values.aliases import tl_split, tl_value
from . import bounds

# SAELens architectures -> the record's activation
_SAELENS_ARCHITECTURES = {"standard": "relu", "jumprelu": "jumprelu", "topk": "topk"}
_LAYOUTS = "a folder of layer{i}.sae.pt files (Qwen-Scope), cfg.json + sae_weights.safetensors (SAELens), " \
           "cfg.json + sae.safetensors (sparsify) or a folder of layers.{i}/ of them"


def read(path, layer: int | None = None, k: int | None = None) -> dict:
    """The ``SAE(...)`` keyword arguments of the SAE at ``path``: ``layer`` picks one of a folder of
    layers (and must agree with the SAE's own where that is known); ``k`` overrides a TopK SAE's k."""
    path = Path(path)
    if not path.exists():
        raise MissingFile(f"no SAE at {path}: the path does not exist (give a local file or folder: "
                          f"{_LAYOUTS})")
    if path.is_file():
        if path.suffix == ".pt":
            record = _qwen_scope(path, k)
        elif path.name in ("cfg.json", "sae_weights.safetensors", "sae.safetensors"):
            return read(path.parent, layer, k)
        else:
            raise InvalidArgument(f"{path}: not a file of a format qgraph reads ({_LAYOUTS})")
    elif (path / "cfg.json").is_file() and (path / "sae_weights.safetensors").is_file():
        record = _saelens(path, k)
    elif (path / "cfg.json").is_file() and (path / "sae.safetensors").is_file():
        record = _sparsify(path, k)
    elif (path / "cfg.json").is_file():
        raise MissingFile(f"{path}: cfg.json has no weights beside it (sae_weights.safetensors for SAELens, "
                          f"sae.safetensors for sparsify)")
    elif files := numbered(path, r"layer(\d+)\.sae\.pt", want_dir=False):
        record = _qwen_scope(_pick(files, layer, path, "layer{i}.sae.pt files"), k)
    elif folders := numbered(path, r"layers\.(\d+)", want_dir=True):
        return read(_pick(folders, layer, path, "layers.{i} folders"), layer, k)
    elif (path / "config.yaml").is_file():
        raise InvalidArgument(f"{path}: config.yaml, a circuit-tracer transcoder set: load it with "
                              f"qgraph.Transcoder.load(path, layer=...)")
    else:
        raise MissingFile(f"no SAE in {path}: expected {_LAYOUTS}")
    own = _layer_of(record["hook"])
    if layer is not None and own is not None and own != layer:
        raise InvalidArgument(f"{record['source']} is the SAE of layer {own} ({record['hook']}), not layer={layer}")
    return record


def _qwen_scope(file: Path, k: int | None) -> dict:
    bounds.check(file)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # a pickle weights_only refuses, or not a torch file at all
        raise InvalidArgument(f"{file}: not a Qwen-Scope checkpoint torch.load(weights_only=True) can read ({error})") \
            from error
    if not isinstance(state, dict):
        raise InvalidArgument(f"{file}: holds a {type(state).__name__}, not the dict of W_enc, b_enc, W_dec, b_dec "
                              f"Qwen-Scope files hold")
    _check_layout(file, state, {"W_enc": "d_sae d_in", "b_enc": "d_sae", "W_dec": "d_in d_sae", "b_dec": "d_in"})
    k = k if k is not None else k_from_name(file)
    if k is None:
        raise InvalidArgument(f"{file}: Qwen-Scope files do not store TopK's k and the path names none: give k= "
                              f"(the repo name says it: ...-L0_50 is k=50)")
    match = re.fullmatch(r"layer(\d+)\.sae\.pt", file.name)
    # Contiguous, as the other formats' records: a transposed view would take another GEMM kernel,
    # so the same SAE read from two formats would not give bit-identical features.
    return dict(W_enc=state["W_enc"].T.contiguous(), b_enc=state["b_enc"], W_dec=state["W_dec"].T.contiguous(),
                b_dec=state["b_dec"], activation="topk", k=k, subtract_b_dec=False, topk_relu=False,
                hook=f"layers.{match[1]}.layer_output" if match else None, source=f"Qwen-Scope {file}")


def _saelens(folder: Path, k: int | None) -> dict:
    cfg, where = read_json(folder / "cfg.json"), folder / "cfg.json"
    architecture = cfg.get("architecture", "standard")
    nested = architecture if isinstance(architecture, dict) else {}
    if nested:
        architecture = nested.get("name", nested.get("type"))
    kwargs = {**(cfg.get("activation_fn_kwargs") or {}), **(nested.get("activation_fn_kwargs") or {})}
    function = cfg.get("activation_fn", cfg.get("activation_fn_str", nested.get("activation_fn")))
    if architecture == "standard" and function == "topk":  # SAELens < 6 wrote TopK SAEs this way
        architecture = "topk"
    if architecture not in _SAELENS_ARCHITECTURES:
        hint = "; a transcoder loads with qgraph.Transcoder.load" if "transcoder" in str(architecture) else ""
        raise InvalidArgument(f"{where}: unknown SAE architecture {architecture!r} (qgraph reads "
                              f"{', '.join(_SAELENS_ARCHITECTURES)}){hint}")
    if architecture == "standard" and function not in (None, "relu"):
        raise NotSupported(f"{where}: activation_fn {function!r}: qgraph reads standard SAEs with relu")
    for key, plain in (("normalize_activations", "none"), ("reshape_activations", "none")):
        if cfg.get(key) not in (None, plain):
            raise NotSupported(f"{where}: {key}={cfg[key]!r} is not supported (only 'none'): fold the "
                               f"normalization into the weights first")
    if cfg.get("finetuning_scaling_factor"):
        raise NotSupported(f"{where}: finetuning_scaling_factor is not supported: fold it into W_dec first")
    weights = folder / "sae_weights.safetensors"
    tensors = read_safetensors(weights)
    if architecture == "jumprelu" and "threshold" not in tensors and "log_threshold" in tensors:
        tensors["threshold"] = tensors["log_threshold"].exp()  # as SAELens's training SAEs keep it
    layout = {"W_enc": "d_in d_sae", "b_enc": "d_sae", "W_dec": "d_sae d_in", "b_dec": "d_in"}
    if architecture == "jumprelu":
        layout["threshold"] = "d_sae"
    d_in, d_sae = _check_layout(weights, tensors, layout)
    _check_sizes(where, cfg, {"d_in": d_in, "d_sae": d_sae})
    if architecture == "topk":
        k = k if k is not None else cfg.get("k", kwargs.get("k", nested.get("k")))
        if k is None:
            raise InvalidArgument(f"{where}: a TopK SAE with no k (at the top, in activation_fn_kwargs): give k=")
        k = int(k) if isinstance(k, float) and k.is_integer() else k
    metadata = cfg.get("metadata") or cfg.get("meta") or {}
    hook_name = cfg.get("hook_name", cfg.get("hook_point", metadata.get("hook_name")))
    return dict(W_enc=tensors["W_enc"], b_enc=tensors["b_enc"], W_dec=tensors["W_dec"], b_dec=tensors["b_dec"],
                activation=_SAELENS_ARCHITECTURES[architecture], k=k, threshold=tensors.get("threshold"),
                subtract_b_dec=bool(cfg.get("apply_b_dec_to_input", True)), topk_relu=True,
                hook=saelens_hook(hook_name), source=f"SAELens {folder}")


def _sparsify(folder: Path, k: int | None) -> dict:
    cfg, where = read_json(folder / "cfg.json"), folder / "cfg.json"
    if cfg.get("transcode"):
        raise NotSupported(f"{where}: a transcoder (transcode=true), not an SAE: qgraph reads SAEs")
    if cfg.get("skip_connection"):
        raise NotSupported(f"{where}: skip_connection=true (a W_skip term) is not supported")
    if cfg.get("activation", "topk") != "topk":
        raise NotSupported(f"{where}: activation {cfg['activation']!r} is not supported (only 'topk')")
    weights = folder / "sae.safetensors"
    tensors = read_safetensors(weights)
    d_in, d_sae = _check_layout(weights, tensors, {"encoder.weight": "d_sae d_in", "encoder.bias": "d_sae",
                                                   "W_dec": "d_sae d_in", "b_dec": "d_in"})
    latents = cfg.get("num_latents") or (cfg["expansion_factor"] * d_in if cfg.get("expansion_factor") else None)
    _check_sizes(where, {"d_in": cfg.get("d_in"), "num_latents": latents}, {"d_in": d_in, "num_latents": d_sae})
    k = k if k is not None else cfg.get("k")
    if k is None:
        raise InvalidArgument(f"{where}: no k: give k=")
    return dict(W_enc=tensors["encoder.weight"].T.contiguous(), b_enc=tensors["encoder.bias"], W_dec=tensors["W_dec"],
                b_dec=tensors["b_dec"], activation="topk", k=k, subtract_b_dec=True, topk_relu=True,
                hook=sparsify_hook(folder.name), source=f"sparsify {folder}")


def saelens_hook(name: str | None) -> str | None:
    """The qgraph value of a SAELens hook name of a block (``blocks.5.hook_resid_post`` ->
    ``layers.5.layer_output``: ``values.aliases``), or None for one qgraph has no name for without the
    model, or that names no block (give ``hook=`` when loading)."""
    if not isinstance(name, str) or tl_split(name)[0] is None:
        return None
    return tl_value(name)


def sparsify_hook(name: str) -> str | None:
    """The qgraph value of a sparsify hookpoint (its folder's name): ``layers.5`` (the block's output)
    -> ``layers.5.layer_output``, ``layers.5.mlp`` -> ``layers.5.mlp.mlp_output``; else None."""
    match = re.fullmatch(r"(?:model\.)?layers\.(\d+)(\.mlp)?", name)
    if match is None:
        return None
    return f"layers.{match[1]}.mlp.mlp_output" if match[2] else f"layers.{match[1]}.layer_output"


def k_from_name(path: Path) -> int | None:
    """TopK's k from an ``L0_<k>`` in the path (``SAE-Res-Qwen3.5-2B-Base-W32K-L0_50`` -> 50), the part
    nearest the file first; None where no part names one."""
    for part in reversed(Path(path).absolute().parts):
        if match := re.search(r"(?<![A-Za-z0-9])L0_(\d+)(?![0-9])", part):
            return int(match[1])
    return None


def numbered(folder: Path, pattern: str, want_dir: bool) -> dict[int, Path]:
    """The entries of ``folder`` whose names match ``pattern`` (one group: the number), by number."""
    found = {}
    for entry in folder.iterdir():
        if entry.is_dir() == want_dir and (match := re.fullmatch(pattern, entry.name)):
            found[int(match[1])] = entry
    return found


def _pick(found: dict[int, Path], layer: int | None, folder: Path, what: str) -> Path:
    if layer not in found:
        have = ", ".join(map(str, sorted(found)))
        said = "no layer= was given" if layer is None else f"layer={layer} is not there"
        raise InvalidArgument(f"{folder} holds {what} for layers {have}; {said}: give layer= one of them")
    return found[layer]


def _layer_of(hook: str | None) -> int | None:
    match = re.match(r"layers\.(\d+)\.", hook or "")
    return int(match[1]) if match else None


def read_json(file: Path) -> dict:
    """The settings of a JSON file, its size bounded first (``bounds``), or an InvalidArgument naming it."""
    bounds.check(file)
    try:
        cfg = json.loads(file.read_text())
    except ValueError as error:
        raise InvalidArgument(f"{file}: not valid JSON ({error})") from error
    if not isinstance(cfg, dict):
        raise InvalidArgument(f"{file}: holds a JSON {type(cfg).__name__}, not an object of settings")
    return cfg


def read_yaml(file: Path) -> dict:
    """The settings of a YAML file (safe_load: data only), its size bounded first (``bounds``), or an
    InvalidArgument naming the file."""
    import yaml
    bounds.check(file)
    try:
        config = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise InvalidArgument(f"{file}: not valid YAML ({error})") from error
    if not isinstance(config, dict):
        raise InvalidArgument(f"{file}: holds a YAML {type(config).__name__}, not a mapping of settings")
    return config


def read_safetensors(file: Path) -> dict:
    """Every tensor of a safetensors file, its size bounded first (``bounds``), or an InvalidArgument naming it."""
    from safetensors.torch import load_file
    bounds.check(file)
    try:
        return load_file(str(file))
    except Exception as error:
        raise InvalidArgument(f"{file}: not a safetensors file that can be read ({error})") from error


def _check_layout(file: Path, tensors: dict, layout: dict[str, str]) -> tuple[int, int]:
    """``(d_in, d_sae)`` from the tensors named in ``layout`` (name -> its dims, e.g. ``"d_sae d_in"``),
    after checking each is there and that their sizes agree: a ValueError naming the file otherwise."""
    sizes: dict[str, int] = {}
    for name, spec in layout.items():
        if not isinstance(tensors.get(name), torch.Tensor):
            raise InvalidArgument(f"{file}: no tensor '{name}' (it holds {', '.join(sorted(map(str, tensors)))}); "
                                  f"expected {', '.join(layout)}")
        shape, dims = list(tensors[name].shape), spec.split()
        known = ", ".join(f"{dim}={size}" for dim, size in sizes.items())
        fits = len(shape) == len(dims) and all(sizes.setdefault(dim, size) == size for dim, size in zip(dims, shape))
        if not fits:
            raise InvalidArgument(f"{file}: '{name}' has shape {shape}, expected [{' '.join(dims)}]"
                                  + (f" ({known} from the tensors before it)" if known else ""))
    return sizes["d_in"], sizes["d_sae"]


def _check_sizes(where: Path, cfg: dict, sizes: dict[str, int]) -> None:
    for key, size in sizes.items():
        if cfg.get(key) is not None and cfg[key] != size:
            raise InvalidArgument(f"{where}: says {key}={cfg[key]} but the weights have {size}")

"""The weights a loaded program reads (``qgraph.load(path, weights=...)``): from the file beside it, a
safetensors file or index, a checkpoint folder (``qgraph.weights`` opens only the shards holding a tensor it
reads), or a model it follows; each checked against what the program's ``qgraph.json`` says it reads."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import InvalidType, SavedProgramError
from ..weights import WeightsMismatch, check_fit, names, read, tensor_names, unexpected


def weights_of(path: Path, meta: dict, weights) -> dict[str, Callable[[], torch.Tensor]]:
    """``{parameter name: function giving its tensor}`` for the parameters the program reads, checked."""
    if weights is None:
        if meta["weights"] is None:
            raise SavedProgramError(f"{path} was saved without weights: load it with weights=model (the model it was "
                                    f"saved from), a safetensors file or a checkpoint folder, or save it with "
                                    f"ig.save(path, weights=True)")
        weights = path.with_name(meta["weights"])
    try:
        if isinstance(weights, torch.nn.Module):
            return _from_model(path, meta, weights)
        if not isinstance(weights, (str, Path)):
            raise InvalidType(f"weights= takes a model, a safetensors file or index, or a checkpoint folder, not "
                              f"{type(weights).__name__}")
        tensors = read(weights, meta["parameters"], meta["tied"])
        _fit(path, meta, tensors, names(weights), str(weights))
    except WeightsMismatch as error:
        raise SavedProgramError(str(error)) from None
    return {target: _giving(tensor) for target, tensor in tensors.items()}


def _giving(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function giving ``tensor`` (a weight read from a file: fixed once read)."""
    return lambda: tensor


def _from_model(path: Path, meta: dict, model: torch.nn.Module) -> dict[str, Callable[[], torch.Tensor]]:
    """Functions reading each parameter the program reads from its module of ``model``, at call time."""
    getters: dict[str, Callable[[], torch.Tensor]] = {}
    for target in meta["parameters"]:
        try:
            model.get_parameter(target)
        except AttributeError:
            continue  # missing: named by _fit with the others
        module_path, _, attribute = target.rpartition(".")
        getters[target] = _reading(model.get_submodule(module_path), attribute)
    _fit(path, meta, {target: get() for target, get in getters.items()}, tensor_names(model), "the model")
    if not hasattr(model, "config"):
        raise SavedProgramError(f"weights= takes the model {path.name} was saved from (a transformers model, with a "
                                f"config), not a bare {type(model).__name__}: give its weights as a safetensors file")
    return getters


def _reading(module: torch.nn.Module, attribute: str) -> Callable[[], torch.Tensor]:
    """A function reading ``module``'s ``attribute`` at each call (a parameter replaced since is read)."""
    return lambda: getattr(module, attribute)


def _fit(path: Path, meta: dict, tensors: dict, given: list[str], source: str) -> None:
    """``check_fit`` of ``tensors`` (and the names of every tensor ``given``) against the program."""
    check_fit(path.name, meta["parameters"], tensors, source, unexpected(given, meta["tensors"], meta["ignored"]),
              owner=f"the {meta['model_class']} it was saved from",
              hint=f": give the weights of the model {path.name} was saved from (a {meta['model_class']} of "
                   f"{meta['blocks']} blocks), or save a program from the model these weights are for")

"""What a model is, as hashes: its class, name, config and every weight (``model_identity``), and the SAEs
spliced into it. A capture records it (``capture.manifest``) to refuse mixing shards of other weights; an
instrument gives its own (``Instrument.identity``: a local one its model's, a remote one the server's, a
loaded one its file's config and the weights it reads)."""
from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # a type only: transformers is imported with the model
    from transformers import PreTrainedModel

CHUNK = 1 << 24  # elements hashed per step (a GPU tensor is copied to the CPU a chunk at a time)
UNNAMED = ("_name_or_path", "transformers_version", "_attn_implementation_autoset")  # not what the model is


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def model_identity(model: PreTrainedModel) -> dict:
    """The model's class, name, a hash of its config and ``weights_sha256``: any change to any
    weight (one neuron's column), a reload of other weights or a dtype change gives another hash."""
    return {"class": type(model).__name__, "name": str(getattr(model.config, "_name_or_path", "") or ""),
            "config_sha256": config_sha256(model.config.to_dict()), "weights_sha256": weights_sha256(model)}


def config_sha256(config: dict) -> str:
    """sha256 of a config's fields (``config.to_dict()``), but those that name where it was read from."""
    return sha(json.dumps({k: v for k, v in config.items() if k not in UNNAMED}, sort_keys=True, default=str))


def saes_identity(saes: dict) -> dict:
    """For each spliced SAE (``{hook: (sae, splice)}``): where it came from, its form and a hash of its weights."""
    return {hook: {"source": sae.source, "splice": splice, "form": sae.extra_repr(),
                   "weights_sha256": weights_sha256(sae)}
            for hook, (sae, splice) in sorted(saes.items())}


def weights_sha256(module: torch.nn.Module) -> str:
    """sha256 over the bytes of every element of every parameter and buffer (non-persistent ones,
    such as rotary frequencies, too; a tied parameter once), each after its name, shape and dtype."""
    return tensors_sha256(itertools.chain(module.named_parameters(), module.named_buffers()))


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over ``(name, tensor)`` pairs, each tensor's bytes after its name, shape and dtype. A CPU
    tensor is hashed in place (through a uint8 view, so bfloat16 too), a GPU one is copied to the CPU a
    chunk at a time."""
    weights = hashlib.sha256()
    for name, tensor in named:
        weights.update(f"{name}\0{tuple(tensor.shape)}\0{tensor.dtype}\0".encode())
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK):
            chunk = flat[start:start + CHUNK].contiguous().cpu().view(torch.uint8).numpy()
            weights.update(chunk)  # type: ignore[arg-type]  # an ndarray is a buffer: numpy's stubs say so from 3.12
    return weights.hexdigest()

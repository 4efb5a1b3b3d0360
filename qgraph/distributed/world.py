"""Ranks under torchrun: this process's rank, the world's size, and waiting for the others.

When ``torch.distributed`` is initialised, qgraph uses it as it is. Otherwise, under torchrun
(``WORLD_SIZE`` > 1 in the environment) it initialises the default group itself, ``nccl`` when the
model is on a GPU and ``gloo`` on CPU (and capture destroys it at the end). Capture splits rows by
rank (rank ``r`` of ``w`` takes rows ``r, r + w, ...``); stages run one per rank (``pipeline``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import InvalidState


@dataclass
class World:
    rank: int = 0
    size: int = 1
    owned: bool = False  # whether capture initialised the group (and so destroys it)

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        if self.owned and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def join(device: torch.device) -> World:
    """This process's rank and the world size, initialising the group under torchrun if needed."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_available():
        raise InvalidState("WORLD_SIZE > 1 but this torch has no torch.distributed")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    return World(dist.get_rank(), dist.get_world_size(), owned=True)

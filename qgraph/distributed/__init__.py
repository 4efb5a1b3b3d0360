"""Programs past one process: cut at block boundaries into stages (``split``) and run as a pipeline,
one stage per torchrun rank or all in one process (``pipeline``); ranks and the group (``world``)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import InvalidArgument
from .pipeline import Pipeline
from .split import cuts_for, split
from .world import World, join

__all__ = ["Pipeline", "Stages", "World", "blocks_of", "join", "stage_program"]


@dataclass(frozen=True)
class Stages:
    """How ``instrument(..., stages=...)`` splits and runs a program: ``split`` is the number of
    stages (blocks spread evenly) or the first block of each stage after the first; the batch is cut
    into ``microbatches`` that flow through the stages in turn; ``gather`` sends every value to rank 0
    (otherwise each rank returns the values its stage computed)."""

    split: int | tuple = 2
    microbatches: int = 1
    gather: bool = False

    def __post_init__(self):
        if isinstance(self.split, list):
            object.__setattr__(self, "split", tuple(self.split))
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise InvalidArgument(f"microbatches takes a positive int, not {self.microbatches!r}")

    @classmethod
    def of(cls, stages) -> "Stages | None":
        """``stages=`` as given to ``instrument``: None, a number, a list of first blocks, or a ``Stages``."""
        if stages is None or isinstance(stages, Stages):
            return stages
        return cls(split=stages)


def blocks_of(family):
    """``block_of(node)``: the block a node's module scope names (None outside the blocks)."""
    def block_of(node):
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            match = re.match(r"layers\.(\d+)(?:\.|$)", family.module_name(path))
            if match:
                return int(match.group(1))
        return None
    return block_of


def stage_program(program, stages: Stages) -> Pipeline:
    """Cut a built ``Program`` into ``stages`` and return the pipeline that runs it here: this
    process's stage under torchrun, every stage otherwise."""
    family = program.family
    blocks = len(family.block_mixers(program.model.config))
    cuts = cuts_for(list(stages.split) if isinstance(stages.split, tuple) else stages.split, blocks)
    if stages.microbatches > 1 and program.exported.images:
        raise InvalidArgument("micro-batches cut input_ids and attention_mask, not the images: call the image-text model "
                              "with microbatches=1 (or without images)")
    plan = split(program.module, blocks_of(family), cuts)
    device = next(iter(program.model.parameters()), torch.empty(0)).device
    world = join(device if device.type != "meta" else torch.device("cpu"))
    user = [i for i, name in enumerate(program.input_names) if name in ("input_ids", "attention_mask")]
    return Pipeline(plan, world if world.size > 1 else None, set(user), stages.microbatches, stages.gather)

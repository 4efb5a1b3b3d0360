"""Programs past one process: cut at block boundaries into stages (``split``) and run as a pipeline
(``pipeline``): all in this process, each stage on its device (``place``), or one stage per torchrun
rank on torch's own engine (``engine``, ``torch.distributed.pipelining``); ranks and the group (``world``)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.export.graph_signature import InputKind

from ..errors import InvalidArgument
from .engine import SCHEDULES
from .pipeline import Pipeline
from .place import check_devices
from .split import cuts_for, split
from .world import World, join

__all__ = ["Pipeline", "Stages", "World", "blocks_of", "join", "stage_program"]


@dataclass(frozen=True)
class Stages:
    """How ``instrument(..., stages=...)`` splits and runs a program: ``split`` is the number of
    stages (blocks spread evenly) or the first block of each stage after the first; the batch is cut
    into ``microbatches`` that flow through the stages in turn (a call with ``loss=`` sums the loss of
    each micro-batch's logits); ``gather`` sends every value to rank 0 (otherwise each rank returns the
    values its stage computed). ``schedule`` is torch's schedule under torchrun: "gpipe" (every
    micro-batch forward, then every backward), "1f1b" (one forward, one backward, once the pipeline is
    full: less memory; needs ``microbatches`` >= stages) or "interleaved-1f1b" (several stages per
    process, ``stages`` a multiple of the processes). ``devices`` (one per stage, in one process) runs
    each stage on its device. ``timeout`` (seconds, under torchrun) bounds a rank's wait on another's
    message: a failure on one rank ends every rank with its error, at once where qgraph catches it (the
    loss, a stage's forward), else within ``timeout`` (``world.vote``)."""

    split: int | tuple = 2
    microbatches: int = 1
    gather: bool = False
    schedule: str = "gpipe"
    devices: tuple | None = None
    timeout: float = 60.0

    def __post_init__(self):
        if isinstance(self.split, list):
            object.__setattr__(self, "split", tuple(self.split))
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise InvalidArgument(f"microbatches takes a positive int, not {self.microbatches!r}")
        if self.schedule not in SCHEDULES:
            raise InvalidArgument(f"schedule={self.schedule!r}: qgraph runs torch's {', '.join(map(repr, SCHEDULES))}")
        count = self.split if isinstance(self.split, int) else len(self.split) + 1
        if self.schedule == "1f1b" and self.microbatches < count:
            raise InvalidArgument(f"schedule='1f1b' runs at least as many micro-batches as stages: microbatches="
                                  f"{self.microbatches} < {count} stages (use schedule='gpipe', or more micro-batches)")
        if self.devices is not None:
            object.__setattr__(self, "devices", check_devices(self.devices, count))
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise InvalidArgument(f"timeout= takes the seconds a rank waits on another's message (e.g. 60), not "
                                  f"{self.timeout!r}")

    @classmethod
    def of(cls, stages) -> Stages | None:
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
        raise InvalidArgument("micro-batches cut input_ids and attention_mask, not the images: call the image-text "
                              "model with microbatches=1 (or without images)")
    plan = split(program.module, blocks_of(family), cuts)
    device = next(iter(program.model.parameters()), torch.empty(0)).device
    joined = join(device if device.type != "meta" else torch.device("cpu"))
    world = joined if joined.size > 1 else None
    if stages.devices is not None and world is not None:
        raise InvalidArgument("devices= places the stages in one process; under torchrun each rank's stage runs where "
                              "its weights are (load_weights(checkpoint, device=f'cuda:{rank}'))")
    user = [i for i, name in enumerate(program.input_names) if name in ("input_ids", "attention_mask")]
    values = [node.meta.get("val") for node in program.graph.find_nodes(op="placeholder")]
    return Pipeline(plan, world, set(user), stages.microbatches, stages.gather, stages.schedule,
                    kinds=input_kinds(program), values=values, logits=0 if program.returns_logits else None,
                    devices=stages.devices, recorded=program.device or device, timeout=float(stages.timeout))


def input_kinds(program) -> list[tuple[str, str]]:
    """``(kind, name)`` of each program input: "parameter", "buffer" (the model's, by their names),
    "constant" (the export's own) or "input" (a call's tensor)."""
    kinds = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant",
             InputKind.CUSTOM_OBJ: "constant"}
    specs = program.exported.program.graph_signature.input_specs
    named = [(kinds.get(spec.kind, "input"), spec.target or spec.arg.name) for spec in specs]
    return named + [("input", name) for name in program.input_names[len(specs):]]

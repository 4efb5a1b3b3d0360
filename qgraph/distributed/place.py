"""Several devices in one process: ``qgraph.Stages(..., devices=["cuda:0", "cuda:1"])`` runs stage s on
``devices[s]`` (what a notebook with two GPUs wants).

Each stage's graph is a copy (``split``), so the devices its code named (``arange(..., device=...)``,
recorded at export as the model's device) become its own device there. Each stage reads the model's
parameters and buffers where they are: the model may have been loaded with a ``device_map`` that puts
each stage's weights on its device, or built on ``meta`` and given its weights by
``ig.load_weights(checkpoint)``, which reads each stage's onto its device. A weight on another device
than the one stage that reads it is refused by name, with the way out: qgraph neither moves the
model's weights (the model stays as it is) nor keeps a copy (twice the memory, blind to weights
changed in place, and ``.grad`` would land on the copy). A weight read by stages on several devices
(a tied ``lm_head`` and ``embed_tokens``) cannot be in both places: the stages away from it read it
through ``.to(device)`` at each call, which autograd follows back to the model's parameter. The
export's own constants are copied once per device. Call inputs and what crosses from one stage to
the next move to the next stage's device; each value comes back on the device of the stage that
computed it (the logits on the last stage's).
"""
from __future__ import annotations

import torch
from torch.fx.node import map_aggregate

from ..errors import InvalidArgument, InvalidState, InvalidType


def check_devices(devices, count: int) -> tuple[torch.device, ...]:
    """``devices=`` checked: one usable device per stage; a named error otherwise."""
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, (list, tuple)):
        raise InvalidType(f"devices= takes one device per stage (e.g. ['cuda:0', 'cuda:1']), not {devices!r}")
    if len(devices) != count:
        raise InvalidArgument(f"devices= names {len(devices)} device{'s' if len(devices) != 1 else ''} for {count} "
                              f"stages: give one per stage")
    checked = []
    for device in devices:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise InvalidArgument(f"devices=: {device!r} is not a device ({error})") from None
        if device.type == "meta":
            raise InvalidArgument("devices=: a stage cannot compute on 'meta'; build the model on meta and call "
                                  "ig.load_weights(checkpoint) to give each stage its weights on its device")
        try:
            device = torch.empty(0, device=device).device  # "cuda" is the current GPU's index
        except (RuntimeError, AssertionError, AttributeError) as error:
            raise InvalidArgument(f"devices=: {device} is not usable here ({str(error).splitlines()[0]})") from None
        checked.append(device)
    return tuple(checked)


class Placement:
    """Where each stage of a plan runs in this process, and the arguments each stage reads there.
    ``kinds[i]`` is ``(kind, name)`` of program input i: "parameter", "buffer", "constant" or "input"."""

    def __init__(self, plan, devices: tuple[torch.device, ...], kinds: list[tuple[str, str]], recorded: torch.device):
        self.plan, self.devices, self.kinds = plan, devices, kinds
        self.readers: dict[int, set[torch.device]] = {}
        for stage, inputs in enumerate(plan.inputs):
            for kind, *where in inputs:
                if kind == "input":
                    self.readers.setdefault(where[0], set()).add(devices[stage])
        for module, device in zip(plan.modules, devices):
            _on_device(module, recorded, device)
        self.copies: dict[tuple[int, torch.device], tuple[object, torch.Tensor]] = {}  # constants, once per device

    def device_of(self, index: int) -> torch.device:
        """The device of the first stage that reads program input ``index`` (the first stage's when none does)."""
        return next((self.devices[s] for s, inputs in enumerate(self.plan.inputs)
                     if any(kind == "input" and where[0] == index for kind, *where in inputs)), self.devices[0])

    def check(self, args: list) -> None:
        """Refuse by name the weights that sit on another device than the one stage that reads them."""
        wrong = []
        for stage, inputs in enumerate(self.plan.inputs):
            for kind, *where in inputs:
                if kind != "input":
                    continue
                value, (what, name) = args[where[0]], self.kinds[where[0]]
                if what in ("parameter", "buffer") and isinstance(value, torch.Tensor) and \
                        value.device != self.devices[stage] and len(self.readers[where[0]]) == 1:
                    wrong.append((name, value.device, stage))
        if wrong:
            name, device, stage = wrong[0]
            module = name.rpartition(".")[0]
            raise InvalidState(
                f"{name} is on {device}, but stage {stage} reads it on {self.devices[stage]} ({len(wrong)} weight"
                f"{'s' if len(wrong) > 1 else ''} on another device than their stage: "
                f"{', '.join(n for n, _, _ in wrong[:3])}{', ...' if len(wrong) > 3 else ''}). qgraph does not move "
                f"or copy the model's weights: put each stage's weights on its device (model.get_submodule('{module}')"
                f".to('{self.devices[stage]}'), or load with a device_map that does), or build the model on meta and "
                f"call ig.load_weights(checkpoint), which reads each stage's weights onto its device")

    def argument(self, stage: int, index: int, value):
        """Program input ``index`` as stage ``stage`` reads it, on its device."""
        device = self.devices[stage]
        if not isinstance(value, torch.Tensor) or value.device == device:
            return value
        if self.kinds[index][0] == "constant":
            source, copy = self.copies.get((index, device), (None, None))
            if source is not value:
                copy = value.to(device)
                self.copies[(index, device)] = (value, copy)
            return copy
        return value.to(device)  # a call input, or a weight read on several devices (autograd follows it back)

    def crossing(self, stage: int, value):
        """A tensor an earlier stage computed, on this stage's device."""
        return value.to(self.devices[stage]) if isinstance(value, torch.Tensor) else value


def _on_device(module, recorded: torch.device, device: torch.device) -> None:
    """Every device argument in ``module``'s graph naming ``recorded`` becomes ``device``; tensors it holds
    as attributes move there (they are the program's own)."""
    if device == recorded:
        return

    def swap(value):
        return device if isinstance(value, torch.device) and value == recorded else value

    for node in module.graph.nodes:
        node.args = map_aggregate(node.args, swap)
        node.kwargs = map_aggregate(node.kwargs, swap)
        if node.op == "get_attr" and "." not in node.target:
            held = getattr(module, node.target, None)
            if isinstance(held, torch.Tensor) and held.device != device:
                setattr(module, node.target, held.to(device))
    module.recompile()

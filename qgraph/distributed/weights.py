"""``ig.load_weights(checkpoint)``: the weights of a model built on ``meta``, for this process's stage only.

A model too big for one machine is built on the ``meta`` device (no memory for weights), exported
and cut into stages there; each rank then reads from the checkpoint only the parameters and
buffers its own stage reads (``qgraph.weights.read``), checked against the model's shapes and
dtypes. From a sharded checkpoint (an index and its shards, as Hugging Face writes them) it opens
only the shards that hold those tensors: the others need not be on its machine. Buffers a
checkpoint does not hold (the rotary frequencies, computed from the config) are computed
(``compat.computed_buffers``). The model itself is never changed: the programs read the
loaded tensors instead of its meta ones, and their recorded ``meta`` devices become ``device``.
With ``Stages(devices=...)`` in one process, each tensor goes to the device of the first stage that
reads it (``place.Placement``).
"""
from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind

from ..compat import computed_buffers
from ..errors import InvalidArgument
from ..weights import check_fit, read, tied_groups


def load_weights(ig, checkpoint, device=None) -> list[str]:
    """Load what this process's stage of ``ig``'s program reads onto ``device`` (the CPU by default;
    with ``Stages(devices=...)`` each stage's onto its device); rebuild the programs to read it."""
    program = ig.program_for(ig.exported.images)
    placement = program.runner.placement
    if placement is not None and device is not None:
        raise InvalidArgument("devices= places each stage's weights on its device: call load_weights(checkpoint) "
                              "without device=")
    device = torch.device(device if device is not None else placement.devices[0] if placement is not None else "cpu")
    specs = program.exported.program.graph_signature.input_specs
    local = program.runner.local_inputs(len(specs))
    wanted = [specs[i] for i in local if i < len(specs) and specs[i].kind in (InputKind.PARAMETER, InputKind.BUFFER)]
    expected = {spec.target: _meta_tensor(ig.model, spec.target) for spec in wanted}
    tensors = read(checkpoint, expected, tied_groups(ig.model), device)
    for spec in wanted:
        if spec.target not in tensors and spec.kind == InputKind.BUFFER:
            module_path, _, attribute = spec.target.rpartition(".")
            computed = computed_buffers(ig.model.get_submodule(module_path), device)
            if attribute in computed:
                tensors[spec.target] = computed[attribute]
    check_fit("the model", {name: (t.shape, t.dtype) for name, t in expected.items()}, tensors, str(checkpoint))
    where = {specs[i].target: placement.device_of(i) for i in local if i < len(specs)} if placement is not None else {}
    ig.use_weights({name: tensor.to(where.get(name, device)) for name, tensor in tensors.items()}, device)
    return sorted(tensors)


def _meta_tensor(model, target: str) -> torch.Tensor:
    module_path, _, attribute = target.rpartition(".")
    return getattr(model.get_submodule(module_path), attribute)

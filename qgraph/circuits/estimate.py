"""``qgraph.circuits.estimate``: what an attribution graph will hold and how many backward passes it
takes, before it runs.

It runs the replacement model's forward as ``attribute.replacement_run`` does (at batch 1; for a prompt run
in segments, the one-pass forward of the values then the segments', ``circuits.segments``) with a
``saved_tensors_hooks`` that counts what autograd would keep for the backwards and keeps none of it,
so it costs the call's forward time and no more than one forward's live activations. The one-pass forward also
gives the exact counts the rest follows from: the active features (the columns of every row), the
logit targets, the kept features. ``bytes`` is what the estimate and the call add together to the
process as it was before the estimate: the peak RSS the call reaches over that. Its parts:

    program   the export (once a process: the estimate's is kept for the call) and the program's build,
              as the estimate's own run raised the resident memory (``memory.resident``)
    forward   what autograd keeps (counted) + the outputs the call holds (logits, features, errors)
    transient what the forward holds beyond its tensors, as the estimate's forward showed it: the larger
              of how far it raised the resident memory over the build (read as each tensor is saved) and
              what it left resident beyond the forward's tensors once they were freed (memory the
              allocator keeps, which the call's forward takes again)
    rows      (logits + kept features) x (active features + error nodes + embeddings + 2) x 4
              (the feature part in a file with offload="disk": not counted)
    reads     the rows read from the store at once (the influence's ``|rows|``, the kept columns):
              ``rows.READ`` floats at most, a whole row at least
    batch     the targets in flight at once (``batch_size``, or fewer: the call runs a batch a part at a
              time so that this stays within ``attribute.IN_FLIGHT`` of what the forward keeps):
              directions and gradients at every block's MLP output and the embeddings, ``2 x (blocks +
              1) x seq x width`` floats a target, and the backward's own working memory, about
              ``memory.TRANSIENT`` times what one block keeps, a target; and their rows as they are made
              (``3 x active features`` floats a target)
    graph     the kept nodes' adjacency and the rows it is read from, ``2 x nodes^2 x 4``

and the peak is program + forward + transient + rows + reads + the larger of batch and graph (they do
not overlap). A call made with no estimate before it adds about as much (its export and its forward's
leftovers are its own); one made after another call or estimate on the same model adds less (the
export is held, and the allocator's memory is taken again): ``parts`` says by how much.
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field

from ..inputs import input_embedding
from ..errors import InvalidArgument


@dataclass(frozen=True)
class Estimate:
    """``bytes``: the memory the estimate and the call add (the call's peak RSS over what the process held
    before the estimate); ``backward_passes``: the backwards the call runs, ``targets_per_pass`` targets
    each at most (``batch_size``, or fewer where the in-flight bound says so); ``parts``: bytes by what
    holds them; the counts they follow from."""

    bytes: int
    backward_passes: int
    parts: dict = field(default_factory=dict)
    active_features: int = 0
    feature_nodes: int = 0
    logit_nodes: int = 0
    targets_per_pass: int = 0

    def __repr__(self) -> str:
        parts = ", ".join(f"{name} {_size(size)}" for name, size in self.parts.items())
        return (f"Estimate({_size(self.bytes)}, {self.backward_passes} backward passes; {parts}; "
                f"{self.feature_nodes} of {self.active_features} active features, {self.logit_nodes} logits)")


def estimate(model_or_ig, input_ids, transcoders, *, max_n_logits: int = 10, desired_logit_prob: float = 0.95,
             max_feature_nodes: int | None = None, batch_size: int = 32, update_interval: int = 4,
             offload: str | None = None) -> Estimate:
    """The memory ``attribution_graph`` with these arguments will add and the backward passes it will
    take (see the module's docstring for how), from the forward it runs, which keeps nothing."""
    from ..instrument import InstrumentedModel  # lazy: keeps safetensors, sympy, transformers out until this is used
    # lazy: qgraph.circuits.attribute imports this module's package at import time (a cycle)
    from .attribute import check_attribution_options, checked_prompt, salient_logits, replacement_run
    # lazy: qgraph.circuits.memory imports this module's package at import time (a cycle)
    from .memory import SavedBytes, in_flight, resident, storage_bytes
    # lazy: qgraph.circuits.rows imports this module's package at import time (a cycle)
    from .rows import OFFLOADS, working_rows

    model = model_or_ig.model if isinstance(model_or_ig, InstrumentedModel) else model_or_ig
    ids = checked_prompt(input_ids, model)
    check_attribution_options(max_n_logits, desired_logit_prob, max_feature_nodes, batch_size, update_interval)
    if offload not in OFFLOADS:
        raise InvalidArgument(f"offload={offload!r}: None (the rows in memory) or 'disk' (in a temporary file)")
    gc.collect()
    start = resident()
    counter = SavedBytes()  # keeps nothing: this forward is never run backward
    run = replacement_run(model, ids, transcoders, batch_size, counter)
    logit_ids, _ = salient_logits(run.logits[0, -1].float(), max_n_logits, desired_logit_prob)
    active = len(run.active())
    kept = active if max_feature_nodes is None else min(max_feature_nodes, active)
    seq, blocks = ids.shape[0], run.blocks
    width = input_embedding(model).embedding_dim
    outputs = storage_bytes([run.logits, *run.features, *run.errors, run.embeddings,
                             *(part for block in run.inputs for part in block)], counter.seen)
    forward = counter.bytes + outputs
    chunk = run.chunk
    del run
    gc.collect()
    program, left, rose = counter.built - start, resident() - counter.built, counter.high - counter.built
    transient = max(0, rose, left - forward)
    targets = len(logit_ids) + kept
    columns = (0 if offload == "disk" else active) + blocks * seq + seq + 2
    rows = targets * columns * 4
    reads = min(targets, working_rows(active)) * active * 4
    batch = min(chunk, targets)  # the targets in flight at once (attribute.IN_FLIGHT)
    flight = in_flight(batch, blocks, seq, width, counter.bytes) + 3 * batch * active * 4
    nodes = kept + blocks * seq + seq + len(logit_ids)
    graph = 2 * nodes * nodes * 4
    parts = {"program": max(0, program), "forward": forward, "transient": transient, "rows": rows, "reads": reads,
             "batch": flight, "graph": graph}
    parts = {name: int(size) for name, size in parts.items()}
    # the feature targets go in one call with every feature kept, else in batches of batch_size (update_interval
    # of them between rankings: the batches are the same whatever it is), each a pass per chunk of them
    batches = [kept] if kept == active else [min(batch_size, kept - start) for start in range(0, kept, batch_size)]
    passes = math.ceil(len(logit_ids) / chunk) + sum(math.ceil(size / chunk) for size in batches)
    total = sum(parts.values()) - min(parts["batch"], parts["graph"])
    return Estimate(total, passes, parts, active, kept, len(logit_ids), chunk)


def _size(size: float) -> str:
    return f"{size / 2 ** 30:.2f} GiB" if size >= 2 ** 30 else f"{size / 2 ** 20:.1f} MiB"

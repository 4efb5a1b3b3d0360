"""``qgraph.attribution_graph``: the direct effects between features, errors, embeddings and logits,
through the replacement model (``passes.replacement``), by batched backward passes.

One frozen program runs the prompt once (batch 1), and every backward shares what it saved. Each
target (an active feature's pre-activation, a salient logit minus the mean logit) is one direction:
a feature's encoder column at its block's MLP input, a logit's de-meaned one-hot at the last
position. ``batch_size`` targets go through one batched vector-Jacobian product (``torch.autograd.grad``
under ``torch.func.vmap``, over the graph the one forward recorded), which gives,
for each target, the gradient at every embedding and every MLP output; so the memory a graph takes
does not grow with ``batch_size`` beyond the gradients themselves. The delta-rule kernels keep one
recomputation under autograd for every backward (``kernels.grad.keep_recomputation``) instead of
recomputing the kernel in each. A source's
direct effect on the target is that gradient dotted with what the source adds there: a feature's
``activation * W_dec[feature]``, an error node's error vector, a token's embedding. Because the
frozen model is linear in what the sources add, a target's input is exactly the sum of its row plus
``constants``: the encoder's bias (its pre-activation at 0) and every block's decoder bias ``b_dec``
carried to it. A prompt longer than ``segments.SEGMENT`` tokens runs in segments (``circuits.segments``),
and the targets by position, so that each backward runs through the positions up to its targets' only.
"""
from __future__ import annotations

import bisect
import warnings

import torch
from torch.nn.functional import pad

from ..errors import InvalidArgument, InvalidType
from ..inputs import check_text, input_embedding
from ..progress import progress
from .graph import AttributionGraph, Node
from .rows import OFFLOADS, Rows, feature_influence
from .segments import forward, programs
from .transcoders import transcoder_set

IN_FLIGHT = 0.25  # a batch's gradients and working memory, at most this part of what the forward keeps
GATHERED = 1 << 22  # elements of gradients gathered at once (16 MiB of float32) to dot with decoder rows


def attribution_graph(model_or_ig, input_ids, transcoders, *, max_n_logits: int = 10,
                      desired_logit_prob: float = 0.95, max_feature_nodes: int | None = None,
                      batch_size: int = 32, update_interval: int = 4, offload: str | None = None,
                      tokenizer=None) -> AttributionGraph:
    """The attribution graph of ``input_ids`` (one prompt, ``[seq]`` or ``[1, seq]``, used as given)
    through the replacement model with ``transcoders`` (``{block: qgraph.Transcoder}`` for every block,
    or a folder of a transcoder set that ``Transcoder.load(path, layer=i)`` reads). Logit nodes: the
    most likely next tokens until their probabilities reach ``desired_logit_prob``, at most
    ``max_n_logits``. Features: every active one (activation not 0), or the ``max_feature_nodes`` most
    influential on the logits, chosen as circuit-tracer chooses them (ranked by their influence through
    the rows so far, ``update_interval`` batches attributed between rankings, circuit-tracer's default 4):
    the others are not nodes, and the adjacency holds the kept nodes only. ``batch_size`` targets share
    each backward pass (memory does not grow with it: the forward runs once). ``offload="disk"``: the rows
    computed (one per target over every active feature, the largest thing held for a long prompt) live in
    a temporary file.
    ``qgraph.circuits.estimate`` says beforehand what a call will hold and how many backwards it takes.
    ``tokenizer`` decodes the tokens for the views."""
    from ..instrument import InstrumentedModel  # lazy: keeps safetensors, sympy, transformers out until this is used

    model = model_or_ig.model if isinstance(model_or_ig, InstrumentedModel) else model_or_ig
    ids = checked_prompt(input_ids, model)
    check_attribution_options(max_n_logits, desired_logit_prob, max_feature_nodes, batch_size, update_interval)
    if offload not in OFFLOADS:
        raise InvalidArgument(f"offload={offload!r}: None (the rows in memory) or 'disk' (in a temporary file)")
    run = replacement_run(model, ids, transcoders, batch_size)
    logit_ids, probabilities = salient_logits(run.logits[0, -1].detach(), max_n_logits, desired_logit_prob)
    active = run.active()
    limit = len(active) if max_feature_nodes is None else min(max_feature_nodes, len(active))
    rows = Rows(len(logit_ids) + limit, len(active), run.blocks * len(ids), len(ids), offload)
    try:
        run.rows([("logit", int(token)) for token in logit_ids], into=rows)
        if limit == len(active):
            done = list(range(len(active)))
            run.rows([("feature", tuple(f)) for f in active.tolist()], into=rows)
        else:
            done = _most_influential(run, active, rows, probabilities, limit, update_interval)
        return _assemble(run, ids, active, done, logit_ids, probabilities, rows, tokenizer)
    finally:
        rows.close()


def replacement_run(model, ids: torch.Tensor, transcoders, batch_size: int, counter=None) -> _Run:
    """The prompt ``ids`` ``[seq]`` run once through the replacement model: what its sources add, and
    ``rows(targets)``, their direct effects by backward passes of ``batch_size`` targets. ``counter``
    (``estimate.SavedBytes``) counts what autograd saves (and, for ``estimate``, keeps none of it)."""
    from ..families import family_for  # lazy: keeps transformers out until this is used
    from ..passes.replacement import EMBEDDINGS, inject_name  # lazy: keeps transformers out until this is used

    blocks = len(family_for(model).block_mixers(model.config))
    transcoders = transcoder_set(transcoders, blocks, model)
    seq, width = ids.shape[0], input_embedding(model).embedding_dim
    reads = [f"layers.{i}.{transcoders.reads[i]}" for i in range(blocks)]
    plain, stepped = programs(model, ["layers.0.layer_input", "final_norm_output", *reads], transcoders, seq)
    names = [EMBEDDINGS, *(inject_name(i) for i in range(blocks))]
    # lazy: qgraph.circuits.memory imports this module's package at import time (a cycle)
    from .memory import SavedBytes, in_flight, resident
    counter = counter or SavedBytes(keep=True)
    counter.built = resident()  # the export (if this process had none) and the builds are held from here
    counter.hold(model, transcoders)  # the weights autograd saves are held already
    # a long prompt's graph runs in segments (circuits.segments): a target's backward ends at its own
    logits, captured, segments = forward(model, ids, plain, stepped, names, width, counter)
    run = _Run(transcoders, captured, segments, names, logits, blocks, batch_size, model.get_output_embeddings().weight)
    # the targets of a batch go through the vmapped backward a part at a time (directions, backward,
    # effects), so that what they hold in flight stays within IN_FLIGHT of what the forward keeps: memory
    # does not grow with batch_size
    per_target = in_flight(1, blocks, seq, width, counter.bytes)
    run.chunk = max(1, min(batch_size, int(IN_FLIGHT * counter.bytes / per_target)))
    return run


def _most_influential(run, active, rows: Rows, probabilities, limit: int, update_interval: int) -> list[int]:
    """The ``limit`` features most influential on the logits (active indices, in the order attributed),
    their rows added to ``rows``, found as circuit-tracer's ``attribute`` finds them: the features not yet
    attributed are ranked by their influence through the rows computed so far, and the next
    ``update_interval`` batches of ``batch_size`` of them are attributed before the next ranking."""
    done: list[int] = []
    layers = active[:, 0]
    with progress("attribution: the most influential features", total=limit, unit="feature") as bar:
        while len(done) < limit:
            score = feature_influence(rows, len(probabilities), probabilities, done, layers)
            score[done] = -1.0
            queue = score.topk(min(update_interval * run.batch, limit - len(done))).indices.tolist()
            # the round's batches by position (each backward ends at its last target's segment), their rows
            # written in the queue's order: the rankings read the same rows in the same order
            order = sorted(range(len(queue)), key=lambda j: int(active[queue[j], 1]))
            base = rows.count
            for start in range(0, len(queue), run.batch):
                batch = order[start:start + run.batch]
                run.rows([("feature", tuple(active[queue[j]].tolist())) for j in batch], into=rows,
                         at=[base + j for j in batch])
                bar.update(len(batch))
            done += queue
    return done


def checked_prompt(input_ids, model) -> torch.Tensor:
    """The prompt's ids ``[seq]``, checked as an instrumented call checks them (every id a row of the
    model's embedding: ``inputs.check_text``), before any work."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.long, torch.int):
        raise InvalidType(f"input_ids takes a LongTensor of token ids, not {type(input_ids).__name__}")
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1 or input_ids.shape[0] == 0:
        raise InvalidArgument(f"an attribution graph is of one prompt: input_ids [seq] or [1, seq], not "
                              f"{list(input_ids.shape)}")
    # the ids' own device: the run moves them to the model's
    check_text(input_ids[None], None, input_embedding(model).num_embeddings, input_ids.device)
    return input_ids.long()


def check_attribution_options(max_n_logits, desired_logit_prob, max_feature_nodes, batch_size, update_interval) -> None:
    for name, value in (("max_n_logits", max_n_logits), ("batch_size", batch_size),
                        ("update_interval", update_interval)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgument(f"{name} takes a positive int, not {value!r}")
    if not isinstance(desired_logit_prob, (int, float)) or not 0 < desired_logit_prob <= 1:
        raise InvalidArgument(f"desired_logit_prob takes a probability in (0, 1], not {desired_logit_prob!r}")
    if max_feature_nodes is not None and (not isinstance(max_feature_nodes, int) or max_feature_nodes < 0):
        raise InvalidArgument(f"max_feature_nodes takes None (every active feature) or an int >= 0, not "
                              f"{max_feature_nodes!r}")


def salient_logits(last: torch.Tensor, max_n_logits: int, desired_logit_prob: float):
    """The most likely tokens until their probabilities reach ``desired_logit_prob``, at most ``max_n_logits``."""
    probabilities = torch.softmax(last.float(), dim=-1)
    top, ids = torch.topk(probabilities, min(max_n_logits, probabilities.shape[0]))
    cutoff = int(torch.searchsorted(torch.cumsum(top, 0), torch.tensor(desired_logit_prob))) + 1
    return ids[:cutoff], top[:cutoff]


class _Run:
    """One run of the frozen program, in segments (``circuits.segments``): what the sources add, and the
    rows of targets by backward passes, each through the segments up to its targets' last."""

    def __init__(self, transcoders, captured, segments, names, logits, blocks, batch_size, unembedding):
        # the last position's logits [1, 1, vocab] (the whole prompt's are not kept)
        self.transcoders, self.logits, self.blocks, self.batch = transcoders, logits, blocks, batch_size
        self.starts, self.seq = [segment.start for segment in segments], segments[-1].end
        # a logit target's direction lies on the unembedding's input, the final norm's output (frozen: the
        # logits are linear in it), at the last position: W_U[token] - mean(W_U), never vocabulary-wide
        self.final, self.unembedding = segments[-1].captured["final_norm_output"], unembedding.detach()
        self._mean_unembedding = None
        self.chunk = batch_size  # targets at once under the vmapped backward (replacement_run sets it)
        self._active = self._by_block = None  # active(), and its rows block by block
        # what each block's features read: one tensor (with its graph) per segment, and its values
        self.inputs = [[segment.captured[f"layers.{i}.{transcoders.reads[i]}"] for segment in segments]
                       for i in range(blocks)]
        self.reads = [captured[f"layers.{i}.{transcoders.reads[i]}"][0].detach() for i in range(blocks)]
        self.features = [captured.pop(f"replacement.{i}.features")[0].detach() for i in range(blocks)]
        self.errors = [captured.pop(f"replacement.{i}.error")[0].detach().float() for i in range(blocks)]
        self.embeddings = captured["layers.0.layer_input"][0].detach().float()
        self.leaves = [[segment.leaves[name] for name in names] for segment in segments]  # per segment, as names

    def active(self) -> torch.Tensor:
        """``[n, 3]`` (block, position, feature) of every active feature, in that order (found once: the
        features of the one forward do not change)."""
        if self._active is None:
            found = [torch.cat([torch.full((len(nz), 1), i), nz], dim=1)
                     for i, nz in enumerate(f.nonzero().cpu() for f in self.features)]
            self._active = torch.cat(found) if found else torch.zeros(0, 3, dtype=torch.long)
            self._by_block = [self._active[self._active[:, 0] == block] for block in range(self.blocks)]
        return self._active

    def rows(self, targets, into: Rows | None = None, at: list[int] | None = None) -> dict[str, torch.Tensor] | None:
        """For each target, its direct effects: from the active features ``[targets, features]``, the error
        nodes ``[targets, blocks * seq]`` and the embeddings ``[targets, seq]``, and its constant; written
        to ``into`` (a ``rows.Rows``) pass by pass, at its rows ``at`` (one per target; by default those
        after its last), or returned in the order of ``targets``. The targets run by position, so that
        each pass runs through the segments up to its last target's, no further."""
        active, seq, n = self.active(), self.seq, len(targets)
        where = at if at is not None else [] if into is None else list(range(into.count, into.count + n))
        order = sorted(range(n), key=lambda i: self.position(*targets[i]))
        parts = {} if into is not None else {"features": torch.zeros(n, len(active)), "constants": torch.zeros(n),
                                             "errors": torch.zeros(n, self.blocks * seq),
                                             "embeddings": torch.zeros(n, seq)}
        for start in range(0, n, self.chunk):
            picked = order[start:start + self.chunk]
            chunk = [targets[i] for i in picked]
            effects = {name: part.cpu() for name, part in self._effects(self._backward(chunk), chunk).items()}
            if into is not None:
                into.put(effects, [where[i] for i in picked])
            else:
                for name, part in effects.items():
                    parts[name][picked] = part
        return parts or None

    def position(self, kind, what) -> int:
        """Where a target reads: a feature's position, a logit's the last."""
        return self.seq - 1 if kind == "logit" else what[1]

    def _segment(self, position: int) -> int:
        return bisect.bisect_right(self.starts, position) - 1

    def _backward(self, chunk) -> list[torch.Tensor]:
        """The gradients at the embeddings and at every MLP output ``[targets, end, width]``: one batched
        vector-Jacobian product, a direction per target, through the segments up to the last one a target
        reads in, which ends at ``end`` (the gradients after it are zeros, never computed)."""
        cotangents: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (block or "final", segment) -> pair

        def direction(key, output) -> torch.Tensor:
            if key not in cotangents:
                cotangents[key] = (output, output.new_zeros(len(chunk), *output.shape))
            return cotangents[key][1]

        last = len(self.starts) - 1
        for row, (kind, what) in enumerate(chunk):
            if kind == "logit":
                if self._mean_unembedding is None:
                    self._mean_unembedding = self.unembedding.float().mean(0)
                at = direction(("final", last), self.final)
                at[row, 0, -1] = (self.unembedding[what].float() - self._mean_unembedding).to(at.dtype)
            else:
                block, position, feature = what
                segment = self._segment(position)
                at = direction((block, segment), self.inputs[block][segment])
                at[row, 0, position - self.starts[segment]] = self.transcoders.encoder(block)[:, feature].to(at.dtype)
        reach = 1 + max(segment for _, segment in cotangents)
        leaves = [leaf for segment in self.leaves[:reach] for leaf in segment]
        outputs = [output for output, _ in cotangents.values()]

        def backward(*directions):
            gradients = torch.autograd.grad(outputs, leaves, directions, retain_graph=True, allow_unused=True)
            return tuple(torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, gradients))

        with warnings.catch_warnings():  # an aten backward without a batching rule (sdpa's) loops: say nothing
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
            gradients = torch.func.vmap(backward)(*(at for _, at in cotangents.values()))
        sources = len(self.leaves[0])
        return [(torch.cat([gradients[k * sources + source][:, 0] for k in range(reach)], dim=1) if reach > 1
                 else gradients[source][:, 0]).float() for source in range(sources)]

    def _effects(self, gradients, chunk) -> dict[str, torch.Tensor]:
        """The rows of ``chunk`` from its gradients (``_backward``'s, over positions 0..end: nothing after
        reaches its targets, so a source there has no effect and none is computed)."""
        at_embeddings, at_outputs = gradients[0], gradients[1:]
        rows, end, width = at_embeddings.shape
        after = (0, self.seq - end)  # the zeros of the positions after end
        features = []
        step = max(1, GATHERED // (rows * width))  # the gradients at the features' positions, a part at a time
        for block in range(self.blocks):
            mine = self._by_block[block]  # by position
            reached = mine[:int(torch.searchsorted(mine[:, 1].contiguous(), end))]
            effect = torch.zeros(rows, len(mine))
            for written, decoder in self.transcoders.decoders(block, reached[:, 2]):  # [n, width] into `written`
                for start in range(0, len(reached), step):
                    part = slice(start, min(start + step, len(reached)))
                    gathered = at_outputs[written][:, reached[part, 1]]
                    effect[:, part] += torch.einsum("rnd,nd->rn", gathered, decoder[part])
            effect[:, :len(reached)] *= self.features[block][reached[:, 1], reached[:, 2]].float()
            features.append(effect)
        errors = torch.cat([pad((at_outputs[block] * self.errors[block][:end]).sum(-1), after)
                            for block in range(self.blocks)], dim=1)
        embeddings = pad((at_embeddings * self.embeddings[:end]).sum(-1), after)
        carried = sum((at_outputs[block].sum(1) @ self.transcoders.output_bias(block)) for block in range(self.blocks))
        encoder = torch.tensor([float(self.transcoders.encoder_constants(what[0])[what[2]]) if kind == "feature"
                                else 0.0 for kind, what in chunk])
        return {"features": torch.cat(features, dim=1), "errors": errors, "embeddings": embeddings,
                "constants": carried + encoder}

    def node_input(self, kind, what) -> float:
        """A feature's pre-activation, or a logit minus the mean logit."""
        if kind == "logit":
            last = self.logits[0, -1].detach().float()
            return float(last[what] - last.mean())
        block, position, feature = what
        x = self.reads[block][position]
        encoder = self.transcoders.encoder(block)
        constant = self.transcoders.encoder_constants(block)[feature]
        return float(x.float() @ encoder[:, feature].float()) + float(constant)


def _assemble(run, ids, active, done, logit_ids, probabilities, rows: Rows, tokenizer) -> AttributionGraph:
    """The graph in circuit-tracer's node order: the chosen features (``done``, active indices, their
    rows after the logits' in ``rows``), errors, embeddings, logits; the adjacency of those nodes only."""
    blocks, seq = run.blocks, ids.shape[0]
    order = sorted(range(len(done)), key=lambda j: done[j])  # (block, position, feature) order
    columns = torch.tensor([done[j] for j in order], dtype=torch.long)
    chosen = active[columns]
    n_features, n_logits = len(chosen), len(logit_ids)
    nodes = [Node("feature", b, p, f, float(run.features[b][p, f])) for b, p, f in chosen.tolist()]
    nodes += [Node("error", b, p, None) for b in range(blocks) for p in range(seq)]
    nodes += [Node("embedding", None, p, int(ids[p])) for p in range(seq)]
    nodes += [Node("logit", blocks, seq - 1, t, probability=q)
              for t, q in zip(logit_ids.tolist(), probabilities.tolist())]
    stored = list(range(n_logits)) + [n_logits + j for j in order]  # the store's row of each target, as below
    picked = torch.tensor(stored, dtype=torch.long)
    sources = torch.cat([rows.columns(stored, columns), rows.errors[picked], rows.embeddings[picked]], dim=1)
    n = len(nodes)
    targets = [n - n_logits + i for i in range(n_logits)] + list(range(n_features))
    adjacency, constants, node_inputs = torch.zeros(n, n), torch.zeros(n), torch.zeros(n)
    adjacency[targets, :sources.shape[1]] = sources
    constants[targets] = rows.constants[picked]
    asked = [("logit", int(t)) for t in logit_ids] + [("feature", tuple(f)) for f in chosen.tolist()]
    node_inputs[targets] = torch.tensor([run.node_input(kind, what) for kind, what in asked])
    tokens = logit_tokens = None
    if tokenizer is not None:
        tokens = [tokenizer.decode([int(t)]) for t in ids]
        logit_tokens = [tokenizer.decode([int(t)]) for t in logit_ids]
    return AttributionGraph(nodes, adjacency, node_inputs, constants, ids.cpu(), probabilities.cpu(), tokens,
                            logit_tokens, n_layers=blocks)

"""What the server runs: the hosted model's instruments (one per program, a bounded few kept), and one
forward for several requests, each with its own edits on its own rows.

Requests of one program (the same values and edit names) are left-padded to the longest and stacked
along the batch. Positions follow the attention mask, so each row computes what it would alone. An
edit applies to its request's rows, cropped to that request's own positions (``positions=[0]`` is its
first token, not a pad), and each reply takes its rows back, cropped the same way. A batch that fails
runs again one request at a time, so one request's bad edit fails that request alone.

Padding changes nothing a request reads or edits along its tokens: the pads are masked out of attention,
the DeltaNet's input is zero there, and a zero state stays zero through them. It does change what enters
a row before its first token: a state given at a DeltaNet's ``state_input`` decays through the pads (its
``g`` and ``beta`` are not masked) and a conv context given at ``conv_state_input`` is pushed out by
them. So a program that edits a value with no token axis (``Runner._row_wide``: those two, and any other
value of a row as a whole, such as ``state_output``, whatever the edit) shares a forward only with
requests of its own length, which need no padding; every other program's requests are padded to the
longest. (Values read are safe: a row's ``state_output`` and ``conv_state_output`` after zero-state pads
are its own; generate, a backward and the lens never share a forward.)
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ..edits import Forward, Region, apply_edit, needs
from ..families.configs import config_data
from ..identity import model_identity
from ..values.catalogue import entry_data
from .limits import Limits
from .request import Request, TooLarge, Unprocessable
from .work import check_edit_work
import qgraph
from ..generate import check_settings

if TYPE_CHECKING:  # transformers loads with the model, not with qgraph.serve
    from transformers import PreTrainedModel

SEQUENCE_DIMS = ("seq", "query", "key")  # the axes of a value that run along the tokens
PROGRAMS = 16  # instruments kept (one per program asked), least recently used dropped


def public_name(path: str) -> str:
    """What ``/v1/info`` calls the model: a hub id as given, a folder of the server's disk by its last part
    alone (no path of the server's disk leaves it)."""
    local = Path(path)
    return local.name if local.is_absolute() or local.exists() or str(path).startswith(".") else str(path)


class Runner:
    """Runs requests on ``model`` (in the batcher's one thread)."""

    def __init__(self, model: PreTrainedModel, name: str = "", stages=None, limits: Limits = Limits()):
        self.model, self.name, self.stages = model, public_name(name), stages  # stages: a Stages under torchrun
        self.limits = limits
        self.parameters = sum(p.numel() for p in model.parameters())  # a forward: about 2 operations each a token
        self.base = qgraph.instrument(model, stages=stages)
        # what it serves, as hashes (a capture through qgraph.remote records it), its name without a path
        self.identity = {**model_identity(model), "name": self.name}
        self._instruments: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()
        self.forwards = 0  # forwards run (a batch of several requests counts once): /v1/health

    def info(self) -> dict:
        """What ``GET /v1/info`` answers: the model (its config, without any path of this disk) and every
        value of its catalogue, as data (``values.catalogue.entry_data``): what ``qgraph.remote`` resolves
        names and draws pictures from, as a local instrument does."""
        config, ig = self.model.config, self.base
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return {"model": {"name": self.name, "model_type": config.model_type, "class": type(self.model).__name__,
                          "family": ig.family.name, "blocks": ig.blocks, "dtype": dtype,
                          "vocab_size": self._embeddings().num_embeddings,
                          "config": config_data(config, paths=False), "identity": self.identity},
                "values": {name: {**entry_data(entry), "dtype": dtype} for name, entry in ig.catalogue.items()}}

    def instrument(self, request: Request):
        """The instrument of the request's program (made once, kept among the last ``PROGRAMS``)."""
        key = request.key
        with self._lock:
            if key in self._instruments:
                self._instruments.move_to_end(key)
                return self._instruments[key]
        names = [name for pattern in request.edits for name in self.base.resolve(pattern)]
        ig = qgraph.instrument(self.model, request.values, edits=list(dict.fromkeys(names)), logits=request.logits,
                               stages=self.stages)
        with self._lock:
            self._instruments[key] = ig
            while len(self._instruments) > PROGRAMS:
                self._instruments.popitem(last=False)
        return ig

    def check(self, request: Request) -> None:
        """What the server checks against the model before it queues ``request`` (its fields are checked as
        it is read): a generate's settings, by the check ``generate`` itself runs before anything
        (``qgraph.generate.check_settings``): a value transformers refuses is a 422 naming it; and the work
        of its function edits, against its forward's (``serve.work``: 413 past ``--max-edit-work``)."""
        if request.edits:
            check_edit_work(request, self.base.resolve, self.parameters, self.limits)
        if request.generate is not None:
            settings = {key: value for key, value in request.generate.items() if key != "steps"}
            check_settings(self.model, request.input_ids, **settings)

    def _embeddings(self) -> torch.nn.Embedding:
        """The model's token embeddings (transformers types ``get_input_embeddings`` as any module)."""
        return cast(torch.nn.Embedding, self.model.get_input_embeddings())

    # -- running -----------------------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> list:
        """Each request's reply ``(call, tensors)``, or the exception that request alone raises: together in
        one forward where they can share one, else (or where that fails) one by one."""
        device = self._embeddings().weight.device
        requests = [request.to(device) for request in requests]
        replies: list = [None] * len(requests)
        for group in self._forwards(requests):
            if len(group) > 1:
                try:
                    for index, reply in zip(group, self._batch([requests[index] for index in group])):
                        replies[index] = reply
                    continue
                except Exception:  # noqa: BLE001, S110 — one request's edit (or function) failed:
                    pass  # each runs alone, to fail alone
            for index in group:
                try:
                    replies[index] = self._alone(requests[index])
                except Exception as error:  # noqa: BLE001 — that request's answer
                    replies[index] = error
        return replies

    def _forwards(self, requests: list[Request]) -> list[list[int]]:
        """The requests (by index) that share each forward: all of them, where they can share rows and
        padding changes nothing they edit; those of one length, where it would (``_row_wide``); else each
        alone."""
        alone = [[index] for index in range(len(requests))]
        if len(requests) < 2 or not all(request.batchable for request in requests):
            return alone
        try:
            if not self._shares_rows(requests[0]):
                return alone
            if not self._row_wide(requests[0]):
                return [list(range(len(requests)))]
        except Exception:  # noqa: BLE001 — its program cannot be made: each runs alone, to fail alone
            return alone
        lengths: dict[int, list[int]] = {}
        for index, request in enumerate(requests):
            lengths.setdefault(request.input_ids.shape[1], []).append(index)
        return list(lengths.values())

    def _alone(self, request: Request):
        ig = self.instrument(request)
        self._check_reply(ig, request)
        self.forwards += 1
        if request.generate is not None:
            return self._generate(ig, request, request.generate)
        if request.backward is not None:
            return self._backward(ig, request, request.backward)
        if request.lens is not None:
            return self._lens(ig, request, request.lens)
        with torch.no_grad():
            out = ig(request.input_ids, request.attention_mask, edits=request.edits or None)
        return _reply(ig, out.logits if request.logits else None, out.values)

    def _backward(self, ig, request: Request, backward: torch.Tensor):
        assert isinstance(request.values, dict), "request_of refuses a backward without values as an object"
        grads = [name for name, options in request.values.items() if options.get("grad")]
        with torch.enable_grad():
            out = ig(request.input_ids, request.attention_mask, edits=request.edits or None)
            if out.logits is None or backward.shape != out.logits.shape:
                raise Unprocessable(f"backward's tensor is {list(backward.shape)}; it is d loss / d logits, "
                                    f"of the logits' shape {list(out.logits.shape) if out.logits is not None else '?'}")
            loss = (out.logits * backward.to(out.logits.dtype)).sum()
            gradients = out.gradients(loss, ig.resolve(grads))
        reply = _reply(ig, out.logits.detach(), out.values)
        reply[1].update({f"grad.{name}": tensor for name, tensor in gradients.items()})
        reply[0]["grads"] = list(gradients)
        return reply

    def _lens(self, ig, request: Request, options: dict):
        lens = ig.logit_lens(request.input_ids, request.attention_mask, **options)
        tensors = {"lens.ids": lens.top_ids, "lens.probabilities": lens.top_probs}
        if options.get("logits"):
            tensors["lens.logits"] = lens.logits
        return {"blocks": len(lens), "positions": lens.positions}, tensors

    def _generate(self, ig, request: Request, settings: dict):
        out = ig.generate(request.input_ids, request.attention_mask, edits=request.edits or None, **settings)
        tensors = {"sequences": out.sequences}
        for step, values in enumerate(out.steps):  # a step that chose a token: its logits and scores, as HF's
            chose = step < len(out.logits)
            tensors[f"step.{step}.logits"] = out.logits[step] if chose else values.logits[:, -1]
            if chose:  # unprocessed (greedy, no settings), HF's scores are its logits: the wire holds each apart
                scores, logits = out.scores[step], out.logits[step]
                shared = scores.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
                tensors[f"step.{step}.scores"] = scores.clone() if shared else scores
            tensors.update({f"step.{step}.value.{name}": tensor for name, tensor in values.items()})
        return {"steps": len(out.steps), "values": list(ig.values)}, tensors

    def _batch(self, requests: list[Request]):
        ig = self.instrument(requests[0])
        for request in requests:
            self._check_reply(ig, request)
        self.forwards += 1
        length = max(request.input_ids.shape[1] for request in requests)
        ids, mask, rows = [], [], []
        for request in requests:
            pad = length - request.input_ids.shape[1]
            ids.append(torch.nn.functional.pad(request.input_ids, (pad, 0)))
            mask.append(torch.nn.functional.pad(request.attention_mask, (pad, 0)))
            start = sum(len(part) for part in ids[:-1])
            rows.append((start, start + len(request.input_ids), request.input_ids.shape[1]))
        edits = {}
        for name in dict.fromkeys(n for pattern in requests[0].edits for n in ig.resolve(pattern)):
            target = ig.slot(name).target
            parts = [(row, own[name]) for row, own in zip(rows, (_by_name(ig, r.edits) for r in requests))
                     if name in own]
            edits[name] = RowEdits(target, parts, length)
        with torch.no_grad():
            out = ig(torch.cat(ids), torch.cat(mask), edits=edits or None)
        replies = []
        for request, row in zip(requests, rows):
            logits = _rows(out.logits, ("batch", "seq", "vocab"), row, length) if request.logits else None
            values = {name: _rows(tensor, ig.catalogue[name].dims, row, length) for name, tensor in out.values.items()}
            replies.append(_reply(ig, logits, values))
        return replies

    def _check_reply(self, ig, request: Request) -> None:
        """``TooLarge`` (413) before the forward if the reply would hold more than ``--max-reply-bytes``
        (estimated from the values' layouts: an attention pattern grows as the length squared)."""
        rows, length = request.input_ids.shape
        new = (request.generate or {}).get("max_new_tokens", 0)
        vocab = self._embeddings().num_embeddings
        names = list(ig.values) * (2 if request.backward is not None else 1)  # and their gradients

        def reply(query: int, key: int) -> int:
            sizes = {"batch": rows, "seq": query, "query": query, "positions": query, "key": key}
            total = sum(_elements(ig.catalogue[name].shape, sizes, key) for name in names)
            return 4 * (total + (rows * query * vocab if request.logits or new else 0))
        estimate = reply(length, length) + new * reply(1, length + new)
        if request.lens is not None:  # the grid's top tokens (ids, probabilities), its full logits if asked
            positions = request.lens.get("positions", "all")
            cells = rows * ig.blocks * (length if positions == "all" else len(positions))
            estimate = cells * (12 * request.lens.get("top", 5) + (4 * vocab if request.lens.get("logits") else 0))
        if estimate > self.limits.max_reply_bytes:
            raise TooLarge(f"the reply would hold about {estimate:,} bytes, more than this server's --max-reply-bytes "
                           f"{self.limits.max_reply_bytes:,}: ask for fewer values (attention patterns grow as the "
                           f"length squared; a lens: fewer positions, or no logits), fewer rows or a shorter prompt")

    def _row_wide(self, request: Request) -> bool:
        """Whether the program edits a value with no token axis (a DeltaNet's ``state_input`` or
        ``conv_state_input``, ...): what such an edit gives enters the row before its first token, and the
        pads of a longer request would change it (see the module's doc), so it runs with its length only."""
        ig = self.instrument(request)
        return any(not set(SEQUENCE_DIMS) & set(ig.catalogue[name].dims)
                   for pattern in request.edits for name in ig.resolve(pattern))

    def _shares_rows(self, request: Request) -> bool:
        """Whether the program's values and edited values all lie along the batch (and, if at all, the tokens)."""
        ig = self.instrument(request)
        names = [*ig.values, *(n for pattern in request.edits for n in ig.resolve(pattern))]
        return all("batch" in ig.catalogue[name].dims and "positions" not in ig.catalogue[name].dims
                   for name in names)


class RowEdits(Region):
    """One batched forward's edit at one value: each request's edit on its own rows and positions, reading
    its own rows (and real tokens) of what the edits read of the forward."""

    def __init__(self, target, parts: list, length: int):  # not the dataclass's fields: no region of its own
        self.target, self.parts, self.length = target, parts, length

    @property
    def affine(self) -> bool:  # type: ignore[override]  # as its requests' edits are
        return all(getattr(edit, "affine", False) for _, edit in self.parts)

    def needs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for _, edit in self.parts for name in needs(edit)))

    def bind(self, resolve) -> RowEdits:
        return RowEdits(self.target, [(row, edit.bind(resolve) if isinstance(edit, Region) else edit)
                                      for row, edit in self.parts], self.length)

    def apply(self, x: torch.Tensor, target, forward: Forward | None = None) -> torch.Tensor:
        out = x.clone()
        reads = (forward or Forward()).reads
        for row, edit in self.parts:
            index = _index(self.target.dims, row, self.length)
            own = Forward({name: (tensor[_index(read.dims, row, self.length)], read)
                           for name, (tensor, read) in reads.items()})
            out[index] = apply_edit(edit, x[index], self.target, own)
        return out

    def __repr__(self) -> str:
        return f"RowEdits({self.target.name}, {len(self.parts)} requests)"


def _by_name(ig, edits: dict) -> dict:
    """``{name: edit}`` of a request's ``{pattern: edit}`` (a later pattern wins at a name)."""
    return {name: edit for pattern, edit in edits.items() for name in ig.resolve(pattern)}


def _index(dims, row: tuple, length: int) -> tuple:
    start, stop, own = row
    return tuple(slice(start, stop) if dim == "batch" else slice(length - own, None) if dim in SEQUENCE_DIMS
                 else slice(None) for dim in dims)


def _rows(tensor: torch.Tensor, dims, row: tuple, length: int) -> torch.Tensor:
    return tensor[_index(dims, row, length)]  # a view: wire.pack copies it into the reply


def _elements(shape, sizes: dict, longest: int) -> int:
    """Elements of a catalogue shape (ints, axis names, products like ``4*batch*seq``) at ``sizes`` (an axis
    it does not know counts as ``longest``)."""
    count = 1
    for size in shape:
        for factor in str(size).split("*"):
            count *= int(factor) if factor.isdigit() else sizes.get(factor, longest)
    return count


def _reply(ig, logits, values: dict) -> tuple[dict, dict]:
    tensors = {f"value.{name}": tensor.detach() for name, tensor in values.items()}
    if logits is not None:
        tensors["logits"] = logits.detach()
    return {"values": list(values), "blocks": ig.blocks}, tensors

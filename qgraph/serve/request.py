"""One ``POST /v1/run`` as the server runs it: the call's fields checked (a positive list of keys, every
type, every bound) before anything runs, and the reply packed.

The call (``docs/serving.md``)::

    {"values": [pattern, ...] | {name: {"grad": true}, ...},   # what to capture (default: nothing)
     "edits": {pattern: edit, ...},                            # serve/edits.py: Replace/Add/Scale/Zero, function
     "logits": true,                                           # whether the reply holds the logits
     "generate": {"max_new_tokens": 8, ...},                    # generate instead of one forward
     "backward": "logits.grad",                                # run backward from this tensor (d loss / d logits)
     "lens": {"positions": "all", "top": 5, "logits": false}}  # the logit lens instead of one forward

beside the tensors ``input_ids`` and ``attention_mask`` (``[batch, seq]``, integers) and the edits' own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import InvalidArgument
from ..saved.fields import Check, Fields, dict_of, either, flag, integer, list_of, number, one_of, optional, shown, text
from .edits import decode
from .limits import Limits
from .wire import WireError

CALL_KEYS = {"values", "edits", "logits", "generate", "backward", "lens"}
LENS_KEYS = {"positions", "top", "logits"}
_NAME = 300  # characters of a value name or pattern
_name = text(_NAME, printable=True)
_INT, _REAL = (integer(), "an int"), (number(1e6), "a number of magnitude below 1e6")
_REALS = ("temperature", "top_p", "repetition_penalty")
TENSOR_FIELDS = ("tensor", "factor")  # the fields of an edit that may hold a tensor


class TooLarge(InvalidArgument):
    """A request over one of the server's limits (413)."""

    status = 413


class Unprocessable(InvalidArgument):
    """A well-formed request that cannot run (422)."""

    status = 422


@dataclass
class Request:
    """A checked call: its inputs, what it captures and edits, and how it runs."""

    values: list | dict
    edits: dict  # pattern -> edit (serve/edits.decode)
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits: bool = True
    generate: dict | None = None
    backward: torch.Tensor | None = None
    lens: dict | None = None
    body: bytes = field(default=b"", repr=False)  # as it came: what rank 0 hands the other stages (serve/stages.py)

    def to(self, device: torch.device) -> Request:
        """The request with its tensors (inputs, edits' tensors, the backward's) on ``device``, where the
        model is (a body's tensors arrive on the CPU); a function edit moves its own graph."""
        moved = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        edits = {pattern: dataclasses.replace(edit, **{f.name: moved(getattr(edit, f.name))
                                                        for f in dataclasses.fields(edit) if f.name in TENSOR_FIELDS})
                 if dataclasses.is_dataclass(edit) and not isinstance(edit, type) else edit  # decode makes instances
                 for pattern, edit in self.edits.items()}
        return dataclasses.replace(self, edits=edits, input_ids=moved(self.input_ids),
                                   attention_mask=moved(self.attention_mask), backward=moved(self.backward))

    @property
    def key(self) -> tuple:
        """The program the request runs: requests of one key can run as one forward."""
        values = tuple(self.values.items()) if isinstance(self.values, dict) else tuple(self.values)
        return repr(values), tuple(sorted(self.edits)), self.logits

    @property
    def tokens(self) -> int:
        rows, length = self.input_ids.shape
        return rows * (length + (self.generate or {}).get("max_new_tokens", 0))

    @property
    def batchable(self) -> bool:
        """Whether it may share a forward with others: a plain call (no generation, no gradients, no
        per-value options, whose positions would move with the padding)."""
        return self.generate is None and self.backward is None and self.lens is None and \
            not isinstance(self.values, dict)


def request_of(call: dict, tensors: dict[str, torch.Tensor], limits: Limits) -> Request:
    """The ``Request`` of a parsed body, or a ``WireError`` (400: not the format), ``TooLarge`` (413)
    or ``Unprocessable`` (422) naming the field."""
    fields = Fields(call, "the call", Unprocessable, keys=CALL_KEYS, unknown=WireError)
    used = {"input_ids", "attention_mask"}
    ids, mask = _inputs(tensors)
    values = _values(fields, limits)
    edits = fields.get("edits", dict_of(lambda spec: True, _name, limits.max_values),
                       f"an object {{pattern: edit}} of at most {limits.max_values} entries, each pattern a name of 1 "
                       f"to {_NAME} printable characters", default={})
    decoded = {pattern: decode(pattern, spec, tensors, f"edit.{index}", used)
               for index, (pattern, spec) in enumerate(edits.items())}
    logits = fields.get("logits", flag, "true or false", default=True)
    generate = _generate(call.get("generate"), limits)
    backward = fields.get("backward", optional(one_of(tensors)), "the name of the body's tensor of d loss / d logits",
                          default=None)
    if backward is not None:
        if generate is not None:
            fields.fail("backward", "runs after one forward: a call with backward holds no generate")
        if not isinstance(values, dict):
            fields.fail("backward", 'returns the gradients of values asked as {name: {"grad": true}}: a call with '
                                    'backward gives its values as that object')
        used.add(backward)
        backward = tensors[backward]
    lens = _lens(call.get("lens"))
    if lens is not None and (generate is not None or backward is not None or edits):
        fields.fail("lens", "runs alone: a call with lens holds no generate, backward or edits")
    extra = sorted(set(tensors) - used)
    if extra:
        raise Unprocessable(f"the body holds tensors no field names: {extra[:5]}")
    request = Request(values, decoded, ids, mask, logits, generate, backward, lens)
    if request.tokens > limits.max_batch_tokens:
        raise TooLarge(f"the request needs {request.tokens:,} tokens (rows x (length + new tokens)), more than this "
                       f"server's --max-batch-tokens {limits.max_batch_tokens:,}: send fewer or shorter prompts")
    return request


def _inputs(tensors: dict) -> tuple[torch.Tensor, torch.Tensor]:
    ids = tensors.get("input_ids")
    if ids is None or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32) or ids.numel() == 0:
        raise Unprocessable("the body must hold input_ids, a non-empty integer tensor [batch, seq]")
    mask = tensors.get("attention_mask")
    if mask is None:
        return ids.long(), torch.ones_like(ids, dtype=torch.long)
    if mask.shape != ids.shape or mask.dtype not in (torch.int64, torch.int32, torch.bool):
        raise Unprocessable(f"attention_mask must be an integer or bool tensor of input_ids' shape {list(ids.shape)}")
    return ids.long(), mask.long()


def _values(fields: Fields, limits: Limits) -> list | dict:
    values = fields.get("values", lambda v: isinstance(v, (list, dict)),
                        'a list of names and globs, or an object {name: {"grad": true}}', default=[])
    if len(values) > limits.max_values:
        raise TooLarge(f"the request asks for {len(values)} values, more than the {limits.max_values} it may")
    for name in values:
        if not _name(name):
            fields.fail("values", f"holds {shown(name)}, not the name of a value or a glob (1 to {_NAME} printable "
                                  f"characters)")
    if isinstance(values, dict):
        for name, options in values.items():
            Fields(options, f"the call's options of {shown(name)}", Unprocessable, keys={"grad"}).get(
                "grad", flag, "true or false", default=False)
    return values


def _generate_keys(most: int) -> dict[str, tuple[Check, str]]:
    """What each setting of a call's generate takes (what ``ig.generate`` refuses of their values is refused
    before the request is queued)."""
    return {"max_new_tokens": (integer(1, most), f"a number of new tokens of 1 to {most} (--max-new-tokens)"),
            "min_new_tokens": _INT, "do_sample": (flag, "true or false"), "temperature": _REAL, "top_k": _INT,
            "top_p": _REAL, "repetition_penalty": _REAL, "seed": _INT,
            "steps": (list_of(integer(0, most), high=most + 1), f"a list of step numbers 0 to {most}")}


def _generate(settings, limits: Limits) -> dict | None:
    if settings is None:
        return None
    takes = _generate_keys(limits.max_new_tokens)
    fields = Fields(settings, "the call's generate", Unprocessable, keys=takes)
    settings.setdefault("max_new_tokens", 20)
    for key, (check, what) in takes.items():
        if key in settings:
            fields.get(key, check, what)
    for key in _REALS:
        if key in settings:
            settings[key] = float(settings[key])  # JSON's 0 for 0.0: what a local call passes
    return settings


def _lens(settings) -> dict | None:
    if settings is None:
        return None
    fields = Fields(settings, "the call's lens", Unprocessable, keys=LENS_KEYS)
    fields.get("positions", either(one_of({"all"}), list_of(integer(), 1, 4096)),
               '"all" or a list of 1 to 4096 positions (ints)', default="all")
    fields.get("top", integer(1, 1000), "an int of 1 to 1000", default=5)
    fields.get("logits", flag, "true or false (whether the reply holds the full lens logits)", default=False)
    return settings

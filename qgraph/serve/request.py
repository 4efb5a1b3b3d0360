"""One ``POST /v1/run`` as the server runs it: the call's fields checked (a positive list of keys, every
type, every bound) before anything runs, and the reply packed.

The call (``docs/serving.md``)::

    {"values": [pattern, ...] | {name: {"grad": true}, ...},   # what to capture (default: nothing)
     "edits": {pattern: edit, ...},                            # serve/edits.py: Replace/Add/Scale/Zero, function
     "logits": true,                                           # whether the reply holds the logits
     "generate": {"max_new_tokens": 8, ...},                    # generate instead of one forward
     "backward": "logits.grad",                                # run backward from this tensor (d loss / d logits)
     "lens": {"positions": [-1], "top": 5}}                    # the logit lens instead of one forward

beside the tensors ``input_ids`` and ``attention_mask`` (``[batch, seq]``, integers) and the edits' own.
"""
from __future__ import annotations

import numbers
import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import InvalidArgument
from .edits import decode
from .limits import Limits
from .wire import WireError

CALL_KEYS = {"values", "edits", "logits", "generate", "backward", "lens"}
GENERATE_KEYS = {"max_new_tokens": int, "min_new_tokens": int, "do_sample": bool, "temperature": float,
                 "top_k": int, "top_p": float, "repetition_penalty": float, "seed": int, "steps": list}
_NAME = 300  # characters of a value name or pattern
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

    def to(self, device: torch.device) -> "Request":
        """The request with its tensors (inputs, edits' tensors, the backward's) on ``device``, where the
        model is (a body's tensors arrive on the CPU); a function edit moves its own graph."""
        moved = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
        edits = {pattern: dataclasses.replace(edit, **{f.name: moved(getattr(edit, f.name))
                                                        for f in dataclasses.fields(edit) if f.name in TENSOR_FIELDS})
                 if dataclasses.is_dataclass(edit) else edit for pattern, edit in self.edits.items()}
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
    unknown = sorted(set(call) - CALL_KEYS)
    if unknown:
        raise WireError(f"the call holds {unknown}; a call holds {', '.join(sorted(CALL_KEYS))}")
    used = {"input_ids", "attention_mask"}
    ids, mask = _inputs(tensors)
    values = _values(call.get("values", []), limits)
    edits = call.get("edits", {})
    if not isinstance(edits, dict) or len(edits) > limits.max_values:
        raise Unprocessable(f"edits takes an object {{pattern: edit}} of at most {limits.max_values} entries")
    decoded = {}
    for index, (pattern, spec) in enumerate(edits.items()):
        _check_name(pattern, "an edit's pattern")
        decoded[pattern] = decode(pattern, spec, tensors, f"edit.{index}", used)
    logits = call.get("logits", True)
    if not isinstance(logits, bool):
        raise Unprocessable(f"logits takes true or false, not {str(logits)[:40]}")
    generate = _generate(call.get("generate"), limits)
    backward = call.get("backward")
    if backward is not None:
        if generate is not None or not isinstance(backward, str) or backward not in tensors:
            raise Unprocessable("backward names the tensor of d loss / d logits the body holds (not with generate)")
        used.add(backward)
        backward = tensors[backward]
    lens = _lens(call.get("lens"))
    if lens is not None and (generate is not None or backward is not None or call.get("edits")):
        raise Unprocessable("lens runs alone: a call with lens holds no generate, backward or edits")
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


def _values(values, limits: Limits):
    if isinstance(values, list):
        if len(values) > limits.max_values:
            raise TooLarge(f"the request asks for {len(values)} values, more than the {limits.max_values} it may")
        for name in values:
            _check_name(name, "a value")
        return values
    if isinstance(values, dict):
        if len(values) > limits.max_values:
            raise TooLarge(f"the request asks for {len(values)} values, more than the {limits.max_values} it may")
        for name, options in values.items():
            _check_name(name, "a value")
            if not isinstance(options, dict) or set(options) - {"grad"} or not all(
                    isinstance(v, bool) for v in options.values()):
                raise Unprocessable(f"the options of '{name[:60]}' take {{\"grad\": true|false}} only")
        return values
    raise Unprocessable("values takes a list of names and globs, or an object {name: {\"grad\": true}}")


def _check_name(name, what: str) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= _NAME or not name.isprintable():
        raise Unprocessable(f"{what} is a name of 1 to {_NAME} printable characters, not {str(name)[:60]!r}")


def _generate(settings, limits: Limits) -> dict | None:
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise Unprocessable("generate takes an object of settings, e.g. {\"max_new_tokens\": 8}")
    unknown = sorted(set(settings) - set(GENERATE_KEYS))
    if unknown:
        raise Unprocessable(f"generate takes {', '.join(GENERATE_KEYS)}, not {unknown}")
    for key, value in settings.items():
        kind = GENERATE_KEYS[key]
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        fits = isinstance(value, bool) if kind is bool else (
            isinstance(value, int) and not isinstance(value, bool) if kind is int else
            number and value == value and abs(value) < 1e6 if kind is float else isinstance(value, list))
        if not fits:
            raise Unprocessable(f"generate's {key} takes {kind.__name__}, not {str(value)[:40]}")
        if kind is float:
            settings[key] = float(value)  # JSON's 0 for 0.0: what a local call passes
    if "steps" in settings and not (len(settings["steps"]) <= limits.max_new_tokens + 1 and all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= limits.max_new_tokens
            for s in settings["steps"])):
        raise Unprocessable(f"generate's steps takes a list of step numbers 0 to {limits.max_new_tokens}")
    new = settings.setdefault("max_new_tokens", 20)
    if not 1 <= new <= limits.max_new_tokens:
        raise Unprocessable(f"max_new_tokens is {new}; this server generates 1 to {limits.max_new_tokens} new tokens "
                            f"(--max-new-tokens)")
    return settings


def _lens(settings) -> dict | None:
    if settings is None:
        return None
    positions, top = (settings.get(key) if isinstance(settings, dict) else None for key in ("positions", "top"))
    if not isinstance(settings, dict) or set(settings) != {"positions", "top"} or not isinstance(positions, list) \
            or not 0 < len(positions) <= 4096 or not all(isinstance(p, int) and not isinstance(p, bool) for p in positions) \
            or not isinstance(top, int) or isinstance(top, bool) or not 1 <= top <= 1000:
        raise Unprocessable('lens takes {"positions": [ints], "top": 1 to 1000}')
    return settings

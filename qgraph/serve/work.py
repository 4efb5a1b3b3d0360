"""The work a request's function edits may add to its forward, checked before the request is queued.

A function edit is a client's graph: the sandbox bounds its bytes and counts its floating-point operations
as an expression of the value's sizes (``saved.work``). The server evaluates it at the request's own sizes,
for every slot the edit's pattern names and every forward the request runs (the prompt's, then one per new
token, whose values span one position, their keys the whole sequence), and refuses (413) a request whose
edits would compute more than ``Limits.max_edit_work`` times its forward (about 2 operations per parameter
per token). So what a key holder can make the server do is bounded by the model's own work: at most
``1 + max_edit_work`` forwards of ``--max-batch-tokens`` tokens per request.
"""
from __future__ import annotations

from .limits import Limits
from .request import Request, TooLarge

STEP_DIMS = ("seq", "query")  # a decode step's values span one position along these (keys span them all)


def check_edit_work(request: Request, resolve, parameters: int, limits: Limits) -> float:
    """Refuse ``request`` if its function edits would compute more than ``limits.max_edit_work`` times its
    forward (a model of ``parameters`` weights; ``resolve(pattern)`` names the slots a pattern edits);
    returns their work."""
    rows, length = request.input_ids.shape
    new = request.generate["max_new_tokens"] if request.generate is not None else 0
    forward = 2 * parameters * rows * (length + new)
    total = 0.0
    for pattern, edit in request.edits.items():
        if not hasattr(edit, "work"):  # Replace, Add, Scale, Zero: elementwise, the forward's own order
            continue
        slots = len(resolve(pattern))
        prompt = [rows if dim == "batch" else length if isinstance(size, str) else size
                  for dim, size in zip(edit.dims, edit.shape)]
        step = [rows if dim == "batch" else 1 if dim in STEP_DIMS else length + new if isinstance(size, str) else size
                for dim, size in zip(edit.dims, edit.shape)]
        total += slots * (edit.work(prompt) + (new * edit.work(step) if new else 0))
    if total > limits.max_edit_work * forward:
        raise TooLarge(f"the request's function edits would compute {total:.3g} floating-point operations, more than "
                       f"{limits.max_edit_work:g} x its forward's {forward:.3g} (the server's --max-edit-work): edit "
                       f"fewer slots, or write the edit with less work (Replace, Add, Scale, Zero cost nothing)")
    return total

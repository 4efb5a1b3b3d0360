"""The prompt's image and video tokens against the call's grids, run by run.

Transformers' ``get_rope_index`` walks each prompt's real tokens (batch row after row) in runs of one
kind, and gives each run of image tokens the next ``image_grid_thw`` row and each run of video tokens
the next temporal patch of ``video_grid_thw`` (the processor lays a video out as one ``<|vision_start|>
... <|vision_end|>`` group of ``h*w/merge²`` tokens per temporal patch). A grid with the right totals
but another layout (``[[3, 4, 4]]`` for a prompt laid out for ``[[2, 4, 6]]``) makes it fail with a
bare ``RuntimeError`` or ``StopIteration``; ``check_runs`` names the grid, the run that disagrees and
what the prompt holds instead, with a few tensor ops over the prompt (no loop over its tokens).
"""
from __future__ import annotations

import torch

from ..errors import InvalidArgument

_SHOWN = 8  # runs and grid rows a message lists


def check_runs(input_ids: torch.Tensor, attention_mask: torch.Tensor, config, image_grid_thw, video_grid_thw) -> None:
    """Each run of image (video) tokens among the real tokens must be as long as its grid row (temporal
    patch) gives, in order: an ``InvalidArgument`` naming the grid otherwise. The grids are checked
    (``[n, 3]``, positive, h and w multiples of the merge) and their totals agree with the prompt's."""
    merge = config.vision_config.spatial_merge_size
    real = attention_mask.bool()
    for what, token, grid in (("image", config.image_token_id, image_grid_thw),
                              ("video", config.video_token_id, video_grid_thw)):
        if grid is None:
            continue
        if what == "image":  # one run of t * h * w / merge² tokens per image
            per, tokens = torch.ones_like(grid[:, 0]), grid.prod(-1)
        else:  # one run of h * w / merge² tokens per temporal patch
            per, tokens = grid[:, 0], grid[:, 1:].prod(-1)
        expected = torch.repeat_interleave(tokens // merge**2, per)
        hit = (input_ids == token) & real
        lengths = _runs(hit, real)
        if lengths.shape == expected.shape and torch.equal(lengths, expected.to(lengths.device)):
            continue
        owner = torch.repeat_interleave(torch.arange(grid.shape[0], device=grid.device), per)
        starts = hit.nonzero()[torch.cumsum(lengths, 0) - lengths]  # (row, position) of each run's first token
        raise InvalidArgument(_message(what, token, grid, expected.tolist(), owner.tolist(), lengths.tolist(),
                                       starts.tolist(), merge))


def _runs(hit: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The lengths of the runs of ``hit`` [batch, seq] over the real tokens, row after row: hits with
    no real token between them are one run (padding between them is dropped, as get_rope_index does)."""
    others = torch.cumsum(real & ~hit, 1)  # the real tokens before each position that are not hits
    row = torch.arange(hit.shape[0], device=hit.device)[:, None] * (hit.shape[1] + 1)
    return torch.unique_consecutive((others + row)[hit], return_counts=True)[1]


def _message(what, token, grid, expected, owner, lengths, starts, merge) -> str:
    name = f"{what}_grid_thw"
    index = next((k for k, (want, have) in enumerate(zip(expected, lengths)) if want != have),
                 min(len(expected), len(lengths)))
    if index < len(expected):
        of = f"{what} {owner[index]}" if what == "image" else \
            f"video {owner[index]}'s temporal patch {index - owner.index(owner[index])}"
        needs = f"group {index} ({of}, grid row {grid[owner[index]].tolist()}) needs {expected[index]} tokens"
    else:
        needs = f"the grid gives only {len(expected)} groups"
    if index < len(lengths):
        holds = f"input_ids row {starts[index][0]} has {lengths[index]} from position {starts[index][1]}"
        holds = holds if index < len(expected) else f"{holds} (group {index})"
    else:
        holds = f"the real tokens of input_ids (attention_mask 1) hold only {len(lengths)} in all"
    unit = f"one group of t*h*w/{merge**2} image tokens per image" if what == "image" else \
        f"one group of h*w/{merge**2} video tokens per temporal patch"
    tiny = " (qgraph.testing.video_prompt for the tiny model's videos)" if what == "video" else ""
    return (f"{name} {_listed(grid.tolist())} does not fit the prompt's {what} tokens (id {token}): it gives groups "
            f"of {_listed(expected)} ({unit}, as the processor lays them out) but input_ids hold groups of "
            f"{_listed(lengths)}; {needs} but {holds}. Pass the {name} the processor returned with this prompt, or "
            f"build the prompt from these {what}s with the processor{tiny}")


def _listed(items: list) -> str:
    return str(items) if len(items) <= _SHOWN else f"{str(items[:_SHOWN])[:-1]}, ... ({len(items)} in all)]"

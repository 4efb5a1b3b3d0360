"""QSA's token selection (Qwen3.8-Flash-Next's ``indexed_attention`` blocks) as one program for every prompt.

transformers' indexer (``Qwen4ExpTextQSAIndexer._select_tokens``) loops over batch rows and queries: for
each query it takes the keys the attention mask lets it see (``nonzero``), groups them in order into
blocks of ``ratio`` tokens, pools each complete block's raw keys (mean, ``k_layernorm``, the rotary at the
block's first token), scores the blocks against the query's index heads (``sum_h relu(q_h . k) / sqrt(d)``),
keeps the ``top`` best complete blocks (``topk``) and the incomplete tail. The shapes depend on the data,
so ``torch.export`` cannot follow it, and it runs once per query.

Here the same selection is three steps:

* ``qgraph::qsa_blocks`` (one opaque node): the row's blocks, its keys that its last query sees in groups
  of ``ratio`` (in order: on a left-padded row they start at the first real token), gathered once per row
  with each block's first token. For the masks transformers builds here (causal, with padding anywhere)
  each query's visible keys are the first ones of its row's last query, so its blocks are the row's first
  ``visible // ratio`` blocks: the loop's blocks, with the same keys.
* ``block_scores`` (plain torch, traced): each block pooled (mean, ``k_layernorm``, the rotary at its
  first token: the same ops on the same rows as the loop), every query's score of every block in one
  matmul, ``-inf`` where the block is not among the query's complete blocks. No size in it is the number of
  keys or blocks (the op's results carry those): a cached decoding step (``passes.decode``) hands the op
  more keys than it has queries, and the traced program follows.
* ``qgraph::qsa_select`` (one opaque node): the blocks each query keeps and the tokens that makes,
  ``[batch query key]``. Its kernel runs ``topk`` once per distinct number of complete blocks, on
  exactly the slices the loop runs it on (the first ``count`` scores of each query with ``count``
  blocks), so even tied scores (a relu sum of 0) pick the blocks the loop picks. A one-token query with
  cached keys (a decoding step) is the same selection over its ``[batch 1 past + 1]`` visible keys.

The two ops are on the positive list of what a saved program may call (``saved.allowed``), so their arguments
may be a hostile file's: each one's kernel and fake (which the sandbox's fake run calls at load) refuse by
name what the indexer and ``block_scores`` never hand it (``check_blocks``, ``check_arguments``: dtypes,
ranks, sizes that disagree, a ratio or budget that is not a non-negative int), and the kernels allocate by
their tensors' sizes alone (a budget past the blocks picks them all), so what they make is bounded by what
they are given.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import InvalidArgument, NotSupported


def block_scores(q: torch.Tensor, raw_keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 visible: torch.Tensor, norm: Callable, rotary: Callable, ratio: int) -> torch.Tensor:
    """Every query's score of every block of its row, float32 ``[batch query blocks]`` (``-inf`` where the
    block is not one of the query's complete blocks). ``q`` ``[batch query heads dim]`` is the normed,
    rotated index queries; ``raw_keys`` ``[batch key dim]``; ``cos``/``sin`` ``[batch key rotary]`` every
    key's rotary; ``visible`` ``[batch query key]`` the attention mask; ``norm`` the indexer's
    ``k_layernorm``, ``rotary`` the model's ``apply_rotary_pos_emb``."""
    groups, starts = torch.ops.qgraph.qsa_blocks(raw_keys, visible, ratio)
    pooled = norm(groups.float().mean(dim=2).to(raw_keys.dtype))
    firsts = starts.unsqueeze(-1).expand(-1, -1, cos.shape[-1])  # each block's first token
    block_keys = rotary(pooled.unsqueeze(2), cos=cos.gather(1, firsts), sin=sin.gather(1, firsts),
                        unsqueeze_dim=2).squeeze(2)
    # [batch query*heads dim] @ [batch dim blocks]: one matmul per row (not the keys broadcast to every query)
    scores = torch.matmul(q.float().flatten(1, 2), block_keys.float().transpose(-1, -2)).unflatten(1, q.shape[1:3])
    scores = torch.relu(scores).sum(dim=2) / math.sqrt(raw_keys.shape[-1])  # [batch query blocks]
    count = visible.sum(-1) // ratio
    block = torch.ones_like(starts).cumsum(-1) - 1  # each block's index, counted at run time
    return scores.masked_fill(block.unsqueeze(1) >= count.unsqueeze(-1), -math.inf)


def _block_tokens(visible: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[batch blocks ratio]``: the keys of each block of each row, ``blocks = key // ratio``; a row's keys
    that its last query sees come first, in order (the rest fill the blocks no query of the row completes)."""
    batch, _, keys = visible.shape
    blocks = keys // ratio
    order = torch.sort((~visible[:, -1]).to(torch.uint8), dim=-1, stable=True).indices
    return order[:, :blocks * ratio].reshape(batch, blocks, ratio)


@torch.library.custom_op("qgraph::qsa_blocks", mutates_args=())
def qsa_blocks(keys: torch.Tensor, visible: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks of each row's ``keys`` ``[batch key dim]``: their keys ``[batch blocks ratio dim]`` and
    each block's first token ``[batch blocks]``, blocks of ``ratio`` of the keys the row's last query sees
    (``visible`` ``[batch query key]``), in order."""
    check_blocks(keys, visible, ratio)
    tokens = _block_tokens(visible, ratio)
    batch, blocks, _ = tokens.shape
    groups = keys.gather(1, tokens.reshape(batch, -1, 1).expand(-1, -1, keys.shape[-1]))
    return groups.reshape(batch, blocks, ratio, keys.shape[-1]), tokens[..., 0].contiguous()


def check_blocks(keys: torch.Tensor, visible: torch.Tensor, ratio) -> None:
    """Refuse arguments the indexer never hands ``qsa_blocks`` (``InvalidArgument``, naming them): float keys
    ``[batch key dim]`` beside a bool ``[batch query key]`` mask of the same batch and keys on one device, and
    ``ratio`` >= 1 a plain int (the config's)."""
    where = "qgraph::qsa_blocks"
    _check_int(where, "ratio", ratio, 1)
    _check_mask(where, visible)
    if not keys.is_floating_point() or keys.dim() != 3 or keys.device != visible.device or \
            keys.shape[0] != visible.shape[0] or keys.shape[1] != visible.shape[2]:
        raise InvalidArgument(f"{where} takes float keys [batch key dim] beside a mask [batch query key] on one "
                              f"device, not {keys.dtype} {list(keys.shape)} ({keys.device}) and "
                              f"{list(visible.shape)} ({visible.device})")


@qsa_blocks.register_fake
def _(keys, visible, ratio):
    check_blocks(keys, visible, ratio)
    batch, count, dim = keys.shape
    return keys.new_empty(batch, count // ratio, ratio, dim), keys.new_empty(batch, count // ratio, dtype=torch.long)


def _keep_visible(ctx, inputs, output):
    keys, visible, ratio = inputs
    ctx.save_for_backward(visible)
    ctx.ratio, ctx.shape = ratio, keys.shape


def _scatter_back(ctx, grad_groups, grad_starts):
    """Each block key's gradient added back at the key it was gathered from."""
    visible, = ctx.saved_tensors
    batch, _, dim = ctx.shape
    tokens = _block_tokens(visible, ctx.ratio).reshape(batch, -1, 1).expand(-1, -1, dim)
    grad = grad_groups.new_zeros(ctx.shape).scatter_add(1, tokens, grad_groups.reshape(batch, -1, dim))
    return grad, None, None


qsa_blocks.register_autograd(_scatter_back, setup_context=_keep_visible)


@torch.library.custom_op("qgraph::qsa_select", mutates_args=())
def qsa_select(scores: torch.Tensor, visible: torch.Tensor, ratio: int, top: int) -> torch.Tensor:
    """The tokens each query keeps, ``[batch query key]`` bool: its ``top`` best-scored complete blocks
    (``scores`` ``[batch query blocks]``) and the incomplete tail of its ``visible`` keys (``[batch query key]``),
    blocks of ``ratio`` visible keys in order."""
    check_arguments(scores, visible, ratio, top)
    row = visible[:, -1:]  # the keys block_scores made the row's blocks of
    if not torch.equal(visible, row & (row.cumsum(-1) <= visible.sum(-1, keepdim=True))):
        raise NotSupported("sparse attention's selection here takes each query's visible keys to be the first "
                           "ones its row's last query sees (a causal mask, with padding); this attention mask "
                           "is another kind: pass a causal attention_mask of 0s and 1s per token")
    count = visible.sum(-1) // ratio  # complete blocks per query
    blocks = scores.shape[-1]
    flat, order = count.flatten(), count.flatten().argsort(stable=True)  # queries grouped by their count
    ranked = scores.flatten(0, -2)[order]
    top = min(top, blocks)  # a budget past the blocks keeps them all: nothing allocated by the budget itself
    picked = torch.full((flat.shape[0], top), blocks, dtype=torch.long, device=scores.device)  # blocks: none
    start = 0
    for n, size in zip(*(part.tolist() for part in torch.unique_consecutive(flat[order], return_counts=True))):
        if n:  # the loop's topk on the loop's slices (the first n scores), batched over the queries with n blocks
            picked[start:start + size, :min(top, n)] = ranked[start:start + size, :n].topk(min(top, n), dim=-1).indices
        start += size
    chosen = torch.zeros(flat.shape[0], blocks + 1, dtype=torch.bool, device=scores.device).scatter(-1, picked, True)
    chosen = torch.zeros_like(chosen).index_copy(0, order, chosen).view(*scores.shape[:-1], blocks + 1)  # unsorted
    block = torch.div(visible.cumsum(-1) - 1, ratio, rounding_mode="floor").clamp_min(0)  # each key's block
    kept = chosen.gather(-1, block) | (block >= count.unsqueeze(-1))  # a chosen block, or the tail
    return visible & kept


def check_arguments(scores: torch.Tensor, visible: torch.Tensor, ratio, top) -> None:
    """Refuse arguments ``block_scores`` and the indexer never make (``InvalidArgument``, naming them): float
    ``[batch query blocks]`` scores, a bool ``[batch query key]`` mask of the same batch and queries on the
    same device, ``blocks == key // ratio``, and ``ratio`` >= 1 and ``top`` >= 0 plain ints (the config's)."""
    where = "qgraph::qsa_select"
    _check_int(where, "ratio", ratio, 1)
    _check_int(where, "top", top, 0)
    if not scores.is_floating_point() or scores.dim() != 3:
        raise InvalidArgument(f"{where} takes float scores [batch query blocks], not {scores.dtype} "
                              f"{list(scores.shape)}")
    _check_mask(where, visible)
    if scores.device != visible.device or scores.shape[:2] != visible.shape[:2] or \
            scores.shape[2] != visible.shape[2] // ratio:
        raise InvalidArgument(f"{where} takes scores [batch query key // ratio] beside a mask [batch query key] on "
                              f"one device, not {list(scores.shape)} ({scores.device}) and {list(visible.shape)} "
                              f"({visible.device}) with ratio {ratio}")


def _check_int(where: str, name: str, value, least: int) -> None:
    if type(value) is not int or value < least:
        raise InvalidArgument(f"{where} takes {name} as an int of at least {least} (the indexer's config), "
                              f"not {value!r}")


def _check_mask(where: str, visible: torch.Tensor) -> None:
    if visible.dtype != torch.bool or visible.dim() != 3:
        raise InvalidArgument(f"{where} takes a bool mask [batch query key], not {visible.dtype} {list(visible.shape)}")


@qsa_select.register_fake
def _(scores, visible, ratio, top):
    check_arguments(scores, visible, ratio, top)
    return torch.empty_like(visible)


def _no_gradient(ctx, grad):
    return None, None, None, None


qsa_select.register_autograd(_no_gradient)  # a boolean selection: nothing flows back through it


QSA_SELECT_OP = torch.ops.qgraph.qsa_select.default
QSA_BLOCKS_OP = torch.ops.qgraph.qsa_blocks.default

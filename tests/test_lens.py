"""The logit lens as a grid (issue 55): every block × every position, equal to the model's own final norm and
lm_head on each block's output as HF forward hooks see it (on a fresh copy of the model: the session's
models stay unhooked), its full logits when asked, and left padding that moves nothing real."""
from __future__ import annotations

import pytest
import torch

import qgraph

from conftest import hooked_blocks, random_ids

BLOCKS = 4


@pytest.fixture(scope="module")
def fresh(hooks_model):
    """A model of its own for the hooks: the reference, never instrumented."""
    return hooks_model


@pytest.fixture(scope="module")
def lens_ig(sdpa_model):
    return qgraph.instrument(sdpa_model)


def hf_lens(model, ids) -> torch.Tensor:
    """``[batch, blocks, seq, vocab]``: lm_head(norm(h)) of each block's output h, read by forward hooks."""
    _, blocks = hooked_blocks(model, ids, {i: lambda out: out for i in range(BLOCKS)})
    with torch.no_grad():
        return torch.stack([model.lm_head(model.model.norm(blocks[i])).float() for i in range(BLOCKS)], dim=1)


def test_the_grid_is_every_block_at_every_position_as_hf_computes_it(lens_ig, fresh):
    ids = random_ids(2, 9, seed=31)
    lens = lens_ig.logit_lens(ids, top=4, logits=True)  # positions="all": the default
    want = hf_lens(fresh, ids)
    assert lens.positions == list(range(9)) and lens.top_ids.shape == lens.top_probs.shape == (2, BLOCKS, 9, 4)
    assert lens.logits.shape == want.shape == (2, BLOCKS, 9, fresh.config.vocab_size)
    assert lens.logits.dtype == torch.float32
    torch.testing.assert_close(lens.logits, want, rtol=1e-5, atol=1e-5)
    best = want.softmax(-1).topk(4, dim=-1)
    assert torch.equal(lens.top_ids, best.indices)
    torch.testing.assert_close(lens.top_probs, best.values, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lens.probs, want.softmax(-1), rtol=1e-5, atol=1e-7)
    assert not torch.equal(lens.top_ids[:, 0], lens.top_ids[:, -1]) or not torch.equal(
        lens.top_ids[:, :, 0], lens.top_ids[:, :, -1])  # not one cell repeated
    for block in range(BLOCKS):  # the dict form, as it always was: {block: (ids, probabilities)} [batch, seq, top]
        assert torch.equal(lens[block][0], lens.top_ids[:, block]) and torch.equal(lens[block][1], lens.top_probs[:, block])
    for tensor in (lens.top_ids, lens.top_probs, lens.logits):
        assert not tensor.requires_grad


def test_positions_pick_columns_of_the_grid_and_logits_are_kept_only_when_asked(lens_ig):
    ids = random_ids(1, 7, seed=32)
    grid = lens_ig.logit_lens(ids, logits=True)
    some = lens_ig.logit_lens(ids, positions=[0, -1, 3], top=5)
    assert some.positions == [0, 6, 3] and some.top_ids.shape == (1, BLOCKS, 3, 5)
    assert torch.equal(some.top_ids, grid.top_ids[:, :, [0, 6, 3]])
    torch.testing.assert_close(some.top_probs, grid.top_probs[:, :, [0, 6, 3]], rtol=1e-5, atol=1e-7)
    assert torch.equal(lens_ig.logit_lens(ids, positions=-1).top_ids, grid.top_ids[:, :, [6]])
    with pytest.raises(qgraph.NotCaptured, match=r"logits=True"):
        some.logits
    with pytest.raises(qgraph.NotCaptured, match=r"logits=True"):
        some.probs
    assert repr(some) == "LogitLens(4 blocks x 3 positions, batch 1, top 5; .plot() draws it)"
    for bad in ("every", [], [7], [True], 1.5):
        with pytest.raises(qgraph.InvalidArgument, match=r'give "all", an int or a list of ints in \[-7, 7\)'):
            lens_ig.logit_lens(ids, positions=bad)
    with pytest.raises(qgraph.InvalidArgument, match="logits= is True"):
        lens_ig.logit_lens(ids, logits="yes")


def test_left_padding_reports_the_pads_and_moves_no_real_position(lens_ig):
    ids = random_ids(2, 10, seed=33)
    mask = torch.ones_like(ids)
    mask[0, :3], ids[0, :3] = 0, 256  # row 0: three pads on the left
    lens = lens_ig.logit_lens(ids, mask, logits=True)
    assert lens.positions == list(range(10)) and lens.top_ids.shape[2] == 10  # the pads are still reported
    assert torch.equal(lens.attention_mask, mask)
    for row, start in ((0, 3), (1, 0)):
        alone = lens_ig.logit_lens(ids[row:row + 1, start:], logits=True)
        assert torch.equal(lens.top_ids[row, :, start:], alone.top_ids[0])
        torch.testing.assert_close(lens.top_probs[row, :, start:], alone.top_probs[0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(lens.logits[row, :, start:], alone.logits[0], rtol=1e-4, atol=1e-4)
    figure = lens.plot(batch=0)  # the picture leaves the pads out
    assert figure.data["positions"] == list(range(3, 10)) and figure.data["ids"].shape == (BLOCKS, 7)
    assert torch.equal(figure.data["ids"], lens.top_ids[0, :, 3:, 0])
    with pytest.raises(qgraph.InvalidArgument, match="all padding"):
        lens_ig.logit_lens(ids, mask, positions=[0, 1]).plot(batch=0)

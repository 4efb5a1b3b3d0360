"""Patching sweeps (``qgraph.patch`` with ``positions=`` / ``heads=``): each location's metric equals a
full forward with ``Replace`` at that location, though only the blocks after the cut run, and the
locations of a value run stacked along the batch."""
from __future__ import annotations

import pytest
import torch

import qgraph
from qgraph.distributed import blocks_of
from qgraph.distributed.split import split
from tests.conftest import random_ids

HEADS = "layers.3.self_attn.attention_premix"  # [batch seq num_heads head_dim]
PATTERN = "layers.3.self_attn.attention_probabilities"  # [batch num_heads query key]


def metric(logits):
    return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()


@pytest.fixture(scope="module")
def pair():
    clean, corrupt = random_ids(2, 7, seed=11), random_ids(2, 7, seed=12)
    mask = torch.ones_like(corrupt)
    mask[1, :2] = 0  # a left-padded row: the mask crosses the cuts too
    return {"input_ids": clean, "attention_mask": mask}, {"input_ids": corrupt, "attention_mask": mask}


def naive(ig, clean, corrupt, name, locations):
    """One full forward per location, with ``Replace`` of the clean value there."""
    captured = ig.variant([name])(**clean).values[name]
    patcher = ig.variant((), edits=[name])
    dims = [str(d) for d in patcher.catalogue[name].spec.dims]
    position_axis = next(dims.index(d) for d in ("seq", "query") if d in dims)
    scores = []
    with torch.no_grad():
        for position, head in locations:
            region = captured.narrow(position_axis, position, 1)
            heads = {}
            if head is not None:
                region, heads = region.narrow(dims.index("num_heads"), head, 1), {"heads": [head]}
            edit = qgraph.Replace(region, positions=[position], **heads)
            scores.append(metric(patcher(**corrupt, edits={name: edit}).logits).item())
    return torch.tensor(scores)


def test_each_position_equals_a_forward_per_location(sdpa_model, pair):
    clean, corrupt = pair
    ig = qgraph.instrument(sdpa_model)
    at = ["layers.0.layer_output", "layers.1.linear_attn.attention_output", "layers.3.self_attn.attention_output",
          "layers.3.layer_output"]
    swept = qgraph.patch(ig, clean, corrupt, at, metric, positions="each", batch_size=3)  # passes of 3, 3 and 1
    assert list(swept) == at and all(scores.shape == (7,) for scores in swept.values())
    for name in at[:3]:  # the first block, a DeltaNet block's mixer, the attention block's mixer
        scores = swept[name]
        expected = naive(ig, clean, corrupt, name, [(p, None) for p in range(7)])
        torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    # patching the last block's output at the last position gives the clean run's metric there
    assert swept["layers.3.layer_output"][-1].item() == pytest.approx(metric(ig(**clean).logits).item(), abs=1e-5)
    # the whole value, one pass per name, is the metric itself (any object): as before sweeps
    whole = qgraph.patch(ig, clean, corrupt, ["layers.2.layer_output"], lambda logits: logits)
    reference = ig.variant((), edits=["layers.2.layer_output"])(
        **corrupt, edits={"layers.2.layer_output": qgraph.Replace(ig.variant(["layers.2.layer_output"])(
            **clean).values["layers.2.layer_output"])}).logits
    torch.testing.assert_close(whole["layers.2.layer_output"], reference, atol=1e-6, rtol=0)


def test_each_head_and_listed_positions(sdpa_model, pair):
    clean, corrupt = pair
    ig = qgraph.instrument(sdpa_model)
    swept = qgraph.patch(ig, clean, corrupt, [HEADS], metric, positions=[0, -1], heads="each")[HEADS]
    assert swept.shape == (2, 4)  # positions, heads
    expected = naive(ig, clean, corrupt, HEADS, [(p, h) for p in (0, 6) for h in range(4)]).reshape(2, 4)
    torch.testing.assert_close(swept, expected, atol=1e-5, rtol=0)
    pattern = qgraph.patch(ig, clean, corrupt, [PATTERN], metric, positions=[-1], heads=[2, 0])[PATTERN]
    torch.testing.assert_close(pattern, naive(ig, clean, corrupt, PATTERN, [(6, 2), (6, 0)]).reshape(1, 2),
                               atol=1e-5, rtol=0)
    per_head = qgraph.patch(ig, clean, corrupt, [HEADS], metric, heads=[1, 2])[HEADS]
    assert per_head.shape == (2,)


def test_attribution_takes_the_same_locations(sdpa_model, pair):
    """attribution_patch's estimates come in patch's shapes, and the per-location ones add up to the
    whole value's."""
    clean, corrupt = pair
    ig = qgraph.instrument(sdpa_model)
    each = qgraph.attribution_patch(ig, clean, corrupt, [HEADS, "layers.2.layer_output"], metric,
                                    positions="each")
    whole = qgraph.attribution_patch(ig, clean, corrupt, [HEADS, "layers.2.layer_output"], metric)
    grid = qgraph.attribution_patch(ig, clean, corrupt, [HEADS, PATTERN], metric, positions=[-1, 0], heads="each")
    assert each[HEADS].shape == (7,) and whole[HEADS].shape == () and grid[HEADS].shape == (2, 4)
    assert grid[PATTERN].shape == (2, 4)  # the pattern's heads come before its queries: reordered
    for name in each:
        torch.testing.assert_close(each[name].sum(), whole[name], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grid[HEADS].sum(-1), each[HEADS][[-1, 0]], atol=1e-5, rtol=1e-5)


def test_bad_locations_are_named(sdpa_model, pair):
    clean, corrupt = pair
    ig = qgraph.instrument(sdpa_model)
    with pytest.raises(qgraph.errors.InvalidArgument, match="'layers.1.layer_output': its layout .* has no"):
        qgraph.patch(ig, clean, corrupt, ["layers.1.layer_output"], metric, heads="each")
    with pytest.raises(qgraph.errors.InvalidArgument, match="give None .*\"each\" or a list"):
        qgraph.patch(ig, clean, corrupt, ["layers.1.layer_output"], metric, positions="all")
    with pytest.raises(qgraph.errors.InvalidArgument, match=r"\[9\] out of range for an axis of size 7"):
        qgraph.patch(ig, clean, corrupt, ["layers.1.layer_output"], metric, positions=[0, 9])
    with pytest.raises(qgraph.errors.InvalidType, match="must return a number or a one-element tensor"):
        qgraph.patch(ig, clean, corrupt, ["layers.1.layer_output"], lambda logits: logits, positions=[0])
    with pytest.raises(qgraph.errors.InvalidArgument, match="batch_size= takes a positive int"):
        qgraph.patch(ig, clean, corrupt, ["layers.1.layer_output"], metric, positions="each", batch_size=0)
    with pytest.raises(qgraph.errors.InvalidArgument, match="attribution_patch\\(heads='each'\\) at 'layers.1"):
        qgraph.attribution_patch(ig, clean, corrupt, ["layers.1.layer_output"], metric, heads="each")


def test_only_tensors_cross_the_cuts(sdpa_model):
    """The sizes of the program inputs are computed in every stage that reads them, so what a stage
    hands on is tensors only (what lets a sweep run later stages on a larger batch)."""
    ig = qgraph.instrument(sdpa_model, values=["layers.*.layer_output"])
    program = ig.program_for(False)
    plan = split(program.module, blocks_of(program.family), [1, 2, 3])
    handed = [node.meta["val"] for index, module in enumerate(plan.modules)
              for node, (kind, *_) in zip(module.graph.find_nodes(op="placeholder"), plan.inputs[index])
              if kind == "stage"]
    assert handed and all(isinstance(value, torch.Tensor) for value in handed)
    reads_sizes = [index for index, module in enumerate(plan.modules)
                   if any(node.target is torch.ops.aten.sym_size.int for node in module.graph.nodes)]
    assert len(reads_sizes) > 1  # computed again where read, not sent

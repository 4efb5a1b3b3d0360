"""Gradients of captured values (``values={name: {"grad": True}}``, ``out.grad``) and attribution patching (issue 12)."""
from __future__ import annotations

import pytest
import torch

import qgraph
from tests.conftest import random_ids

PREMIX = "layers.3.self_attn.attention_premix"


@pytest.fixture(scope="module")
def watched(sdpa_model):
    return qgraph.instrument(sdpa_model, values={"layers.2.layer_output": {"grad": True}, PREMIX: {"grad": True},
                                                 "layers.0.layer_input": {"grad": True},
                                                 "layers.1.linear_attn.decays": {"grad": True}})


def _loss(logits):
    return logits[:, -1, :7].square().sum() + logits[:, 2, 3].sum()


def _hf_grads(model, ids, mask):
    """The same loss through the plain HF model, with the tensors' grads read as hooks would."""
    seen = {}
    layers = model.model.layers
    handles = [
        layers[2].register_forward_hook(lambda m, a, o: seen.__setitem__("layer", o)),
        layers[3].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("premix", a[0])),
    ]
    try:
        embeds = model.model.embed_tokens(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeds, attention_mask=mask).logits
        for tensor in seen.values():
            tensor.retain_grad()
        _loss(logits).backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    return embeds.grad, seen["layer"].grad, seen["premix"].grad


@pytest.mark.compat
def test_value_gradients_equal_hf_autograd(watched, sdpa_model):
    ids = random_ids(2, 70, seed=11)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    out = watched(ids, attention_mask=mask)
    _loss(out.logits).backward()
    sdpa_model.zero_grad(set_to_none=True)
    embeds, layer, premix = _hf_grads(sdpa_model, ids, mask)
    assert torch.allclose(out.grad("layers.0.layer_input"), embeds, atol=1e-6, rtol=1e-4)
    assert torch.allclose(out.grad("layers[2].layer_output"), layer, atol=1e-6, rtol=1e-4)
    assert torch.allclose(out.grad(PREMIX), premix.unflatten(-1, (4, -1)), atol=1e-6, rtol=1e-4)
    assert out.grad("layers.1.linear_attn.decays").abs().sum() > 0


def test_gradients_without_backward_leave_the_parameters_alone(watched, sdpa_model):
    ids = random_ids(1, 9, seed=2)
    out = watched(ids)
    grads = out.gradients(_loss(out.logits))
    assert all(p.grad is None for p in sdpa_model.parameters())
    _loss(watched(ids).logits).backward()  # the same through backward
    sdpa_model.zero_grad(set_to_none=True)
    again = watched(ids)
    _loss(again.logits).backward()
    sdpa_model.zero_grad(set_to_none=True)
    for name, grad in grads.items():
        assert torch.allclose(grad, again.grad(name), atol=1e-7), name


def test_gradient_errors_say_what_to_do(watched, sdpa_model):
    ids = random_ids(1, 5, seed=3)
    with torch.no_grad():
        out = watched(ids)
    with pytest.raises(RuntimeError, match="no_grad"):
        out.grad("layers.2.layer_output")
    out = watched(ids)
    with pytest.raises(RuntimeError, match="call backward"):
        out.grad("layers.2.layer_output")
    with pytest.raises(KeyError, match="grad': True"):
        out.grad("layers.1.layer_output")
    with pytest.raises(ValueError, match="no gradient of its own"):
        qgraph.instrument(sdpa_model, values={"next_token_probs": {"grad": True}})


def test_attribution_patching_ranks_locations_as_patching_does(sdpa_model):
    """The first-order estimate of each location's patching effect has the sign and the ranking of the
    real effect on the locations that matter (the largest effects)."""
    clean = random_ids(1, 12, seed=4)
    corrupt = clean.clone()
    corrupt[0, 4] = (clean[0, 4] + 17) % 256  # one token differs
    target, foil = 5, 9

    def metric(logits):
        return logits[:, -1, target].sum() - logits[:, -1, foil].sum()

    at = ["layers.*.linear_attn.attention_output", "layers.3.self_attn.attention_output", "layers.*.mlp.mlp_output"]
    ig = qgraph.instrument(sdpa_model)
    with torch.no_grad():
        base = metric(ig(corrupt).logits).item()
        effects = {name: value - base for name, value in
                   qgraph.patch(ig, clean, corrupt, at=at, metric=lambda l: metric(l).item()).items()}
    estimates = qgraph.attribution_patch(ig, clean, corrupt, at=at, metric=metric, positions="each")
    assert all(p.grad is None for p in sdpa_model.parameters())
    assert estimates["layers.3.self_attn.attention_output"].shape == (12,)  # per position
    totals = {name: estimate.sum().item() for name, estimate in estimates.items()}
    assert set(totals) == set(effects)
    # positions before the changed token carry no difference: zero attribution
    assert all(estimate[:4].abs().max() == 0 for estimate in estimates.values())
    top = sorted(effects, key=lambda name: -abs(effects[name]))[:4]
    assert all((totals[name] > 0) == (effects[name] > 0) for name in top), (effects, totals)
    ranked = sorted(top, key=lambda name: -abs(totals[name]))
    assert ranked[0] == top[0], (effects, totals)


def test_attribution_per_head(sdpa_model):
    clean, corrupt = random_ids(2, 8, seed=6), random_ids(2, 8, seed=7)
    ig = qgraph.instrument(sdpa_model)
    estimates = qgraph.attribution_patch(ig, clean, corrupt, at=[PREMIX], metric=lambda l: l[:, -1, 1].sum(),
                                         positions="each", heads="each")
    assert estimates[PREMIX].shape == (8, 4)  # positions, heads
    assert estimates[PREMIX].abs().sum() > 0
    with pytest.raises(ValueError, match="scalar"):
        qgraph.attribution_patch(ig, clean, corrupt, at=[PREMIX], metric=lambda l: l[:, -1])

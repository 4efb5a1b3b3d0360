"""Edits rewired into the graph: kinds, selections, helpers, and their errors (issue 3)."""
from __future__ import annotations

import pytest
import torch

import qgraph
from conftest import hooked_blocks
from qgraph import Add, EditError, Replace, Scale, Zero

ATTN = "layers.3.self_attn"


def ids_of(batch, seq, seed):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def edited(eager_model):
    """One program with slots at every kind of value the tests edit."""
    return qgraph.instrument(
        eager_model,
        values=["layers.*.layer_output", "layers.*.layer_input", f"{ATTN}.*", "layers.0.linear_attn.*"],
        edits=["layers.*.layer_output", f"{ATTN}.attention_gate", f"{ATTN}.attention_head_outputs",
               f"{ATTN}.attention_probabilities", "layers.0.linear_attn.decays", "layers.0.linear_attn.betas",
               "layers.0.linear_attn.state_input", "layers.2.mlp.mlp_neurons", "layers.*.*.attention_output",
               "layers.*.mlp.mlp_output", "layers.1.mlp.down_proj.input"])


@pytest.fixture(scope="module")
def ids():
    return ids_of(2, 12, seed=7)


@pytest.fixture(scope="module")
def baseline(edited, ids):
    with torch.no_grad():
        return edited(ids)


def test_closed_gate_silences_the_attention(edited, ids, baseline):
    out = edited(ids, edits={f"{ATTN}.attention_gate": lambda gate: torch.full_like(gate, -1e4)})
    assert baseline[f"{ATTN}.attention_output"].abs().max() > 1e-3
    assert out[f"{ATTN}.attention_output"].abs().max() < 1e-12
    # what the gate edit leaves alone stays bitwise the same
    assert torch.equal(out[f"{ATTN}.attention_head_outputs"], baseline[f"{ATTN}.attention_head_outputs"])


def test_zeroing_one_head_changes_only_its_premix_slice(edited, ids, baseline):
    out = edited(ids, edits={f"{ATTN}.attention_head_outputs": Zero(heads=[2])})
    changed = (out[f"{ATTN}.attention_premix"] - baseline[f"{ATTN}.attention_premix"]).abs().amax(dim=(0, 1, 3))
    assert changed[2] > 0 and changed[[0, 1, 3]].eq(0).all()
    assert out[f"{ATTN}.attention_head_outputs"][:, :, 2].eq(0).all()  # captured as edited


@pytest.mark.compat
def test_steer_equals_adding_by_hand_and_moves_downstream(edited, eager_model, ids, baseline):
    vector = torch.randn(64, generator=torch.Generator().manual_seed(1))
    out = edited(ids, edits=qgraph.steer(1, vector, factor=2.0, positions=[3, -1]))
    expected = baseline["layers.1.layer_output"].clone()
    expected[:, [3, -1]] += 2.0 * vector
    assert torch.equal(out["layers.1.layer_output"], expected)
    assert not torch.allclose(out["layers.2.layer_output"], baseline["layers.2.layer_output"])

    def hook(module, args, output):
        output = output.clone()
        output[:, [3, -1]] += 2.0 * vector
        return output
    handle = eager_model.model.layers[1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            by_hook = eager_model(input_ids=ids).logits
    finally:
        handle.remove()
    torch.testing.assert_close(out.logits, by_hook, atol=1e-6, rtol=0)


@pytest.mark.compat
def test_skip_layers_passes_the_stream_through(edited, eager_model, ids, baseline):
    out = edited(ids, edits=qgraph.skip_layers(1, 2))
    assert torch.equal(out["layers.2.layer_output"], out["layers.1.layer_input"])
    assert torch.equal(out["layers.1.layer_input"], baseline["layers.1.layer_input"])
    # the logits follow: the last blocks read the skipped stream
    assert torch.equal(edited.project_on_vocab(out["layers.3.layer_output"]), out.logits)
    assert not torch.allclose(out.logits, baseline.logits)
    handles = [eager_model.model.layers[i].register_forward_hook(lambda m, a, k, o: a[0] if a else k["hidden_states"],
                                                                    with_kwargs=True) for i in (1, 2)]
    try:
        with torch.no_grad():
            by_hook = eager_model(input_ids=ids).logits
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(out.logits, by_hook, atol=1e-6, rtol=0)


def test_patching_the_last_block_reproduces_the_clean_logits(edited, ids):
    clean, corrupt = ids, ids_of(2, 12, seed=99)
    patched = qgraph.patch(edited, clean, corrupt, at=["layers.3.layer_output"], metric=lambda logits: logits)
    assert torch.equal(patched["layers.3.layer_output"], edited(clean).logits)
    assert qgraph.patch(edited, clean, corrupt, at=[], metric=lambda logits: logits) == {}
    assert torch.equal(edited(corrupt, edits={}).logits, edited(corrupt).logits)
    # every block's layer_output, one at a time: the earlier the splice, the more the corrupt tail moves it
    metric = lambda logits: logits[:, -1].sub(edited(clean).logits[:, -1]).abs().max().item()  # noqa: E731
    per_block = qgraph.patch(edited, clean, corrupt, at=["layers.*.layer_output"], metric=metric)
    assert list(per_block) == [f"layers.{i}.layer_output" for i in range(4)] and per_block["layers.3.layer_output"] == 0


def test_project_on_vocab_of_the_last_block_is_the_logits(edited, baseline):
    assert torch.equal(edited.project_on_vocab(baseline["layers.3.layer_output"]), baseline.logits)


def test_logit_lens_top_tokens_match_the_projection(edited, ids, baseline):
    lens = edited.logit_lens(ids, positions=[-1], top=3)
    probs = edited.project_on_vocab(baseline["layers.3.layer_output"][:, [-1]]).softmax(-1)
    assert torch.equal(lens[3][0], probs.topk(3, dim=-1).indices)


def test_logit_lens_results_are_detached_and_the_softmax_of_the_hf_blocks_outputs(edited, eager_model, ids):
    """Under grad mode (as a notebook runs it): ids and probabilities hold no autograd graph, and equal the
    softmax of the model's own norm and head on each block's output, as forward hooks see it."""
    assert torch.is_grad_enabled()
    lens = edited.logit_lens(ids, positions=[0, -1], top=4)
    _, blocks = hooked_blocks(eager_model, ids, {i: lambda out: out for i in range(4)})
    for block, (top_ids, probabilities) in lens.items():
        for tensor in (top_ids, probabilities):
            assert tensor.grad_fn is None and not tensor.requires_grad
        with torch.no_grad():
            logits = eager_model.lm_head(eager_model.model.norm(blocks[block][:, [0, -1]]))
        want = logits.float().softmax(-1).topk(4, dim=-1)
        assert torch.equal(top_ids, want.indices)
        torch.testing.assert_close(probabilities, want.values, rtol=1e-5, atol=1e-7)


def test_edits_do_not_leak_and_the_model_is_unchanged(edited, eager_model, ids, baseline):
    before = {name: tensor.clone() for name, tensor in eager_model.state_dict().items()}
    edited(ids, edits={"layers.0.layer_output": Scale(3.0), f"{ATTN}.attention_gate": Zero()})
    again = edited(ids)
    assert torch.equal(again.logits, baseline.logits)
    assert all(torch.equal(tensor, before[name]) for name, tensor in eager_model.state_dict().items())


def test_probabilities_decays_betas_and_state_input_are_editable(edited, ids, baseline):
    uniform = edited(ids, edits={f"{ATTN}.attention_probabilities": lambda p: torch.tril(torch.ones_like(p)) /
                                 torch.tril(torch.ones_like(p)).sum(-1, keepdim=True)})
    values = uniform[f"{ATTN}.attention_values"].repeat_interleave(2, dim=1)
    mean_of_past = values.cumsum(2) / torch.arange(1, 13).view(1, 1, -1, 1)
    torch.testing.assert_close(uniform[f"{ATTN}.attention_head_outputs"], mean_of_past.transpose(1, 2))

    delta = "layers.0.linear_attn"
    forget = edited(ids, edits={f"{delta}.decays": lambda g: torch.full_like(g, -1e4),
                                f"{delta}.betas": lambda b: torch.ones_like(b)})
    # forgetting everything and writing fully: the state after t holds only token t's key -> value
    keys = forget[f"{delta}.attention_keys"][:, -1].repeat_interleave(2, dim=1)
    k = keys * torch.rsqrt(keys.pow(2).sum(-1, keepdim=True) + 1e-6)  # the kernel's l2 norm
    v = forget[f"{delta}.attention_values"][:, -1]
    torch.testing.assert_close(forget[f"{delta}.state_output"], k.unsqueeze(-1) * v.unsqueeze(-2))

    state = torch.randn_like(baseline[f"{delta}.state_input"])
    carried = edited(ids, edits={f"{delta}.state_input": Replace(state)})
    assert torch.equal(carried[f"{delta}.state_input"], state)
    assert not torch.allclose(carried[f"{delta}.attention_head_outputs"], baseline[f"{delta}.attention_head_outputs"])
    same = edited(ids, edits={f"{delta}.state_input": Replace(torch.zeros_like(state))})
    assert torch.equal(same.logits, baseline.logits)


def test_selections_and_kinds(edited, ids, baseline):
    name = "layers.2.mlp.mlp_neurons"
    probe = qgraph.instrument(edited.model, values=[name], edits=[name])
    base = probe(ids)[name]
    out = probe(ids, edits={name: Zero(neurons=[0, 5], batch=[1], positions=[2])})[name]
    mask = torch.zeros_like(base, dtype=torch.bool)
    mask[1, 2, [0, 5]] = True
    assert out[mask].eq(0).all() and torch.equal(out[~mask], base[~mask])
    scaled = probe(ids, edits={name: Scale(0.5, positions=[-1])})[name]
    assert torch.equal(scaled[:, -1], base[:, -1] * 0.5) and torch.equal(scaled[:, :-1], base[:, :-1])
    replaced = probe(ids, edits={name: Replace(torch.ones(2, 1, 128), positions=[4])})[name]
    assert replaced[:, 4].eq(1).all()


def test_a_port_edit_reaches_only_its_module(edited, ids, baseline):
    out = edited(ids, edits={"layers.1.mlp.down_proj.input": Zero()})
    # down_proj sees zeros, so the MLP adds nothing; the stream before it is untouched
    assert out["layers.1.layer_output"].sub(out["layers.1.layer_input"]).abs().max() > 0
    assert torch.equal(out["layers.1.layer_input"], baseline["layers.1.layer_input"])


def test_baked_edits_equal_per_call_edits(eager_model, edited, ids):
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3))
    baked = qgraph.instrument(eager_model, values=["layers.2.layer_output"], edits=qgraph.steer(1, vector))
    per_call = edited(ids, edits=qgraph.steer(1, vector))
    assert torch.equal(baked(ids)["layers.2.layer_output"], per_call["layers.2.layer_output"])
    assert torch.equal(baked(ids).logits, per_call.logits)


def test_unused_slots_change_nothing(eager_model, edited, ids, baseline):
    plain = qgraph.instrument(eager_model, values=["layers.*.layer_output"])
    assert torch.equal(plain(ids).logits, baseline.logits)
    assert torch.equal(plain(ids)["layers.2.layer_output"], baseline["layers.2.layer_output"])


def test_bad_edits_say_what_is_wrong(edited, ids, baseline):
    with pytest.raises(EditError, match=r"layers\.1\.layer_output.*Residual \[batch seq hidden_size\].*\(2, 12, 64\)"):
        edited(ids, edits={"layers.1.layer_output": Add(torch.ones(5))})
    with pytest.raises(EditError, match="read-only"):
        qgraph.instrument(edited.model, edits=["next_token_probs"])
    with pytest.raises(EditError, match="read-only"):
        qgraph.instrument(edited.model, edits=["input_ids"])
    with pytest.raises(EditError, match=r"\[7\] out of range for its num_heads axis of size 4"):
        edited(ids, edits={f"{ATTN}.attention_head_outputs": Zero(heads=[7])})
    with pytest.raises(EditError, match="no num_heads"):
        edited(ids, edits={"layers.1.layer_output": Zero(heads=[0])})
    with pytest.raises(qgraph.UnknownValue, match="linear_attention"):
        qgraph.instrument(edited.model, edits=["layers.0.self_attn.attention_gate"])
    with pytest.raises(EditError, match="must return a tensor of the value's shape"):
        edited(ids, edits={"layers.1.layer_output": lambda x: x[:, :1]})
    with pytest.raises(EditError, match="read-only"):
        edited(ids, edits={"next_token_probs": Zero()})
    # a failed call leaves no edit behind
    with torch.no_grad():
        assert torch.equal(edited(ids).logits, baseline.logits)


# -- the helpers run under the instrument's own fixed edits ------------------------------------------
def _same(out):
    return out


def test_patch_and_logit_lens_run_under_the_fixed_edits(eager_model, ids):
    """An instrument with a fixed steering edit: patching and the logit lens see the steered model,
    as HF forward hooks that steer the same block do."""
    vector = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 4
    steered = qgraph.instrument(eager_model, edits=qgraph.steer([0, 2], vector))
    steer = {0: lambda out: out + vector, 2: lambda out: out + vector}
    clean, corrupt = ids, ids_of(2, 12, seed=11)
    _, clean_blocks = hooked_blocks(eager_model, clean, {**steer, 1: _same})
    reference, _ = hooked_blocks(eager_model, corrupt, {**steer, 1: lambda out: clean_blocks[1]})
    patched = qgraph.patch(steered, clean, corrupt, at=["layers.1.layer_output"], metric=lambda logits: logits)
    torch.testing.assert_close(patched["layers.1.layer_output"], reference, atol=1e-5, rtol=0)
    _, plain_blocks = hooked_blocks(eager_model, clean, {1: _same})
    plain, _ = hooked_blocks(eager_model, corrupt, {1: lambda out: plain_blocks[1]})
    assert not torch.allclose(reference, plain, atol=1e-3)  # the steering matters here

    lens = steered.logit_lens(clean, positions=[-1], top=3)
    _, blocks = hooked_blocks(eager_model, clean, {0: steer[0], 1: _same, 2: steer[2]})
    for block in (1, 2):
        want = steered.project_on_vocab(blocks[block][:, [-1]]).softmax(-1).topk(3, dim=-1).indices
        assert torch.equal(lens[block][0], want)


def test_attribution_patch_runs_under_the_fixed_edits(eager_model, ids):
    """The estimate's parts, (clean - corrupt) and the gradient, are the steered model's: HF autograd
    through a steering hook gives the same."""
    vector = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 4
    steered = qgraph.instrument(eager_model, edits=qgraph.steer(0, vector))
    clean, corrupt = ids, ids_of(2, 12, seed=12)
    metric = lambda logits: logits[:, -1, 3].sum()  # noqa: E731
    estimate = qgraph.attribution_patch(steered, clean, corrupt, at=["layers.2.layer_output"], metric=metric,
                                        positions="each")
    _, clean_blocks = hooked_blocks(eager_model, clean, {0: lambda out: out + vector, 2: _same})
    logits, seen = hooked_blocks(eager_model, corrupt, {0: lambda out: out + vector,
                                                        2: lambda out: out.detach().requires_grad_()}, grad=True)
    grad, = torch.autograd.grad(metric(logits), seen[2])
    want = ((clean_blocks[2] - seen[2].detach()) * grad).sum((0, -1))  # per position, over the batch and hidden
    torch.testing.assert_close(estimate["layers.2.layer_output"], want, atol=1e-5, rtol=1e-4)

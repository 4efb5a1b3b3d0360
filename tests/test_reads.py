"""Edits that read the forward (issue 55, part 1): ``qgraph.Read`` wherever an edit takes a tensor,
``qgraph.Edit(fn, reads=...)`` with the call's mask, and relative steering. Each is checked against the
plain HF forward with forward hooks that do the same by hand, and through every door and runner."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import qgraph
from conftest import random_ids

R1, R2, R3 = "layers.1.layer_output", "layers.2.layer_output", "layers.3.layer_output"


def block_out(output):
    return output[0] if isinstance(output, tuple) else output


def hooked(model, ids, mask=None, edits=None, grad=False):
    """The HF forward where ``edits[block](output, seen)`` replaces a block's output (``seen``: the outputs of
    the blocks before, as they left them): ``(logits, seen)``."""
    seen: dict[int, torch.Tensor] = {}

    def hook(module, args, output, i):
        out = block_out(output)
        if edits and i in edits:
            out = edits[i](out, seen)
        seen[i] = out
        return (out, *output[1:]) if isinstance(output, tuple) else out

    handles = [layer.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i))
               for i, layer in enumerate(model.model.layers)]
    try:
        with torch.set_grad_enabled(grad):
            mask = torch.ones_like(ids) if mask is None else mask
            return model(input_ids=ids, attention_mask=mask).logits, seen
    finally:
        for handle in handles:
            handle.remove()


@pytest.fixture(scope="module")
def ig(sdpa_model):
    return qgraph.instrument(sdpa_model, values=["layers.*.layer_output"])


def test_replace_and_add_read_another_block_as_hooks_that_copy_it(sdpa_model, ig):
    ids = random_ids(2, 7, seed=1)
    out = ig(ids, edits={R3: qgraph.Replace(qgraph.Read(R1))})

    def copy(x, seen):
        return seen[1]
    logits, _ = hooked(sdpa_model, ids, edits={3: copy})
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=1e-5)
    assert torch.equal(out[R3], out[R1])

    # the edit's region selects the read as it selects the value: position 2 of row 1 only
    out = ig(ids, edits={R3: qgraph.Add(qgraph.Read("blocks.1.hook_resid_post"), scale=0.5, positions=[2], batch=[1])})

    def add(x, seen):
        x = x.clone()
        x[1, 2] += 0.5 * seen[1][1, 2]
        return x
    logits, seen = hooked(sdpa_model, ids, edits={3: add})
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[R3], seen[3], rtol=0, atol=1e-6)
    plain = ig(ids)
    changed = (out[R3] != plain[R3]).any(-1)
    assert changed[1, 2] and changed.sum() == 1


def test_a_read_sees_its_value_as_edited_and_scale_reads_too(sdpa_model, ig):
    ids = random_ids(1, 6, seed=2)
    out = ig(ids, edits={R1: qgraph.Zero(positions=[0]), R3: qgraph.Scale(qgraph.Read(R1))})
    assert (out[R3][:, 0] == 0).all()  # times the zeroed position: the read is R1 as edited
    logits, _ = hooked(sdpa_model, ids, edits={1: lambda x, seen: x * torch.tensor([0.0, 1, 1, 1, 1, 1])[:, None],
                                               3: lambda x, seen: x * seen[1]})
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=1e-5)


def test_a_read_after_the_edit_and_a_read_of_many_values_are_refused(ig):
    ids = random_ids(1, 4)
    before = ig(ids)
    with pytest.raises(qgraph.EditError, match=r"reads 'layers.3.layer_output', which the forward computes after "
                                               r"'layers.1.layer_output'"):
        ig(ids, edits={R1: qgraph.Replace(qgraph.Read(R3))})
    with pytest.raises(qgraph.EditError, match="names 4 values"):
        ig(ids, edits={R3: qgraph.Replace(qgraph.Read("layers.*.layer_output"))})
    with pytest.raises(qgraph.EditError, match="computed after the run"):
        ig(ids, edits={R3: qgraph.Add(qgraph.Read("next_token_probs"))})
    with pytest.raises(qgraph.EditError, match=r"shape \(1, 4, 4, 4\).*broadcastable to \(1, 4, 64\)"):
        ig(ids, edits={R3: qgraph.Replace(qgraph.Read("layers.3.self_attn.attention_probabilities"))})
    with pytest.raises(qgraph.InvalidType, match="Read takes one value's name"):
        qgraph.Read(3)
    assert torch.equal(ig(ids).logits, before.logits)  # the failed builds left the instrument as it was


def test_a_function_edit_reads_values_and_the_mask_on_its_region(sdpa_model, ig):
    ids = random_ids(2, 6, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # row 0 left-padded
    seen_args = {}

    def fn(x, reads, m):
        seen_args.update(x=x.shape, reads={k: v.shape for k, v in reads.items()}, mask=m.clone())
        return x + 2.0 * reads["blocks.0.hook_resid_post"] * m[..., None]

    out = ig(ids, mask, edits={R2: qgraph.Edit(fn, reads=["blocks.0.hook_resid_post"], positions=[0, 1, 2])})
    assert seen_args["x"] == (2, 3, 64) and seen_args["reads"] == {"blocks.0.hook_resid_post": (2, 3, 64)}
    assert seen_args["mask"].tolist() == [[False, False, True], [True, True, True]]

    def by_hand(x, seen):
        x = x.clone()
        x[:, :3] += 2.0 * seen[0][:, :3] * mask[:, :3, None]
        return x
    logits, _ = hooked(sdpa_model, ids, mask, edits={2: by_hand})
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], logits[real], rtol=0, atol=1e-5)
    with pytest.raises(qgraph.EditError, match=r"returned \(2, 3\); it must return a tensor of the region's shape"):
        ig(ids, edits={R2: qgraph.Edit(lambda x, reads, m: x[..., 0], positions=[0, 1, 2])})
    with pytest.raises(qgraph.EditError, match="edited inside the delta rule's recurrence"):
        ig(ids, edits={"layers.0.linear_attn.write_values": qgraph.Edit(lambda x, r, m: x)})


def nnsight_steer(x, factor, v):
    """nnsight's inline relative steering: ``x + factor * x.norm(dim=-1, keepdim=True).mean() * v``."""
    return x + factor * x.norm(dim=-1, keepdim=True).mean() * v


def test_relative_steering_is_nnsights_inline_form_per_prompt(sdpa_model, ig):
    v = torch.randn(64, generator=torch.Generator().manual_seed(4))
    one = random_ids(1, 7, seed=5)
    out = ig(one, edits=qgraph.steer(2, v, 0.3, relative=True))
    logits, _ = hooked(sdpa_model, one, edits={2: lambda x, seen: nnsight_steer(x, 0.3, v)})
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=1e-5)

    # a batch with a left-padded row: each row as it runs alone (its mean is over its real tokens only)
    two = torch.cat([random_ids(1, 7, seed=6), one])
    mask = torch.ones_like(two)
    mask[0, :3] = 0
    batched = ig(two, mask, edits=qgraph.steer(2, v, 0.3, relative=True))
    alone = ig(two[:1, 3:], edits=qgraph.steer(2, v, 0.3, relative=True))
    torch.testing.assert_close(batched.logits[0, 3:], alone.logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(batched.logits[1], out.logits[0], rtol=0, atol=1e-5)
    with pytest.raises(qgraph.EditError, match="no \\[batch ... seq ...\\] layout"):
        ig(one, edits={"layers.0.linear_attn.state_input": qgraph.Add(torch.ones(()), relative=True)})


def test_gradients_flow_through_a_read_as_through_hooks(sdpa_model, ig):
    ids = random_ids(1, 6, seed=7)
    loss = lambda logits: logits[:, -1].logsumexp(-1).sum()  # noqa: E731
    sdpa_model.zero_grad(set_to_none=True)  # what an earlier test left on the session model
    ig(ids, edits={R3: qgraph.Add(qgraph.Read(R1), scale=0.5)}, loss=loss)
    got = {name: p.grad.clone() for name, p in sdpa_model.named_parameters() if p.grad is not None}
    sdpa_model.zero_grad(set_to_none=True)
    logits, _ = hooked(sdpa_model, ids, edits={3: lambda x, seen: x + 0.5 * seen[1]}, grad=True)
    loss(logits).backward()
    expected = {name: p.grad.clone() for name, p in sdpa_model.named_parameters() if p.grad is not None}
    sdpa_model.zero_grad(set_to_none=True)
    assert set(got) == set(expected) and len(expected) > 40
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # it compiles with inductor: the slow tier
def test_fixed_reads_are_traced_saved_and_compiled(sdpa_model, ig, tmp_path):
    v = torch.randn(64, generator=torch.Generator().manual_seed(8))
    fixed = {R3: qgraph.Add(qgraph.Read(R1), scale=0.5), R2: qgraph.Add(v, scale=0.2, relative=True)}
    eager = qgraph.instrument(sdpa_model, values=[R3], edits=fixed)
    ids = random_ids(2, 6, seed=9)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    expected = eager(ids, mask)
    logits, _ = hooked(sdpa_model, ids[:1], edits={2: lambda x, seen: nnsight_steer(x, 0.2, v),
                                                   3: lambda x, seen: x + 0.5 * seen[1]})
    torch.testing.assert_close(expected.logits[:1], logits, rtol=0, atol=1e-5)
    # saved with its reads traced in: the loaded program computes the same, padding included
    loaded = qgraph.load(eager.save(tmp_path / "reads.qgraph", weights=True))
    torch.testing.assert_close(loaded(ids, mask).logits, expected.logits, rtol=0, atol=1e-5)
    with pytest.raises(qgraph.EditError, match="a loaded program's slots read only their own value"):
        qgraph.load(qgraph.instrument(sdpa_model, edits=[R3]).save(tmp_path / "slot.qgraph", weights=True))(
            ids, edits={R3: qgraph.Replace(qgraph.Read(R1))})
    # compiled: the fixed edits and their reads captured in the graphs of the program's regions (dynamo's capture
    # with fullgraph=True, run without a backend compiler, as test_compile's slots are: the capture is where a
    # read could break the graph; a read of block 1 crosses into block 3's region), a new length served by the
    # same graphs: one per group of alike regions
    compiled = qgraph.instrument(sdpa_model, values=[R3], edits=fixed, compile={"backend": "eager"})
    groups = len(compiled.program_for(False).runner.compiled.regions.modules)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, mask).logits, expected.logits, rtol=1e-5, atol=1e-5)
        longer = random_ids(2, 9, seed=10)
        torch.testing.assert_close(compiled(longer).logits, eager(longer).logits, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs == groups


def test_relative_steering_while_generating_is_the_hooked_hf_generate(sdpa_model, ig):
    v = torch.randn(64, generator=torch.Generator().manual_seed(11))
    ids = random_ids(1, 5, seed=12)
    got = ig.generate(ids, max_new_tokens=4, edits=qgraph.steer(2, v, 2.0, relative=True),
                      values=[]).sequences
    handle = sdpa_model.model.layers[2].register_forward_hook(
        lambda m, a, o: (nnsight_steer(block_out(o), 2.0, v), *o[1:]) if isinstance(o, tuple)
        else nnsight_steer(o, 2.0, v))
    try:
        with torch.no_grad():
            expected = sdpa_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                           do_sample=False, min_new_tokens=4)
    finally:
        handle.remove()
    assert torch.equal(got, expected)
    assert not torch.equal(got, ig.generate(ids, max_new_tokens=4, values=[]).sequences)


def test_reads_travel_to_a_server_as_data(sdpa_model, remote, ig):
    v = torch.randn(64, generator=torch.Generator().manual_seed(13))
    far = remote.instrument(["layers.*.layer_output"])
    edits = {R3: qgraph.Add(qgraph.Read("blocks.1.hook_resid_post"), scale=0.5, positions=[1]),
             R2: qgraph.Add(v, scale=0.3, relative=True)}
    for seq, seed in ((6, 14), (4, 15)):
        ids = random_ids(1, seq, seed=seed)
        expected = ig(ids, edits=edits)
        got = far(ids, edits=edits)
        torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(got[R3], expected[R3], rtol=0, atol=1e-5)
    with pytest.raises(qgraph.EditError, match="cannot travel to a server"):
        far(random_ids(1, 4), edits={R2: qgraph.Edit(lambda x, r, m: x)})

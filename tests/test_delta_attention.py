"""The DeltaNet read as attention and its writes (issue 39): effective_attention, initial_state_output
and write_values against a float64 recurrence written here from the kernel's own inputs, the
identity head_outputs = A @ values + initial_state_output, and edits of the writes against the HF
kernel with a write edited by hand."""
from __future__ import annotations

import pytest
import torch

import qgraph
from qgraph.errors import EditError, InvalidArgument, NotSupported

from conftest import random_ids

P = "layers.{}.linear_attn"
DELTA = (0, 1, 2)
READS = ("effective_attention", "initial_state_output", "write_values")
INPUTS = ("attention_queries", "attention_keys", "attention_values", "decays", "betas", "state_input")


def names(*parts, blocks=DELTA):
    return [f"{P.format(i)}.{part}" for i in blocks for part in parts]


def reference(q, k, v, g, beta, state):
    """``(A, initial_state_output, writes)`` by the token-by-token recurrence in float64: A[t, s] =
    beta_s k_s^T M_{s+1}..M_t q_t, built backwards from q_t, and d_t = beta_t (v_t - (exp(g_t) S)^T k_t)."""
    q, k, v, g, beta, state = (x.double() for x in (q, k, v, g, beta, state))
    groups = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(groups, 2), k.repeat_interleave(groups, 2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    batch, seq, heads, _ = q.shape
    attention = torch.zeros(batch, heads, seq, seq, dtype=torch.float64)
    initial = torch.zeros(batch, seq, heads, v.shape[-1], dtype=torch.float64)
    for t in range(seq):
        read = q[:, t]  # M_{s+1} .. M_t q_t, one s at a time
        for s in range(t, -1, -1):
            attention[:, :, t, s] = beta[:, s] * (k[:, s] * read).sum(-1)
            read = g[:, s].exp()[..., None] * (read - beta[:, s, :, None] * k[:, s] * (k[:, s] * read).sum(-1, keepdim=True))
        initial[:, t] = torch.einsum("bhkd,bhk->bhd", state, read)
    writes, now = [], state.clone()
    for t in range(seq):
        now = now * g[:, t].exp()[..., None, None]
        write = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkd,bhk->bhd", now, k[:, t]))
        now = now + k[:, t, ..., None] * write[..., None, :]
        writes.append(write)
    return attention, initial, torch.stack(writes, 1)


@pytest.fixture(scope="module")
def reads(sdpa_model):
    return qgraph.instrument(sdpa_model, values=names(*READS, *INPUTS, "attention_head_outputs"))


def _recorded(monkeypatch, model, replace=None):
    """Record the HF delta-rule kernel's inputs in call order (as the module's function and, where a
    transformers release binds it on each DeltaNet at init, as that attribute); ``replace`` (a function
    of the call's index and inputs) computes a call instead of the kernel when it returns a result."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen
    kernel, calls = qwen.torch_chunk_gated_delta_rule, []

    def recording(q, k, v, g=None, beta=None, initial_state=None, **kwargs):
        calls.append((q, k, v, g, beta, initial_state))
        done = replace(len(calls) - 1, q, k, v, g, beta, initial_state) if replace else None
        return done if done is not None else kernel(q, k, v, g=g, beta=beta, initial_state=initial_state, **kwargs)

    monkeypatch.setattr(qwen, "torch_chunk_gated_delta_rule", recording)
    for module in model.modules():
        if getattr(module, "chunk_gated_delta_rule", None) is kernel:
            monkeypatch.setattr(module, "chunk_gated_delta_rule", recording)
    return calls


def test_the_values_are_the_kernels_inputs(sdpa_model, reads, monkeypatch):
    """What the reference below reads (qgraph's queries, keys, ... values) is what HF's kernel is called with."""
    ids = random_ids(2, 40, seed=3)
    out = reads(ids)
    calls = _recorded(monkeypatch, sdpa_model)
    with torch.no_grad():
        sdpa_model(input_ids=ids)
    for block, call in zip(DELTA, calls):
        for name, given in zip(INPUTS[:5], call[:5]):
            ours = out[f"{P.format(block)}.{name}"]
            if ours.shape != given.shape:  # releases before 5.23 repeat q and k to the value heads before the kernel
                ours = ours.repeat_interleave(given.shape[2] // ours.shape[2], dim=2)
            torch.testing.assert_close(ours, given, rtol=1e-5, atol=1e-8)  # (5.9: rounding of the exported ops)


@pytest.mark.parametrize("with_state", [False, True])
def test_reads_equal_a_float64_recurrence(sdpa_model, with_state):
    ids = random_ids(2, 70, seed=5)  # past one 64-token chunk
    edits = {}
    if with_state:  # a state entering every block (state_input is what the kernel starts from)
        shape = (2, 4, 16, 16)
        edits = {name: qgraph.Replace(torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.3)
                 for name in names("state_input")}
    out = qgraph.instrument(sdpa_model, values=names(*READS, *INPUTS), edits=edits)(ids)
    for block in DELTA:
        prefix = P.format(block)
        attention, initial, writes = reference(*(out[f"{prefix}.{name}"] for name in INPUTS))
        got = out[f"{prefix}.effective_attention"]
        assert got.dtype == torch.float32 and out[f"{prefix}.write_values"].dtype == torch.float32
        torch.testing.assert_close(got.double(), attention, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(out[f"{prefix}.initial_state_output"].double(), initial, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(out[f"{prefix}.write_values"].double(), writes, rtol=1e-4, atol=1e-6)
        assert torch.equal(got.triu(1), torch.zeros_like(got))  # causal, exactly
        assert bool(initial.abs().max() > 1e-3) is with_state


def _identity_error(out, block):
    prefix = P.format(block)
    attention, values = out[f"{prefix}.effective_attention"], out[f"{prefix}.attention_values"]
    rebuilt = torch.einsum("bhts,bshd->bthd", attention, values.float()) + out[f"{prefix}.initial_state_output"]
    outputs = out[f"{prefix}.attention_head_outputs"].float()
    return (rebuilt - outputs).abs().max() / outputs.abs().max()


def test_identity_holds_in_every_block(reads):
    out = reads(random_ids(2, 130, seed=9))
    errors = [_identity_error(out, block) for block in DELTA]
    assert max(errors) < 1e-5, errors


def test_padding_zeroes_rows_and_columns(reads, sdpa_model):
    """Left padding: q, k and v are zero there, so A is zero in those rows and columns; a given
    initial state decays through the padding (g and beta are not masked) before the first real token."""
    ids, mask = random_ids(2, 30, seed=2), torch.ones(2, 30, dtype=torch.long)
    mask[0, :6] = 0
    out = reads(ids, mask)
    for block in DELTA:
        attention = out[f"{P.format(block)}.effective_attention"]
        assert attention[0, :, :6].abs().max() == 0 and attention[0, :, :, :6].abs().max() == 0
        assert attention[1, :, :6, :6].abs().max() > 0
        assert _identity_error(out, block) < 1e-5
    state = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    edited = qgraph.instrument(sdpa_model, values=names(*READS, *INPUTS, blocks=(0,)),
                               edits={f"{P.format(0)}.state_input": qgraph.Replace(state)})(ids, mask)
    attention, initial, _ = reference(*(edited[f"{P.format(0)}.{name}"] for name in INPUTS))
    torch.testing.assert_close(edited[f"{P.format(0)}.initial_state_output"].double(), initial, rtol=1e-4, atol=1e-6)
    assert initial[0, :6].abs().max() == 0  # q is zero there: nothing is read while the state decays
    decay = edited[f"{P.format(0)}.decays"][0, :6].double().sum(0).exp()  # [heads]
    assert decay.max() < 1  # and the state the first real token reads has decayed through the padding


def test_bf16_identity_to_the_models_dtype(sdpa_model):
    import copy
    model = copy.deepcopy(sdpa_model).to(torch.bfloat16)
    out = qgraph.instrument(model, values=names("effective_attention", "initial_state_output", "attention_values",
                                                "attention_head_outputs"))(random_ids(1, 40, seed=4))
    assert out[f"{P.format(0)}.effective_attention"].dtype == torch.float32
    assert max(_identity_error(out, block) for block in DELTA) < 2e-2  # bf16 outputs: 8 bits of mantissa


def _edited_kernel(block, edit):
    """A kernel for the HF forward that runs the DeltaNet of ``block`` token by token in float64 with
    ``edit(t, write)`` applied to each write (the recurrence continued from the edited state)."""
    def replace(index, q, k, v, g, beta, initial_state):
        if index != block:
            return None
        groups = v.shape[2] // k.shape[2]
        qd, kd = (x.double().repeat_interleave(groups, 2) for x in (q, k))
        qd = qd * torch.rsqrt((qd * qd).sum(-1, keepdim=True) + 1e-6) * qd.shape[-1] ** -0.5
        kd = kd * torch.rsqrt((kd * kd).sum(-1, keepdim=True) + 1e-6)
        state = torch.zeros(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1], dtype=torch.float64)
        outputs = []
        for t in range(v.shape[1]):
            state = state * g[:, t].double().exp()[..., None, None]
            write = beta[:, t, :, None].double() * (v[:, t].double() - torch.einsum("bhkd,bhk->bhd", state, kd[:, t]))
            state = state + kd[:, t, ..., None] * edit(t, write)[..., None, :]
            outputs.append(torch.einsum("bhkd,bhk->bhd", state, qd[:, t]))
        return torch.stack(outputs, 1).to(v.dtype), state.float()
    return replace


U = torch.randn(16, generator=torch.Generator().manual_seed(3))
EDITS = {
    "replace": (qgraph.Replace(U, positions=[3, 40], heads=[1]), lambda t, w: _at(t, w, [3, 40], [1], lambda x: U.double())),
    "add": (qgraph.Add(U, positions=[5], heads=[0, 2], scale=0.5), lambda t, w: _at(t, w, [5], [0, 2], lambda x: x + 0.5 * U.double())),
    "scale": (qgraph.Scale(3.0, positions=[0, 10, 11]), lambda t, w: _at(t, w, [0, 10, 11], [0, 1, 2, 3], lambda x: 3 * x)),
    "zero": (qgraph.Zero(heads=[3]), lambda t, w: _at(t, w, range(45), [3], lambda x: 0 * x)),
}


def _at(t, write, positions, heads, change):
    if t not in positions:
        return write
    write = write.clone()
    write[:, heads] = change(write[:, heads])
    return write


@pytest.mark.parametrize("kind", EDITS)
def test_write_edit_equals_hf_kernel_edited_by_hand(sdpa_model, monkeypatch, kind):
    edit, by_hand = EDITS[kind]
    ids = random_ids(2, 45, seed=8)
    ig = qgraph.instrument(sdpa_model, values=names("write_values", blocks=(0,)), edits=names("write_values", blocks=(0,)))
    out = ig(ids, edits={f"{P.format(0)}.write_values": edit})
    plain = ig(ids)
    _recorded(monkeypatch, sdpa_model, replace=_edited_kernel(0, by_hand))
    with torch.no_grad():
        expected = sdpa_model(input_ids=ids).logits
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-5)
    assert (out.logits - plain.logits).abs().max() > 1e-3  # the edit moves the logits
    if kind == "replace":  # the write is exactly the vector given
        assert torch.equal(out[f"{P.format(0)}.write_values"][:, 40, 1], U.expand(2, -1))


def test_zero_write_is_zero_beta(reads):
    ids = random_ids(2, 30, seed=6)
    ig = qgraph.instrument(reads.model, values=["logits"])
    zero_write = ig(ids, edits={f"{P.format(1)}.write_values": qgraph.Zero(positions=[4], heads=[2])})
    zero_beta = ig(ids, edits={f"{P.format(1)}.betas": qgraph.Zero(positions=[4], heads=[2])})
    torch.testing.assert_close(zero_write.logits, zero_beta.logits, rtol=0, atol=1e-6)
    assert (zero_write.logits - ig(ids).logits).abs().max() > 1e-4


def test_write_gradient_equals_hf_autograd(sdpa_model, monkeypatch):
    """d loss / d write_t, the later writes recomputed as the model would: HF's kernel with a zero
    added to every write, differentiated by autograd."""
    ids = random_ids(1, 20, seed=1)
    name = f"{P.format(0)}.write_values"
    out = qgraph.instrument(sdpa_model, values={name: {"grad": True}})(ids, loss=lambda logits: logits[0, -1, 7])
    zero = torch.zeros(1, 20, 4, 16, dtype=torch.float64, requires_grad=True)
    _recorded(monkeypatch, sdpa_model, replace=_edited_kernel(0, lambda t, w: w + zero[:, t]))
    sdpa_model(input_ids=ids).logits[0, -1, 7].backward()
    torch.testing.assert_close(out.grad(name).double(), zero.grad, rtol=1e-3, atol=1e-7)
    assert zero.grad.abs().max() > 0


def test_refusals(sdpa_model, reads, tmp_path):
    ids = random_ids(1, 10)
    name = f"{P.format(0)}.write_values"
    with pytest.raises(EditError, match="function edit"):
        reads(ids, edits={name: lambda x: 2 * x})
    with pytest.raises(EditError, match="differs along value_dim"):
        reads(ids, edits={name: qgraph.Scale(torch.arange(16.0))})
    with pytest.raises(InvalidArgument, match="states or its writes"):
        qgraph.instrument(sdpa_model, values=[name, f"{P.format(0)}.states"])
    with pytest.raises(EditError, match="read-only"):
        reads(ids, edits={f"{P.format(0)}.initial_state_output": qgraph.Zero()})
    with pytest.raises(NotSupported, match="inside the delta rule"):
        qgraph.instrument(sdpa_model, values=["logits"], edits=[name]).save(tmp_path / "w.qgraph")


def test_by_name_and_the_transformerlens_alias(reads):
    assert reads.resolve("blocks.0.attn.hook_pattern") == [f"{P.format(0)}.effective_attention"]
    assert reads.resolve("blocks.3.attn.hook_pattern") == ["layers.3.self_attn.attention_probabilities"]
    every = reads.resolve("layers.0.linear_attn.*")
    assert not set(every) & set(names(*READS, blocks=(0,)))  # asked for by name (or a glob ending in it) only
    assert reads.resolve("layers.*.linear_attn.write_values") == names("write_values")


def test_saved_program_reads_effective_attention(reads, tmp_path):
    ids = random_ids(2, 20, seed=4)
    path = tmp_path / "reads.qgraph"
    reads.save(path)
    loaded = qgraph.load(path, reads.model)
    got, expected = loaded(ids), reads(ids)
    for name in names("effective_attention", "write_values"):
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


def test_attention_edit_equals_hf_kernel_reading_the_edited_pattern(sdpa_model, monkeypatch):
    """An edit of effective_attention makes the block read A' @ values + initial_state_output: HF's
    kernel replaced by the float64 reference's A, edited the same way, times the values."""
    ids = random_ids(2, 24, seed=12)
    name = f"{P.format(1)}.effective_attention"
    ig = qgraph.instrument(sdpa_model, values=[name, f"{P.format(1)}.attention_head_outputs"])
    plain, out = ig(ids), ig(ids, edits={name: qgraph.Zero(positions=[5, 20], heads=[0, 3])})
    assert torch.equal(plain.logits, qgraph.instrument(sdpa_model, values=["logits"])(ids).logits)  # unedited: exact

    def replace(index, q, k, v, g, beta, initial_state):
        if index != 1:
            return None
        attention, _, _ = reference(q, k, v, g, beta, torch.zeros(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1]))
        attention[:, [0, 3], 5] = 0
        attention[:, [0, 3], 20] = 0
        state = torch.zeros(v.shape[0], v.shape[2], k.shape[-1], v.shape[-1])  # (not read: no cache)
        return torch.einsum("bhts,bshd->bthd", attention, v.double()).to(v.dtype), state

    _recorded(monkeypatch, sdpa_model, replace=replace)
    with torch.no_grad():
        expected = sdpa_model(input_ids=ids).logits
    torch.testing.assert_close(out.logits, expected, rtol=1e-4, atol=1e-5)
    assert (out.logits - plain.logits).abs().max() > 1e-3
    assert out[name][:, [0, 3], 20].abs().max() == 0  # the value is captured as edited


def test_attention_gradient_and_the_models_unchanged(sdpa_model):
    ids = random_ids(1, 16, seed=2)
    prefix = P.format(0)
    loss = lambda logits: logits[0, -1, 3]  # noqa: E731
    asked = {f"{prefix}.effective_attention": {"grad": True}, f"{prefix}.attention_head_outputs": {"grad": True},
             f"{prefix}.attention_values": {}, "token_embeddings": {"grad": True}}
    out = qgraph.instrument(sdpa_model, values=asked)(ids, loss=loss)
    plain = qgraph.instrument(sdpa_model, values={"token_embeddings": {"grad": True}})(ids, loss=loss)
    values, outputs = out[f"{prefix}.attention_values"].float(), out.grad(f"{prefix}.attention_head_outputs")
    torch.testing.assert_close(out.grad(f"{prefix}.effective_attention"),
                               torch.einsum("bthd,bshd->bhts", outputs.float(), values), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(out.grad("token_embeddings"), plain.grad("token_embeddings"), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("value", ["effective_attention", "write_values"])
def test_patch_each_head_and_attribution_patch(sdpa_model, value):
    clean, corrupt = random_ids(1, 12, seed=1), random_ids(1, 12, seed=2)
    name = f"{P.format(0)}.{value}"
    ig = qgraph.instrument(sdpa_model, values=["logits"])
    metric = lambda logits: float(logits[0, -1, 5] - logits[0, -1, 9])  # noqa: E731
    swept = qgraph.patch(ig, clean, corrupt, name, metric, heads="each")[name]
    captured = qgraph.instrument(sdpa_model, values=[name])(clean)[name]
    axis = 1 if value == "effective_attention" else 2
    by_hand = torch.tensor([metric(ig(corrupt, edits={name: qgraph.Replace(captured.select(axis, h).unsqueeze(axis),
                                                                            heads=[h])}).logits) for h in range(4)])
    torch.testing.assert_close(swept, by_hand, rtol=1e-4, atol=1e-5)
    assert (swept - metric(ig(corrupt).logits)).abs().max() > 1e-5  # patching a head moves the metric
    scores = qgraph.attribution_patch(ig, clean, corrupt, name, lambda logits: logits[0, -1, 5] - logits[0, -1, 9],
                                      heads="each")[name]
    assert scores.shape == (4,) and torch.isfinite(scores).all() and scores.abs().max() > 0


def test_plot_and_explore_show_the_effective_attention(reads):
    ids = random_ids(1, 12, seed=3)
    out = reads(ids)
    name = f"{P.format(2)}.effective_attention"
    figure = out.plot(name, heads=[1, 3])
    shown, attention = figure.data["pattern"], out[name][0, [1, 3]].detach()
    lower = torch.ones(12, 12, dtype=torch.bool).tril()
    torch.testing.assert_close(shown[:, lower], attention[:, lower])
    assert torch.isnan(shown[:, ~lower]).all()  # the future is blank, not a zero of the colour scale
    page = qgraph.explore(reads, out)._repr_html_()
    assert name in page and page.count(f'data-value="{name}"') >= 1


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_the_other_families_read_as_attention(sparse_model, family):
    """The MoE and Qwen3-Next families' own rules: the reads equal the float64 recurrence, the identity holds."""
    model = sparse_model(family)
    blocks = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    ig = qgraph.instrument(model, values=names(*READS, *INPUTS, "attention_head_outputs", blocks=blocks))
    out = ig(random_ids(2, 24, seed=4) % model.config.vocab_size)
    for block in blocks:
        prefix = P.format(block)
        attention, initial, writes = reference(*(out[f"{prefix}.{name}"] for name in INPUTS))
        torch.testing.assert_close(out[f"{prefix}.effective_attention"].double(), attention, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(out[f"{prefix}.write_values"].double(), writes, rtol=1e-4, atol=1e-6)
        assert _identity_error(out, block) < 1e-5

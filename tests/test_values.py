"""The captured values, checked against the model's own arithmetic and against plain HF forwards."""
from __future__ import annotations

import inspect

import pytest
import torch

import qgraph

from conftest import hf_logits, random_ids

BLOCKS = range(4)
MIXER = {0: "linear_attn", 1: "linear_attn", 2: "linear_attn", 3: "self_attn"}
HEADS, KV_HEADS, HEAD_DIM, ROTARY = 4, 2, 32, 8  # the tiny model: partial rotary 0.25 of 32
K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 16  # its DeltaNet


# -- the residual stream ---------------------------------------------------------------------------
@pytest.mark.parametrize("block", BLOCKS)
def test_block_identities(out, block):
    layer, mixer = f"layers.{block}", f"layers.{block}.{MIXER[block]}"
    layer_input, attention_output = out[f"{layer}.layer_input"], out[f"{mixer}.attention_output"]
    mlp_output = out[f"{layer}.mlp.mlp_output"]
    assert torch.equal(layer_input + attention_output + mlp_output, out[f"{layer}.layer_output"])
    assert torch.equal(out[f"{layer}.layer_mid"], layer_input + attention_output)
    assert torch.equal(out[f"{layer}.mlp_input"], out[f"{layer}.mlp_norm_output"])
    # the mixer reads the normed stream, and every term is non-trivial
    assert torch.equal(out[f"{mixer}.input"], out[f"{layer}.attention_norm_output"])
    assert not torch.allclose(out[f"{layer}.attention_norm_output"], layer_input)
    assert attention_output.abs().amax() > 0 and mlp_output.abs().amax() > 0


def test_stream_is_chained(out, sdpa_model):
    assert torch.equal(out["token_embeddings"], out["layers.0.layer_input"])
    assert torch.equal(out["token_embeddings"], sdpa_model.model.embed_tokens.weight[out["input_ids"]])
    for block in range(3):
        assert torch.equal(out[f"layers.{block}.layer_output"], out[f"layers.{block + 1}.layer_input"])
    assert torch.equal(out["layers.3.layer_output"], out["norm.input"])


@pytest.mark.parametrize("block", BLOCKS)
def test_mlp_values(out, block):
    mlp = f"layers.{block}.mlp"
    gate, up = out[f"{mlp}.gate_proj.output"], out[f"{mlp}.up_proj.output"]
    torch.testing.assert_close(out[f"{mlp}.mlp_activation"], torch.nn.functional.silu(gate), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[f"{mlp}.mlp_neurons"], out[f"{mlp}.mlp_activation"] * up, rtol=0, atol=1e-6)
    assert torch.equal(out[f"{mlp}.mlp_output"], out[f"{mlp}.down_proj.output"])


# -- the gated attention -------------------------------------------------------------------------------
def test_attention_gate(out):
    attn = "layers.3.self_attn"
    gate, heads = out[f"{attn}.attention_gate"], out[f"{attn}.attention_head_outputs"]
    torch.testing.assert_close(out[f"{attn}.o_proj.input"], (heads * torch.sigmoid(gate)).flatten(2),
                               rtol=0, atol=1e-6)
    # without the gate it is not what o_proj reads
    assert not torch.allclose(out[f"{attn}.o_proj.input"], heads.flatten(2), atol=1e-3)
    # the gate is each head's second half of q_proj's output
    halves = out[f"{attn}.q_proj.output"].unflatten(-1, (HEADS, 2 * HEAD_DIM)).chunk(2, dim=-1)
    assert torch.equal(gate, halves[1])
    assert not torch.equal(gate, halves[0])
    # attention_premix is o_proj's input split into heads
    assert torch.equal(out[f"{attn}.attention_premix"], out[f"{attn}.o_proj.input"].unflatten(-1, (HEADS, HEAD_DIM)))


def test_partial_rotary(out):
    attn = "layers.3.self_attn"
    queries = out[f"{attn}.attention_queries"].transpose(1, 2)  # [b h s d] -> [b s h d]
    keys = out[f"{attn}.attention_keys"].transpose(1, 2)
    q_norm, k_norm = out[f"{attn}.q_norm.output"], out[f"{attn}.k_norm.output"]
    # the dims past the rotary pass through untouched
    assert torch.equal(queries[..., ROTARY:], q_norm[..., ROTARY:])
    assert torch.equal(keys[..., ROTARY:], k_norm[..., ROTARY:])
    # the rotated dims differ at every position past 0 (position 0 rotates by angle 0)
    assert torch.equal(queries[:, 0], q_norm[:, 0])
    diff = (queries[:, 1:, :, :ROTARY] - q_norm[:, 1:, :, :ROTARY]).abs().amax(dim=(0, 2, 3))
    assert (diff > 1e-4).all(), diff
    assert not torch.allclose(keys[:, 1:, ..., :ROTARY], k_norm[:, 1:, ..., :ROTARY], atol=1e-4)


def test_attention_values_are_v_proj(out):
    attn = "layers.3.self_attn"
    v = out[f"{attn}.v_proj.output"].unflatten(-1, (KV_HEADS, HEAD_DIM)).transpose(1, 2)
    assert torch.equal(out[f"{attn}.attention_values"], v)


def test_eager_softmax_and_mix(out_eager):
    attn = "layers.3.self_attn"
    scores, probs = out_eager[f"{attn}.attention_scores"], out_eager[f"{attn}.attention_probabilities"]
    torch.testing.assert_close(torch.softmax(scores.float(), dim=-1), probs, rtol=0, atol=1e-7)
    # causal: the scores are masked above the diagonal and the pattern is zero there
    seq = scores.shape[-1]
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    assert (scores[..., future] < -1e30).all()
    assert torch.equal(probs[..., future], torch.zeros_like(probs[..., future]))
    # below it, the scores are q . k / sqrt(head_dim) with the key heads repeated to the query heads
    queries = out_eager[f"{attn}.attention_queries"]
    keys = out_eager[f"{attn}.attention_keys"].repeat_interleave(HEADS // KV_HEADS, dim=1)
    expected = queries @ keys.transpose(-1, -2) / HEAD_DIM ** 0.5
    torch.testing.assert_close(scores[..., ~future], expected[..., ~future], rtol=0, atol=1e-5)
    # the pattern times the repeated values gives the heads' outputs
    values = out_eager[f"{attn}.attention_values"].repeat_interleave(HEADS // KV_HEADS, dim=1)
    mixed = (probs @ values).transpose(1, 2)  # [b h s d] -> [b s h d]
    torch.testing.assert_close(out_eager[f"{attn}.attention_head_outputs"], mixed, rtol=0, atol=1e-6)
    # repeating the kv heads the wrong way (tiled, not interleaved) does not
    tiled = out_eager[f"{attn}.attention_values"].repeat(1, HEADS // KV_HEADS, 1, 1)
    assert not torch.allclose(out_eager[f"{attn}.attention_head_outputs"], (probs @ tiled).transpose(1, 2),
                              atol=1e-3)


SCORES = {"layers.3.self_attn.attention_scores", "layers.3.self_attn.attention_probabilities"}


def test_sdpa_and_eager_agree(ig, ig_eager, out, out_eager):
    both = [name for name in ig.values if name in ig_eager.values]
    assert "layers.3.self_attn.attention_head_outputs" in both and "logits" in both
    assert len(both) > 150
    for name in both:
        a, b = out.values[name], out_eager.values[name]
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert a == b, name
    # the sdpa load has everything the eager one has, but (until sdpa is decomposed) the pattern
    assert not set(ig.values) - set(ig_eager.values)
    assert set(ig_eager.values) - set(ig.values) <= SCORES


def test_fused_sdpa_equals_decomposed(ig, ig_fused, out, out_fused):
    """Asking for the pattern must not change any other value (beyond float noise)."""
    def has_sdpa(program):
        return any(node.target is torch.ops.aten.scaled_dot_product_attention.default for node in program.graph.nodes)

    assert has_sdpa(ig_fused)
    if SCORES <= set(ig.values):  # the pattern is read from explicit nodes
        assert not has_sdpa(ig)
    assert set(ig.values) - set(ig_fused.values) <= SCORES
    for name in ig_fused.values:
        a, b = out_fused.values[name], out.values[name]
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.compat
def test_scores_under_sdpa(sdpa_model, eager_model, out_eager, ids):
    """attention_scores/probabilities under an sdpa load: either the eager numbers, or unavailable
    with a reason that says to load eager (and an error saying so on request)."""
    sdpa_table, eager_table = qgraph.support(sdpa_model), qgraph.support(eager_model)
    for name in sorted(SCORES):
        assert eager_table[name].available and eager_table[name].reason is None
        entry = sdpa_table[name]
        if entry.available:
            got = qgraph.instrument(sdpa_model, values=[name])(input_ids=ids)
            torch.testing.assert_close(got[name], out_eager[name], rtol=0, atol=1e-5)
        else:
            assert "eager" in entry.reason
            with pytest.raises(qgraph.UnavailableValue, match="eager"):
                qgraph.instrument(sdpa_model, values=[name])


# -- the gated DeltaNet ------------------------------------------------------------------------------------
def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule(queries, keys, values, decays, betas, state, normalize=True):
    """The gated delta rule token by token: (head outputs [b s h v], last state [b h k v])."""
    repeat = values.shape[2] // keys.shape[2]
    q = queries.double().repeat_interleave(repeat, dim=2)
    k = keys.double().repeat_interleave(repeat, dim=2)
    if normalize:
        q, k = l2norm(q), l2norm(k)
    q = q / q.shape[-1] ** 0.5
    v, g, beta, s = values.double(), decays.double(), betas.double(), state.double()
    outputs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        remembered = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outputs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return torch.stack(outputs, dim=1).float(), s.float()


def relative_error(got, expected):
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("block", range(3))
def test_delta_rule_from_taps(out, block):
    dn = f"layers.{block}.linear_attn"
    queries, keys, values, decays, betas = [out[f"{dn}.{name}"] for name in (
        "attention_queries", "attention_keys", "attention_values", "decays", "betas")]
    state_input = out[f"{dn}.state_input"]
    assert torch.equal(state_input, torch.zeros_like(state_input))  # a prompt starts from zeros
    expected_heads, expected_state = out[f"{dn}.attention_head_outputs"], out[f"{dn}.state_output"]
    heads, state = delta_rule(queries, keys, values, decays, betas, state_input)
    # the tiny model's head outputs are ~1e-3, so check the relative error too
    torch.testing.assert_close(heads, expected_heads, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=1e-5)
    assert relative_error(heads, expected_heads) < 1e-4
    assert relative_error(state, expected_state) < 1e-4
    # without the l2 norm the recurrence is far from what the model computed
    wrong_heads, wrong_state = delta_rule(queries, keys, values, decays, betas, state_input, normalize=False)
    assert relative_error(wrong_heads, expected_heads) > 0.5
    assert relative_error(wrong_state, expected_state) > 0.5
    # the state carries over tokens: forgetting everything between tokens is also far off
    forgetful, _ = delta_rule(queries, keys, values, torch.full_like(decays, -80.0), betas, state_input)
    assert relative_error(forgetful, expected_heads) > 0.05


@pytest.mark.parametrize("block", range(3))
@pytest.mark.compat
def test_delta_rule_inputs(out, sdpa_model, block):
    """decays and betas are the model's gates computed from in_proj_a / in_proj_b."""
    dn, module = f"layers.{block}.linear_attn", sdpa_model.model.layers[block].linear_attn
    a, b = out[f"{dn}.in_proj_a.output"], out[f"{dn}.in_proj_b.output"]
    with torch.no_grad():
        decays = -module.A_log.float().exp() * torch.nn.functional.softplus(a.float() + module.dt_bias)
    torch.testing.assert_close(out[f"{dn}.decays"], decays, rtol=0, atol=1e-6)
    torch.testing.assert_close(out[f"{dn}.betas"], b.sigmoid(), rtol=0, atol=1e-6)
    # queries / keys / values are the causal conv's (silu'd) output split three ways, num_k_heads wide
    mixed = out[f"{dn}.in_proj_qkv.output"].transpose(1, 2)
    with torch.no_grad():
        conv = torch.nn.functional.conv1d(mixed, module.conv1d.weight, padding=module.conv1d.padding[0],
                                          groups=mixed.shape[1])[..., :mixed.shape[-1]]
    q, k, v = torch.nn.functional.silu(conv).transpose(1, 2).split([K_HEADS * K_DIM] * 2 + [V_HEADS * V_DIM], -1)
    torch.testing.assert_close(out[f"{dn}.attention_queries"], q.unflatten(-1, (K_HEADS, K_DIM)), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[f"{dn}.attention_keys"], k.unflatten(-1, (K_HEADS, K_DIM)), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[f"{dn}.attention_values"], v.unflatten(-1, (V_HEADS, V_DIM)), rtol=0, atol=1e-6)


# -- the model's outputs -------------------------------------------------------------------------------
def test_logits_values(out, sdpa_model):
    assert torch.equal(out.logits, out["logits"])
    assert torch.equal(out["logits"], out["lm_head_output"])
    with torch.no_grad():
        projected = out["final_norm_output"] @ sdpa_model.lm_head.weight.T
    torch.testing.assert_close(projected, out["logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out["next_token_probs"], torch.softmax(out["logits"][:, -1], dim=-1))
    assert not torch.allclose(out["next_token_probs"], torch.softmax(out["logits"][:, -2], dim=-1))


@pytest.mark.parametrize("side", ["right", "left"])
def test_next_token_probs_follow_each_rows_last_real_token(ig, sdpa_model, side):
    """A padded batch (the tokenizer pads right by default): each row's distribution is the one
    after its own last token, as the HF forward of that prompt alone gives it."""
    long, short = random_ids(1, 12, seed=7)[0], random_ids(1, 5, seed=8)[0]
    pad, ones, zeros = (torch.full((n,), v, dtype=torch.long) for n, v in ((7, 0), (5, 1), (7, 0)))
    row, kept = (torch.cat([short, pad]), torch.cat([ones, zeros])) if side == "right" else \
        (torch.cat([pad, short]), torch.cat([zeros, ones]))
    ids, mask = torch.stack([long, row]), torch.stack([torch.ones(12, dtype=torch.long), kept])
    probs = ig(ids, mask)["next_token_probs"]
    for i, prompt in enumerate((long, short)):
        alone = hf_logits(sdpa_model, prompt[None])[0, -1].float().softmax(-1)
        torch.testing.assert_close(probs[i], alone, rtol=0, atol=1e-5)


def test_call_inputs_are_values(out, ids):
    assert torch.equal(out["input_ids"], ids)
    assert torch.equal(out["attention_mask"], torch.ones_like(ids))
    assert tuple(out["input_size"]) == tuple(ids.shape)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("program", ["ig", "ig_fused"])
@pytest.mark.compat
def test_logits_match_hf_at_every_length(request, sdpa_model, batch, program):
    ig = request.getfixturevalue(program)
    for seq in (1, 7, 64, 65, 130):
        ids = random_ids(batch, seq, seed=seq)
        mask = torch.ones_like(ids)
        expected = hf_logits(sdpa_model, ids, mask)
        got = ig(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(got.logits, expected, rtol=0, atol=1e-6, msg=lambda m: f"seq {seq}: {m}")
        # the program is the same one for every length
        assert got["layers.3.layer_output"].shape[:2] == (batch, seq)


@pytest.mark.parametrize("values", ["ig", "ig_fused"])
@pytest.mark.compat
def test_logits_match_hf_left_padded(request, sdpa_model, tokenizer, values):
    """All positions, padding included: with no edits the program is the model's forward."""
    program = request.getfixturevalue(values)
    texts = ["hi", "hello there, world", "a longer prompt than the other two, by a margin"]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(texts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    assert (batch["attention_mask"] == 0).any(dim=1).tolist() == [True, True, False]
    got = program(**batch)
    expected = hf_logits(sdpa_model, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(got.logits, expected, rtol=0, atol=1e-6)
    # and each prompt's real tokens get what it gets alone
    for row, text in enumerate(texts):
        alone = tokenizer([text], return_tensors="pt")
        length = alone["input_ids"].shape[1]
        torch.testing.assert_close(got.logits[row, -length:], hf_logits(sdpa_model, alone["input_ids"])[0],
                                   rtol=0, atol=1e-4)


@pytest.mark.compat
def test_logits_match_hf_eager(ig_eager, eager_model):
    ids = random_ids(2, 33, seed=5)
    torch.testing.assert_close(ig_eager(input_ids=ids).logits, hf_logits(eager_model, ids), rtol=0, atol=1e-6)


# -- module ports -------------------------------------------------------------------------------------------
def _hooked_forward(model, family, input_ids):
    """Every module's first input and output as plain forward hooks read them."""
    seen, handles = {}, []
    for path, module in model.named_modules():
        name = family.module_name(path)
        if not name:
            continue
        first = next(iter(inspect.signature(module.forward).parameters), None)

        def pre(module, args, kwargs, name=name, first=first):
            x = args[0] if args else kwargs.get(first)
            if isinstance(x, torch.Tensor):
                seen[f"{name}.input"] = x.detach().clone()

        def post(module, args, output, name=name):
            x = output[0] if isinstance(output, tuple) and output else output
            if isinstance(x, torch.Tensor):
                seen[f"{name}.output"] = x.detach().clone()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        with torch.no_grad():
            model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("load", ["sdpa", "eager"])
@pytest.mark.compat
def test_ports_equal_forward_hooks(request, ids, load):
    ig = request.getfixturevalue("ig" if load == "sdpa" else "ig_eager")
    out = request.getfixturevalue("out" if load == "sdpa" else "out_eager")
    seen = _hooked_forward(ig.model, ig.family, ids)
    ports = {name for name, entry in ig.catalogue.items() if entry.spec is None and entry.available}
    assert ports == {name for name in ig.values if ig.catalogue[name].spec is None}
    assert len(ports) > 100
    # every port the catalogue lists as available is one a hook sees, and the other way round
    assert ports == set(seen)
    for name in sorted(ports):
        torch.testing.assert_close(out[name], seen[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_unavailable_ports_are_never_called(ig, ids):
    """The unavailable ports are those of the modules a forward never calls, as forward hooks see it: the
    ModuleList, and in each DeltaNet either conv1d (transformers 5.15 on pass its weight to the conv kernel)
    or act (5.9 to 5.14 call conv1d as a module and F.silu, never their act module)."""
    called, handles = set(), []
    for path, module in ig.model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda module, args, path=path: called.add(path)))
    try:
        with torch.no_grad():
            ig.model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    never = {ig.family.module_name(path) for path, _ in ig.model.named_modules() if path not in called}
    missing = {name: entry.reason for name, entry in ig.catalogue.items() if entry.spec is None and not entry.available}
    assert set(missing) == {f"{name}.{side}" for name in never - {""} for side in ("input", "output")}
    deltanet = {f"layers.{b}.linear_attn.{child}.{side}" for b in range(3) for side in ("input", "output")
                for child in ("conv1d", "act")}
    assert {"layers.input", "layers.output"} <= set(missing) <= deltanet | {"layers.input", "layers.output"}
    assert len(set(missing) & deltanet) == 6  # one module of each of the three DeltaNets, both its ports
    assert all("never called" in reason for reason in missing.values())


# -- the model is left alone -------------------------------------------------------------------------------
def test_state_dict_unchanged(ig, sdpa_model, before_instrument):
    ig(input_ids=random_ids(2, 9, seed=9))
    qgraph.instrument(sdpa_model, values=["layers.*.layer_output"])(input_ids=random_ids(1, 3))
    after = sdpa_model.state_dict()
    assert list(after) == list(before_instrument["state_dict"])
    for name, tensor in after.items():
        assert torch.equal(tensor, before_instrument["state_dict"][name]), name
        assert tensor.data_ptr() == before_instrument["data_ptrs"][name], name  # not replaced either


def test_model_is_restored(ig, sdpa_model, before_instrument):
    for path, module in sdpa_model.named_modules():
        assert (len(module._forward_hooks), len(module._forward_pre_hooks)) == before_instrument["hooks"][path], path
        assert module.forward == before_instrument["forwards"][path], path
    module = before_instrument["kernel_module"]
    for name, function in before_instrument["functions"].items():
        assert getattr(module, name) is function, name
    ids = before_instrument["probe_ids"]
    assert torch.equal(hf_logits(sdpa_model, ids), before_instrument["logits"])


def test_parameters_are_shared_not_copied(ig, sdpa_model):
    ids = random_ids(1, 12, seed=7)
    before = ig(input_ids=ids)
    weight = sdpa_model.model.layers[3].self_attn.o_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(2.0)
        changed = ig(input_ids=ids)
        torch.testing.assert_close(changed.logits, hf_logits(sdpa_model, ids), rtol=0, atol=1e-6)
        assert not torch.allclose(changed.logits, before.logits, atol=1e-4)
        torch.testing.assert_close(changed["layers.3.self_attn.attention_output"],
                                   2 * before["layers.3.self_attn.attention_output"], rtol=1e-5, atol=1e-6)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert torch.equal(ig(input_ids=ids).logits, before.logits)
    # the program holds no tensors of its own that copy a parameter
    model_ptrs = {t.data_ptr() for t in list(sdpa_model.parameters()) + list(sdpa_model.buffers())}
    for name, tensor in list(ig.program.named_parameters()) + list(ig.program.named_buffers()):
        assert tensor.data_ptr() in model_ptrs, name


# -- the catalogue's shapes --------------------------------------------------------------------------
def _numeric_text(size) -> bool:
    return isinstance(size, str) and size.lstrip("-").isdigit()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5 image-text", "qwen3_5_moe", "qwen3_next"])
def test_every_catalogue_shape_is_ints_and_dim_names(request, family, tmp_path_factory):
    """Every shape entry of every family's catalogue (values and ports) is an int or a dim's name or
    expression (``batch``, ``4*batch*seq``), never a number as a string (the projector port's ``'128'``);
    the sizes are the config's."""
    if family == "qwen3_5":
        model = request.getfixturevalue("sdpa_model")
    elif family == "qwen3_5 image-text":
        from transformers import AutoModelForImageTextToText

        from qgraph.testing import tiny_qwen3_5_vl
        model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_5_vl(tmp_path_factory.mktemp("vl"))).eval()
    else:
        model = request.getfixturevalue("sparse_model")(family)
    catalogue = qgraph.support(model).catalogue
    text = model.config.get_text_config()
    for name, entry in catalogue.items():
        for size in entry.shape:
            assert type(size) in (int, str) and not _numeric_text(size), (name, entry.shape)
    assert catalogue["layers.0.layer_output"].shape == ("batch", "seq", text.hidden_size)
    assert catalogue["layers.0.mlp.output"].shape == ("batch", "seq", text.hidden_size)
    assert catalogue["input_size"].shape == (2,)
    if family == "qwen3_5 image-text":
        vision = model.config.vision_config
        assert catalogue["projector.input"].shape[-1] == vision.hidden_size
        merged = catalogue["projector.linear_fc1.input"].shape[-1]  # four patches side by side: 128
        assert merged == vision.hidden_size * vision.spatial_merge_size ** 2 and type(merged) is int


def test_every_shape_of_a_call_is_the_catalogues(ig, out, ids):
    """The catalogue's shapes against the tensors a call returns: each int the tensor's size, each dim name
    the call's (batch 2; seq, query, key and positions 70)."""
    sizes = {"batch": ids.shape[0], "seq": ids.shape[1], "query": ids.shape[1], "key": ids.shape[1],
             "positions": ids.shape[1]}
    checked = 0
    for name, value in out.values.items():
        entry = ig.catalogue.get(name)
        if entry is None or not isinstance(value, torch.Tensor) or not entry.shape:
            continue
        want = tuple(size if isinstance(size, int) else eval(size, {"__builtins__": {}}, dict(sizes))
                     for size in entry.shape)
        assert tuple(value.shape) == want, (name, entry.shape)
        checked += 1
    assert checked > 150


def test_a_symbolic_size_that_is_one_number_is_an_int():
    """A traced size that is a SymInt holding one number prints as ``'128'``: it is the int 128."""
    import sympy
    from torch.fx.experimental.sym_node import SymNode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from qgraph.values.catalogue import port_size
    env = ShapeEnv()
    specialised = torch.SymInt(SymNode(sympy.Integer(128), env, int, 128))
    assert str(specialised) == "128" and not isinstance(specialised, int)
    assert port_size(specialised, str) == 128 and type(port_size(specialised, str)) is int
    symbol = env.create_symintnode(env.create_symbol(5, torch._dynamo.source.ConstantSource("x")), hint=5)
    named = port_size(4 * symbol, lambda text: text.replace(str(symbol), "seq"))
    assert named == "4*seq"
    assert port_size(7, str) == 7

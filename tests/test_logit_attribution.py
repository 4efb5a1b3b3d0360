"""Direct logit attribution and the residual stack (``out.logit_attribution``, ``out.residual_stack``),
each component against TransformerLens-style arithmetic on the plain Hugging Face model: forward hooks
read what each output projection reads (``o_proj`` / ``out_proj``), each MLP's output, the experts'
inputs and routing, and the final norm's input; per head ``W_O[:, head] @ z_head``, per expert its own
weights on its routed tokens, the final norm's scale ``1 / rms(x)``, the unembedding's rows. Their sum
against the HF forward's logit difference, the residual stack's sum against the value, on the dense tiny
model, the MoE tiny model and with SAEs and a transcoder spliced (per feature); every door."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import qgraph
from conftest import random_ids
from qgraph.saes.fixtures import weights as sae_weights
from qgraph.testing import write_transcoders

TOKEN, AGAINST = 65, 66  # 'b' and 'c' of the tiny byte vocabulary
HEADS = ("layers.0.layer_input", "layers.*.linear_attn.out_proj.input", "layers.*.self_attn.o_proj.input",
         "layers.*.mlp.mlp_output")  # what a per-head decomposition of the dense model reads


def close(a, b, atol=2e-5):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=1e-4)


def total_of(attribution):
    return attribution.attributions.sum(0) + sum(attribution.bias.values(), torch.zeros(()))


@pytest.fixture(scope="module")
def hf(hooks_model):
    """A fresh load of the tiny checkpoint: the hooks go on it, never on the session's models."""
    return hooks_model


@pytest.fixture(scope="module")
def plain(sdpa_model):
    """The session's model instrumented for nothing: a decomposition reruns its call for the values it reads."""
    return qgraph.instrument(sdpa_model)


@pytest.fixture(scope="module")
def moe(sparse_model):
    """The tiny MoE model (the session's, for qgraph) and a fresh load of it (for the hooks)."""
    model = sparse_model("qwen3_5_moe")
    return model, AutoModelForCausalLM.from_pretrained(model.config._name_or_path).eval()


def hooked(model, ids, replace=None):
    """The plain HF forward with forward hooks: ``(logits, seen)``, seen holding the embedding, what each
    mixer's output projection reads (``("z", i)``), each MLP's input and output, a MoE block's experts' inputs
    and routing and its shared expert's output and gate, and the final norm's input. ``replace`` maps
    ``("layer", i)`` / ``("mlp", i)`` to a function of (input, output) whose result the model reads instead,
    ``("z", i)`` to one of (what the output projection reads, None)."""
    seen, handles, replace = {}, [], replace or {}

    def keep(key, pick=lambda args, output: output):
        def hook(module, args, output):
            seen[key] = pick(args, output)
            change = replace.get(key)
            return None if change is None else change(args[0], output)
        return hook

    def keep_input(key):
        def hook(module, args):
            change = replace.get(key)
            seen[key] = args[0] if change is None else change(args[0], None)
            return None if change is None else (seen[key],)
        return hook

    text = model.model
    handles.append(text.embed_tokens.register_forward_hook(keep("embed")))
    handles.append(text.norm.register_forward_pre_hook(lambda m, args: seen.__setitem__("final", args[0])))
    for i, layer in enumerate(text.layers):
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        projection = mixer.out_proj if hasattr(layer, "linear_attn") else mixer.o_proj
        handles.append(projection.register_forward_pre_hook(keep_input(("z", i))))
        handles.append(layer.mlp.register_forward_hook(keep(("mlp", i))))
        handles.append(layer.mlp.register_forward_hook(keep(("mlp_input", i), lambda args, output: args[0])))
        handles.append(layer.register_forward_hook(keep(("layer", i))))
        if hasattr(layer.mlp, "experts"):
            handles.append(layer.mlp.experts.register_forward_hook(keep(("experts", i), lambda args, output: args)))
            handles.append(layer.mlp.shared_expert.register_forward_hook(keep(("shared", i))))
            handles.append(layer.mlp.shared_expert_gate.register_forward_hook(keep(("gate", i))))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, seen


@torch.no_grad()
def direction_of(model, seen, token, against):
    """The unembedding's ``token - against`` rows through the final norm, its scale ``1/rms(x)`` frozen."""
    norm, x = model.model.norm, seen["final"].float()
    scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    rows = model.lm_head.weight.float()
    return (rows[token] - rows[against]) * (1 + norm.weight.float()) * scale


@torch.no_grad()
def written(model, seen) -> dict[str, torch.Tensor]:
    """What each component wrote to the stream ``{label: [batch, seq, hidden]}``, by TransformerLens's
    arithmetic on the hooks' tensors: per head its slice of the output projection, per expert its weights."""
    config, out = model.config, {"embed": seen["embed"].float()}
    for i, layer in enumerate(model.model.layers):
        deltanet = hasattr(layer, "linear_attn")
        name = f"layers.{i}.{'linear_attn' if deltanet else 'self_attn'}"
        weight = (layer.linear_attn.out_proj if deltanet else layer.self_attn.o_proj).weight.float()
        heads = config.linear_num_value_heads if deltanet else config.num_attention_heads
        width = config.linear_value_head_dim if deltanet else config.head_dim
        z = seen[("z", i)].float()
        for h in range(heads):
            part = slice(h * width, (h + 1) * width)
            out[f"{name}.head.{h}"] = z[..., part] @ weight[:, part].T
        if not hasattr(layer.mlp, "experts"):
            out[f"layers.{i}.mlp"] = seen[("mlp", i)].float()
            continue
        hidden, chosen, routing = seen[("experts", i)]
        experts = layer.mlp.experts
        for e in range(experts.num_experts):
            vectors = torch.zeros_like(hidden, dtype=torch.float32)
            tokens, slot = torch.where(chosen == e)
            gate, up = F.linear(hidden[tokens].float(), experts.gate_up_proj[e].float()).chunk(2, dim=-1)
            vectors[tokens] = F.linear(experts.act_fn(gate) * up, experts.down_proj[e].float()) * \
                routing[tokens, slot, None].float()
            out[f"layers.{i}.mlp.expert.{e}"] = vectors.reshape(seen[("mlp", i)].shape)
        out[f"layers.{i}.mlp.shared_expert"] = (torch.sigmoid(seen[("gate", i)]) * seen[("shared", i)]).float() \
            .reshape(seen[("mlp", i)].shape)
    return out


@torch.no_grad()
def reference(model, seen, token=TOKEN, against=AGAINST) -> dict[str, torch.Tensor]:
    """Each component's direct logit attribution ``[batch, seq]`` from the hooks."""
    direction = direction_of(model, seen, token, against)
    return {label: (vectors * direction).sum(-1) for label, vectors in written(model, seen).items()}


# -- the dense model: DeltaNet and attention heads ---------------------------------------------------------
def test_every_head_and_mlp_is_the_hooks_arithmetic_and_they_sum_to_the_logit_difference(sdpa_model, plain, hf):
    ids = random_ids(2, 9, seed=3)
    logits, seen = hooked(hf, ids)
    expected = reference(hf, seen)
    out = plain(ids)  # captures nothing: the decomposition reruns the call for its values
    attribution = out.logit_attribution(TOKEN, AGAINST)
    assert attribution.labels == list(expected)  # embed, each block's heads then its MLP, in stream order
    assert attribution.labels[:2] == ["embed", "layers.0.linear_attn.head.0"]
    assert "layers.3.self_attn.head.3" in attribution.labels and len(attribution) == 1 + 3 * 4 + 4 + 4
    for label, value in expected.items():
        close(attribution[label], value)
    assert attribution.bias == {}  # no biases in Qwen3.5's projections or head
    difference = logits[..., TOKEN] - logits[..., AGAINST]
    close(attribution.total, difference)
    close(total_of(attribution), difference)
    assert attribution.attributions.shape == (len(expected), 2, 9) and attribution.positions == list(range(9))
    # the values the call captured are read as they are: the same numbers, without a rerun
    captured = qgraph.instrument(sdpa_model, values=list(HEADS))(ids)
    close(captured.logit_attribution(TOKEN, AGAINST).attributions, attribution.attributions)


def test_coarser_grains_sum_the_finer_ones(sdpa_model):
    out = qgraph.instrument(sdpa_model, values=list(HEADS) + ["layers.*.*.attention_output"])(random_ids(1, 6))
    heads = out.logit_attribution(TOKEN, AGAINST)
    components = out.logit_attribution(TOKEN, AGAINST, per="component")
    blocks = out.logit_attribution(TOKEN, AGAINST, per="block")
    assert components.labels == ["embed"] + [f"layers.{i}.{part}" for i in range(4) for part in
                                             ("linear_attn" if i < 3 else "self_attn", "mlp")]
    assert blocks.labels == ["embed"] + [f"layers.{i}" for i in range(4)]
    for i in range(4):
        mixer = "linear_attn" if i < 3 else "self_attn"
        close(components[f"layers.{i}.{mixer}"], sum(heads[f"layers.{i}.{mixer}.head.{h}"] for h in range(4)))
        close(blocks[f"layers.{i}"], components[f"layers.{i}.{mixer}"] + components[f"layers.{i}.mlp"])
    close(components.total, heads.total)
    close(total_of(blocks), heads.total)


def test_tokens_positions_and_their_refusals(sdpa_model):
    ids = random_ids(2, 7, seed=5)
    out = qgraph.instrument(sdpa_model, values=list(HEADS))(ids)
    full = out.logit_attribution([TOKEN, 70])  # one token per batch row; no against: the logit itself
    close(full.total, out.logits[..., [TOKEN, 70]].diagonal(dim1=0, dim2=2).T)
    close(total_of(full), full.total)
    some = out.logit_attribution(torch.tensor([TOKEN, 70]), positions=[-1, 2])
    assert some.positions == [6, 2]
    close(some.attributions, full.attributions[:, :, [6, 2]])
    following = out.logit_attribution(ids[:, 1:], positions=list(range(6)))  # each position's next token
    close(following.total, out.logits[:, :6].gather(-1, ids[:, 1:, None])[..., 0])
    close(out.logit_attribution(TOKEN, positions=3).attributions[:, :, 0],
          out.logit_attribution(TOKEN).attributions[:, :, 3])
    with pytest.raises(qgraph.InvalidType, match="token ids, not strings"):
        out.logit_attribution("A")
    with pytest.raises(qgraph.InvalidArgument, match="one id per batch row"):
        out.logit_attribution([TOKEN, 70, 71])
    with pytest.raises(qgraph.OutOfRange, match="outside the vocabulary"):
        out.logit_attribution(10_000)
    with pytest.raises(qgraph.OutOfRange, match="not token positions of a 7-token call"):
        out.logit_attribution(TOKEN, positions=[7])
    with pytest.raises(qgraph.InvalidArgument, match="per='expert'"):
        out.logit_attribution(TOKEN, per="expert")
    assert full.top(3, batch=1, position=-1) == sorted(
        [(label, float(full[label][1, -1])) for label in full.labels], key=lambda pair: -abs(pair[1]))[:3]


def test_the_calls_edits_are_in_force_captured_or_rerun(sdpa_model, plain, hf):
    ids = random_ids(1, 8, seed=7)
    edits = {"layers.1.mlp.mlp_output": qgraph.Scale(3.0), "layers.2.linear_attn.out_proj.input": qgraph.Zero()}
    logits, seen = hooked(hf, ids, {("mlp", 1): lambda x, y: y * 3, ("z", 2): lambda z, _: torch.zeros_like(z)})
    expected = reference(hf, seen)
    expected["layers.1.mlp"] = expected["layers.1.mlp"] * 3  # the hook saw the MLP's output before its change
    rerun = plain(ids, edits=edits).logit_attribution(TOKEN, AGAINST)
    captured = qgraph.instrument(sdpa_model, values=list(HEADS))(ids, edits=edits).logit_attribution(TOKEN, AGAINST)
    for attribution in (rerun, captured):
        for label, value in expected.items():
            close(attribution[label], value)
        assert attribution["layers.2.linear_attn.head.1"].abs().max() == 0
        close(attribution.total, logits[..., TOKEN] - logits[..., AGAINST])
        close(total_of(attribution), attribution.total)
    # a call whose edits differ from call to call does not repeat: refused, naming the values to capture
    noisy = {"layers.1.mlp.mlp_output": lambda x: x + torch.randn_like(x)}
    with pytest.raises(qgraph.InvalidState, match=r"gave other logits.*values=\['layers.0.layer_input'"):
        plain(ids, edits=noisy).logit_attribution(TOKEN)


# -- the residual stack ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, point", [("layers.0.layer_input", 0), ("layers.2.layer_mid", 5),
                                         ("blocks.1.hook_resid_post", 4), ("layers[-1].layer_output", 8)])
def test_the_residual_stack_sums_to_the_value(plain, hf, name, point):
    ids = random_ids(2, 6, seed=11)
    _, seen = hooked(hf, ids)
    # the components up to the point: each block's heads, then its MLP (layer_mid: the mixer's heads only)
    upto = {label: vectors for label, vectors in written(hf, seen).items()
            if label == "embed" or _index(label) <= point}
    out = plain(ids)
    for per in ("head", "component", "block"):
        stack = out.residual_stack(name, per=per)
        close(stack.stack.sum(0), stack.value)
        close(stack.value, sum(upto.values()))  # the value, as the HF forward's components sum to it
    heads = out.residual_stack(name, per="head", positions=[0, -1])
    assert heads.labels == list(upto) and heads.stack.shape == (len(upto), 2, 2, 64) and heads.positions == [0, 5]
    for label, vectors in upto.items():
        close(heads[label], vectors[:, [0, -1]])
    assert heads.top(2)[0][0] in heads.labels


def _index(label: str) -> int:
    """The stream index of a component's write (``layers.{i}.<mixer>`` 2i + 1, ``layers.{i}.mlp`` 2i + 2)."""
    block = int(label.split(".")[1])
    return 2 * block + (2 if ".mlp" in label else 1)


def test_a_value_that_is_not_the_residual_stream_is_refused(out):
    with pytest.raises(qgraph.InvalidArgument, match="not a residual-stream value"):
        out.residual_stack("layers.1.mlp_input")


# -- the MoE model: per expert -----------------------------------------------------------------------------
def test_every_routed_expert_and_the_shared_expert_are_their_weights_arithmetic(moe):
    model, plain = moe
    ids = random_ids(2, 7, seed=13)
    logits, seen = hooked(plain, ids)
    expected = reference(plain, seen)
    out = qgraph.instrument(model)(ids)
    attribution = out.logit_attribution(TOKEN, AGAINST)
    experts = [label for label in attribution.labels if label.startswith("layers.1.mlp.")]
    assert experts == [f"layers.1.mlp.expert.{e}" for e in range(8)] + ["layers.1.mlp.shared_expert"]
    assert attribution.labels == list(expected)
    for label, value in expected.items():
        close(attribution[label], value)
    routed = attribution.attributions[[attribution.labels.index(f"layers.1.mlp.expert.{e}") for e in range(8)]]
    assert ((routed != 0).sum(0) == 2).all()  # top-2: each token has two experts' contributions, the rest zero
    close(total_of(attribution), logits[..., TOKEN] - logits[..., AGAINST])
    stack = out.residual_stack("layers.1.layer_output", per="head")
    close(stack.stack.sum(0), stack.value)
    close(stack["layers.1.mlp.expert.3"], written(plain, seen)["layers.1.mlp.expert.3"])


# -- dictionaries: per feature -----------------------------------------------------------------------------
@pytest.mark.parametrize("splice", ["error", "reconstruction"])
def test_spliced_dictionaries_decompose_per_feature(sdpa_model, hf, tmp_path, splice):
    w = sae_weights(64, 32, seed=2)
    sae = qgraph.SAE(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], "relu")
    w = sae_weights(64, 24, seed=3)
    mlp_sae = qgraph.SAE(w["W_enc"], w["b_enc"], w["W_dec"], w["b_dec"], "relu")
    transcoder = qgraph.Transcoder.load(write_transcoders(tmp_path, 64, [3], 16, skip=True), layer=3)
    ig = qgraph.instrument(sdpa_model, saes={"layers.1.layer_output": sae, "layers.2.mlp.mlp_output": mlp_sae},
                           transcoders={3: transcoder}, splice=splice)
    ids = random_ids(1, 6, seed=17)
    out = ig(ids)
    attribution = out.logit_attribution(TOKEN, AGAINST)
    # the reference: the HF forward, reading the dictionaries' reconstructions where they are spliced so
    replace = {} if splice == "error" else {("layer", 1): lambda x, y: sae(y), ("mlp", 2): lambda x, y: mlp_sae(y),
                                            ("mlp", 3): lambda x, y: transcoder(x)}
    logits, seen = hooked(hf, ids, replace)
    direction = direction_of(hf, seen, TOKEN, AGAINST)
    first = [label for label in attribution.labels if not label.startswith("layers.1.layer_output.sae")]
    assert attribution.labels[:32] == [f"layers.1.layer_output.sae.feature.{k}" for k in range(32)]
    assert first[:4] == [f"layers.2.linear_attn.head.{h}" for h in range(4)]  # the SAE stands for all before it
    for label, dictionary, read in (("layers.1.layer_output.sae", sae, seen[("layer", 1)]),
                                    ("layers.2.mlp.mlp_output.sae", mlp_sae, seen[("mlp", 2)]),
                                    ("layers.3.transcoder", transcoder, seen[("mlp_input", 3)])):
        features = dictionary.encode(read)
        for k in range(dictionary.d_sae):
            close(attribution[f"{label}.feature.{k}"], features[..., k] * (direction @ dictionary.W_dec[k]))
        close(attribution[f"{label}.b_dec"], direction @ dictionary.b_dec)
        assert (f"{label}.error" in attribution.bias) == (splice == "error")
    close(attribution["layers.3.transcoder.skip"], (transcoder.skip(seen[("mlp_input", 3)]) * direction).sum(-1))
    if splice == "error":
        error = seen[("mlp", 2)] - mlp_sae(seen[("mlp", 2)])
        close(attribution["layers.2.mlp.mlp_output.sae.error"], (error * direction).sum(-1))
    close(attribution["layers.3.self_attn.head.1"], reference(hf, seen)["layers.3.self_attn.head.1"])
    close(total_of(attribution), logits[..., TOKEN] - logits[..., AGAINST])
    close(attribution.total, logits[..., TOKEN] - logits[..., AGAINST])
    coarse = out.logit_attribution(TOKEN, AGAINST, per="component")
    assert coarse.labels[:3] == ["layers.1.layer_output.sae", "layers.2.linear_attn", "layers.2.mlp.mlp_output.sae"]
    close(total_of(coarse), attribution.total)
    stack = out.residual_stack("layers.3.layer_output", per="head")
    assert stack.labels[0] == "layers.1.layer_output.sae.features" and "layers.3.transcoder.features" in stack.labels
    close(stack.stack.sum(0) + sum(stack.bias.values()), seen["final"])


# -- doors and pictures ------------------------------------------------------------------------------------
def test_a_loaded_program_decomposes_and_a_remote_one_says_where_to(sdpa_model, remote, tmp_path):
    ids = random_ids(1, 5, seed=19)
    local = qgraph.instrument(sdpa_model, values=list(HEADS))
    expected = local(ids).logit_attribution(TOKEN, AGAINST)
    loaded = qgraph.load(local.save(tmp_path / "heads.qgraph", weights=True))
    close(loaded(ids).logit_attribution(TOKEN, AGAINST).attributions, expected.attributions)
    bare = qgraph.load(qgraph.instrument(sdpa_model, values=["layers.0.layer_input"]).save(
        tmp_path / "bare.qgraph", weights=True))
    with pytest.raises(qgraph.NotSupported, match=r"reads .*out_proj.input.*which LoadedProgram\(bare.qgraph.*save "
                                                  r"the program with them"):
        bare(ids).logit_attribution(TOKEN)
    out = remote.instrument(["layers.*.layer_output"])(ids)
    with pytest.raises(qgraph.NotSupported, match="holds no weights.*qgraph.instrument\\(model\\)"):
        out.logit_attribution(TOKEN)
    stack = out.residual_stack("layers.2.layer_output")  # needs no weights: the server gives its values
    close(stack.stack, local(ids).residual_stack("layers.2.layer_output").stack)


def test_the_pictures_show_the_scores(sdpa_model, tokenizer, tmp_path):
    out = qgraph.instrument(sdpa_model, values=list(HEADS))(random_ids(1, 6, seed=23))
    many = out.logit_attribution(TOKEN, AGAINST)
    figure = many.plot(rows=10)
    assert tokenizer.decode([TOKEN, AGAINST]) == "bc"
    assert figure.title == "direct logit attribution: 'b' − 'c'" and len(figure.data["labels"]) == 10
    for row, label in zip(figure.data["scores"], figure.data["labels"]):
        close(row, many[label][0])
    strongest = many.attributions[:, 0].abs().amax(1).topk(10).indices.sort().values  # in stream order
    assert figure.data["labels"] == [many.labels[i] for i in strongest.tolist()]
    figure.save(tmp_path / "many.png")
    one = out.logit_attribution(TOKEN, AGAINST, positions=-1).plot()
    assert one.data["positions"] == [5] and len(one.data["labels"]) == 21
    one.save(tmp_path / "one.png")
    stack = out.residual_stack("layers.3.layer_output", per="head").plot()
    assert "layers.3.layer_output: each component's projection" in stack.title
    stack.save(tmp_path / "stack.png")
    assert all((tmp_path / name).stat().st_size > 5000 for name in ("many.png", "one.png", "stack.png"))

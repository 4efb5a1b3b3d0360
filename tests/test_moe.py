"""The mixture-of-experts families (issue 16): qwen3_5_moe (text and image-text) and qwen3_next.

Each tiny checkpoint (4 blocks, 8 experts, top-2) is exported once per module; its values are
compared with forward hooks on the HF forward as loaded (the default grouped_mm experts, which the
program's experts op runs too, so logits equal bit for bit), and its edits with what they mean. The
same checkpoint loaded with transformers' eager experts checks the op under each implementation.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import qgraph
from conftest import random_ids, stored_round_trip
from qgraph.testing import load_processor, tiny_qwen3_5_moe, tiny_qwen3_next

FAMILIES = {"qwen3_5_moe": tiny_qwen3_5_moe, "qwen3_next": tiny_qwen3_next}
MOE = ["router_logits", "router_weights", "router_indices", "expert_weights", "experts_output", "shared_expert_output",
       "shared_expert_gate", "mlp_output"]
VALUES = [f"layers.*.mlp.{name}" for name in MOE] + ["layers.*.layer_output", "layers.1.mlp_input",
                                                     "layers.1.mlp.shared_expert.mlp_neurons"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, sparse_model):
    model = sparse_model(request.param)
    ig = qgraph.instrument(model, values=VALUES, edits=["layers.1.mlp.expert_weights", "layers.1.mlp.router_logits",
                                                        "layers.1.mlp.shared_expert_gate"])
    return request.param, model, ig


@pytest.fixture(scope="module")
def padded():
    ids = random_ids(2, 13, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids[0, :5] = 256
    return ids, mask


def hooked(model, ids, mask):
    """The HF forward with forward hooks on every MoE block's router, experts and shared expert."""
    seen, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        for name, module in (("gate", mlp.gate), ("experts", mlp.experts), ("shared_expert", mlp.shared_expert),
                             ("shared_expert_gate", mlp.shared_expert_gate), ("mlp", mlp),
                             ("neurons", mlp.shared_expert.down_proj)):
            def hook(module, args, output, key=(i, name)):
                seen[key] = args[0] if key[1] == "neurons" else output
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, seen


@pytest.fixture(scope="module")
def eager_twin(family):
    """The same checkpoint with transformers' eager experts loop (the default grouped_mm experts can
    round differently by a few ulps on some CPUs); a test that switches it switches it back."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(family[1].name_or_path, experts_implementation="eager").eval()


@pytest.mark.compat
def test_values_equal_forward_hooks_and_logits_the_hf_forward(family, padded):
    name, model, ig = family
    ids, mask = padded
    out = ig(ids, mask)
    logits, seen = hooked(model, ids, mask)  # the experts implementation as loaded: grouped_mm
    assert model.config._experts_implementation == "grouped_mm"
    assert torch.equal(out.logits, logits), name
    batch, seq = ids.shape
    for i in range(model.config.num_hidden_layers):
        router_logits, weights, indices = (t.reshape(batch, seq, -1) for t in seen[i, "gate"])
        expected = {"router_logits": router_logits, "router_weights": weights, "router_indices": indices,
                    "experts_output": seen[i, "experts"].reshape(batch, seq, -1),
                    "shared_expert_output": seen[i, "shared_expert"].reshape(batch, seq, -1),
                    "shared_expert_gate": seen[i, "shared_expert_gate"].reshape(batch, seq, -1),
                    "mlp_output": seen[i, "mlp"]}
        for value, tensor in expected.items():
            torch.testing.assert_close(out[f"layers.{i}.mlp.{value}"], tensor, rtol=0, atol=1e-6,
                                       msg=f"{name} layers.{i}.mlp.{value}")
        dense = torch.zeros(batch, seq, model.config.num_experts).scatter(-1, indices, weights)
        assert torch.equal(out[f"layers.{i}.mlp.expert_weights"], dense)
    torch.testing.assert_close(out["layers.1.mlp.shared_expert.mlp_neurons"],
                               seen[1, "neurons"].reshape(batch, seq, -1), rtol=0, atol=1e-6)


def test_the_mlp_output_is_experts_plus_the_gated_shared_expert(family, padded):
    _, model, ig = family
    out = ig(*padded)
    for i in range(model.config.num_hidden_layers):
        gated = torch.sigmoid(out[f"layers.{i}.mlp.shared_expert_gate"]) * out[f"layers.{i}.mlp.shared_expert_output"]
        torch.testing.assert_close(out[f"layers.{i}.mlp.mlp_output"], out[f"layers.{i}.mlp.experts_output"] + gated,
                                   rtol=0, atol=1e-6)
    # routing varies between tokens (the tiny router is spread), and the weights renormalise to 1
    assert out["layers.1.mlp.router_indices"].unique().numel() > 4
    torch.testing.assert_close(out["layers.1.mlp.router_weights"].sum(-1), torch.ones(padded[0].shape))


@pytest.mark.parametrize("seq", [1, 5, 17])
@pytest.mark.compat
def test_logits_equal_hf_for_many_lengths(family, seq):
    _, model, ig = family
    ids = random_ids(1, seq, seed=seq)
    with torch.no_grad():
        assert torch.equal(ig(ids).logits, model(input_ids=ids).logits)


def expert_contribution(model, layer: int, expert: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What expert ``expert`` of block ``layer`` adds for inputs ``x`` [..., hidden] at weights [...]."""
    experts = model.model.layers[layer].mlp.experts
    gate, up = (x @ experts.gate_up_proj[expert].T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ experts.down_proj[expert].T * weight[..., None]


def test_zeroing_an_expert_removes_its_contribution_and_reroutes_nothing(family, padded):
    _, model, ig = family
    ids, mask = padded
    plain = ig(ids, mask)
    busiest = int(plain["layers.1.mlp.router_indices"].flatten().mode().values)
    out = ig(ids, mask, edits={"layers.1.mlp.expert_weights": qgraph.Zero(experts=[busiest])})
    assert torch.equal(out["layers.1.mlp.router_indices"], plain["layers.1.mlp.router_indices"])
    assert (out["layers.1.mlp.expert_weights"][..., busiest] == 0).all()
    weight = plain["layers.1.mlp.expert_weights"][..., busiest]
    assert (weight > 0).sum() >= 3
    removed = plain["layers.1.mlp.experts_output"] - out["layers.1.mlp.experts_output"]
    with torch.no_grad():
        expected = expert_contribution(model, 1, busiest, plain["layers.1.mlp_input"], weight)
    torch.testing.assert_close(removed, expected, rtol=0, atol=1e-5)
    assert torch.equal(removed[weight == 0], torch.zeros_like(removed[weight == 0]))  # exactly nothing elsewhere


def test_router_logit_edits_force_and_forbid_an_expert(family, padded):
    _, model, ig = family
    ids, mask = padded
    plain = ig(ids, mask)
    busiest = int(plain["layers.1.mlp.router_indices"].flatten().mode().values)
    push = torch.zeros(model.config.num_experts)
    push[busiest] = 1e4
    forbidden = ig(ids, mask, edits={"layers.1.mlp.router_logits": qgraph.Add(-push)})
    assert not (forbidden["layers.1.mlp.router_indices"] == busiest).any()
    forced = ig(ids, mask, edits={"layers.1.mlp.router_logits": qgraph.Add(push)})
    assert (forced["layers.1.mlp.router_indices"][..., 0] == busiest).all()
    # the shared expert's gate: at 0 the sigmoid halves the shared expert
    halved = ig(ids, mask, edits={"layers.1.mlp.shared_expert_gate": qgraph.Zero()})
    torch.testing.assert_close(halved["layers.1.mlp.mlp_output"], halved["layers.1.mlp.experts_output"]
                               + 0.5 * halved["layers.1.mlp.shared_expert_output"], rtol=0, atol=1e-6)


def test_router_indices_are_read_only(family):
    _, model, _ = family
    with pytest.raises(qgraph.EditError, match="read-only"):
        qgraph.instrument(model, edits=["layers.1.mlp.router_indices"])


def test_generation_steering_and_states_work_as_on_the_dense_family(family):
    _, model, ig = family
    ids = random_ids(1, 9, seed=11)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(ig.generate(ids, max_new_tokens=6).sequences, expected)
    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    skipped = ig(ids, edits=qgraph.skip_layers(1, 2))
    assert torch.equal(skipped["layers.2.layer_output"], skipped["layers.0.layer_output"])
    steered = ig(ids, edits=qgraph.steer(1, vector, 2.0))
    torch.testing.assert_close(steered["layers.1.layer_output"], ig(ids)["layers.1.layer_output"] + 2.0 * vector,
                               rtol=0, atol=1e-5)
    states = qgraph.instrument(model, values={"layers.0.linear_attn.state": {"positions": [8]},
                                              "layers.0.linear_attn.state_output": {}})
    out = states(ids)
    torch.testing.assert_close(out["layers.0.linear_attn.state"][:, 0], out["layers.0.linear_attn.state_output"],
                               rtol=0, atol=1e-5)


@pytest.mark.compat
def test_gradients_equal_hf_autograd(family):
    name, model, ig = family
    from transformers import AutoModelForCausalLM
    twin = AutoModelForCausalLM.from_pretrained(model.name_or_path)
    ids = random_ids(2, 7, seed=5)
    twin(input_ids=ids).logits.logsumexp(-1).sum().backward()
    mine = AutoModelForCausalLM.from_pretrained(model.name_or_path)
    qgraph.instrument(mine)(ids).logits.logsumexp(-1).sum().backward()
    for (path, theirs), (_, ours) in zip(twin.named_parameters(), mine.named_parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-6, msg=f"{name} {path}")
    assert mine.model.layers[1].mlp.experts.gate_up_proj.grad.abs().sum() > 0


def test_the_cache_format_round_trips_the_moe_program(family):
    stored_round_trip(family[2].exported.program)


def test_the_block_diagram_draws_the_moe_block(family):
    from qgraph.render import diagram
    _, _, ig = family
    labels = " ".join(box.label for box in diagram(ig, "block", 1).boxes.values())
    for part in ("gate", "experts", "shared_expert", "router_logits", "expert_weights"):
        assert part in labels, part


def test_support_lists_the_moe_values_with_layouts(family):
    _, model, _ = family
    table = qgraph.support(model)
    assert table["layers.2.mlp.router_logits"].available
    assert table["layers.2.mlp.router_logits"].layout == "RouterLogits [batch seq num_experts]"
    assert table["layers.2.mlp.expert_weights"].available
    assert "layers.{i}.mlp.mlp_neurons" not in {row.name for row in table.rows}  # the dense MLP's: the shared expert has them
    assert "layers.{i}.mlp.router_weights" in {row.name for row in table.rows}


def test_a_qwen3_next_with_dense_blocks_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_next(tmp_path))
    model.config.mlp_only_layers = [2]
    with pytest.raises(qgraph.UnsupportedModel, match="mlp_only_layers=\\[2\\]"):
        qgraph.instrument(model)


def test_the_experts_op_passes_opcheck():
    from qgraph.kernels.experts import moe_experts
    generator = torch.Generator().manual_seed(0)
    # transformers' grouped / batched functions (grouped_mm: float32 or half, 16-byte strides), then the eager loop
    hidden = torch.randn(1, 5, 16, generator=generator, requires_grad=True)
    indices = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(5)]).unsqueeze(0)
    weights = torch.zeros(1, 5, 6).scatter(-1, indices, torch.rand(1, 5, 2, generator=generator)).requires_grad_()
    gate_up = torch.randn(6, 24, 16, generator=generator, requires_grad=True)
    down = torch.randn(6, 16, 12, generator=generator, requires_grad=True)
    for implementation in ("grouped_mm", "batched_mm"):
        torch.library.opcheck(moe_experts, (hidden, indices, weights, gate_up, down, "silu", implementation))
    for tokens in (5,):
        hidden = torch.randn(1, tokens, 16, dtype=torch.float64, generator=generator, requires_grad=True)
        indices = torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(tokens)]).unsqueeze(0)
        weights = torch.zeros(1, tokens, 6, dtype=torch.float64).scatter(-1, indices, torch.rand(1, tokens, 2,
                                                                         dtype=torch.float64, generator=generator))
        weights.requires_grad_()
        gate_up = torch.randn(6, 20, 16, dtype=torch.float64, generator=generator, requires_grad=True)
        down = torch.randn(6, 16, 10, dtype=torch.float64, generator=generator, requires_grad=True)
        torch.library.opcheck(moe_experts, (hidden, indices, weights, gate_up, down, "silu"))
        # fast mode: the Jacobian against random directions (one numerical derivative per output
        # projection, not per input element: the slow mode evaluates the op ~6000 times here)
        assert torch.autograd.gradcheck(lambda h, w, a, b: moe_experts(h, indices, w, a, b, "silu"),
                                        (hidden, weights, gate_up, down), fast_mode=True)


@pytest.mark.compat
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_the_experts_op_is_transformers_experts_bit_for_bit(family, eager_twin, implementation):
    # eager: the same experts, the same rows in the same order in each matmul, the same sums;
    # the others: transformers' own function, on the top-k weights gathered from expert_weights
    from qgraph.kernels.experts import moe_experts
    name, eager = family[0], eager_twin
    mlp = eager.model.layers[1].mlp
    hidden = torch.randn(37, eager.config.hidden_size, generator=torch.Generator().manual_seed(4))
    eager.set_experts_implementation(implementation)
    try:
        with torch.no_grad():
            gate = mlp.gate(hidden)
            weights, indices = gate[1], gate[2]
            expected = mlp.experts(hidden, indices, weights)
            dense = torch.zeros(37, eager.config.num_experts).scatter(-1, indices, weights)
            got = moe_experts(hidden[None], indices[None], dense[None], mlp.experts.gate_up_proj,
                              mlp.experts.down_proj, "silu", implementation)[0]
    finally:
        eager.set_experts_implementation("eager")
    assert torch.equal(got, expected), name


@pytest.mark.compat
def test_switching_the_experts_implementation_rebuilds_and_logits_stay_bit_equal(family, eager_twin, padded):
    """The program runs the experts implementation the model has: eager exactly as HF eager; switched
    to grouped_mm after instrument, the next call rebuilds it, and it equals HF grouped_mm."""
    from qgraph.kernels.experts import MOE_EXPERTS_OP
    name, model = family[0], eager_twin
    if name != "qwen3_5_moe":
        pytest.skip("one family is enough: both run qwen_moe's experts patch (bit-equality of each: above)")
    ids, mask = padded
    ig = qgraph.instrument(model)

    def run(implementation):
        calls = ig.graph.find_nodes(op="call_function", target=MOE_EXPERTS_OP)
        assert {(*node.args, "eager")[6] for node in calls} == {implementation}  # export leaves out the default
        with torch.no_grad():
            assert torch.equal(ig(ids, mask).logits, model(input_ids=ids, attention_mask=mask).logits), implementation

    try:
        ig(ids, mask)
        run("eager")
        model.set_experts_implementation("grouped_mm")
        ig(ids, mask)  # rebuilds: the program then reads grouped_mm
        run("grouped_mm")
    finally:
        model.set_experts_implementation("eager")


def test_an_experts_implementation_qgraph_cannot_run_is_refused_and_no_interface_means_eager(family, monkeypatch):
    from types import SimpleNamespace

    from qgraph import compat
    experts = family[1].model.layers[1].mlp.experts
    assert compat.experts_implementation_run(experts) == "grouped_mm"
    unknown = SimpleNamespace(**{**vars(experts), "config": SimpleNamespace(_experts_implementation="unknown")})
    with pytest.raises(qgraph.UnsupportedModel, match="cannot run the experts implementation 'unknown'"):
        compat.experts_implementation_run(unknown)
    biased = SimpleNamespace(**{**vars(experts), "has_bias": True})
    with pytest.raises(qgraph.UnsupportedModel, match="'has_bias': True"):
        compat.experts_implementation_run(biased)
    monkeypatch.setattr(compat.transformers_internals, "_experts_functions", lambda: None)  # a transformers without the interface
    with pytest.warns(UserWarning, match="no experts interface.*'grouped_mm' runs as 'eager'"):
        assert compat.experts_implementation_run(experts) == "eager"


def test_a_saved_program_runs_only_the_experts_implementations_it_can_bound(family, eager_twin, tmp_path):
    """A saved program's experts op runs "eager" or "grouped_mm" alone: "batched_mm" gathers each routed expert's
    weights per token (memory the loader's fake run cannot see) and "sonicmoe" / "deepgemm" fetch kernels from
    the Hub. A file naming one is refused at load; a model set to one is refused at save, with the way out."""
    from hostile import rewrite
    name, model, _ = family
    if name != "qwen3_5_moe":
        pytest.skip("one family is enough: both run the one experts op")
    path = qgraph.instrument(model, values=["layers.1.layer_output"]).save(tmp_path / "moe.qgraph")
    ids = random_ids(1, 6)
    with torch.no_grad():
        assert torch.equal(qgraph.load(path, weights=model)(ids).logits, model(input_ids=ids).logits)  # grouped_mm

    def implementation(value):
        def change(data):
            calls = [node for node in data["graph"]["nodes"] if node.get("target") == "torch.ops.qgraph.moe_experts.default"]
            assert calls
            for node in calls:
                node["args"] = [*node["args"][:6], value]
        return change
    for value in ("batched_mm", "sonicmoe"):
        hostile = rewrite(path, tmp_path / f"{value}.qgraph", graph=implementation(value))
        with pytest.raises(qgraph.SavedProgramError, match=rf"calls qgraph.moe_experts.default with implementation="
                                                           rf"'{value}'; a saved program holds it only with "
                                                           rf"implementation one of 'eager', 'grouped_mm'"):
            qgraph.load(hostile, weights=model)
    eager_twin.set_experts_implementation("batched_mm")
    try:
        with pytest.raises(qgraph.NotSupported, match=r"b.qgraph cannot be saved: node \w+ calls qgraph.moe_experts."
                                                      r"default with implementation='batched_mm'.*model.set_experts_"
                                                      r"implementation\('grouped_mm'\) before qgraph.instrument"):
            qgraph.instrument(eager_twin, values=["layers.1.layer_output"]).save(tmp_path / "b.qgraph")
    finally:
        eager_twin.set_experts_implementation("eager")
    assert not (tmp_path / "b.qgraph").exists()


def image(height, width, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


@pytest.mark.compat
def test_the_image_text_moe_model_with_images(tmp_path):
    from transformers import AutoModelForImageTextToText
    path = tiny_qwen3_5_moe(tmp_path, images=True)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = load_processor(path)
    content = [{"type": "image"}, {"type": "text", "text": "what is this?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    inputs = processor(text=text, images=[image(48, 80, 2)])
    ig = qgraph.instrument(model, values=["vision.image_features", "layers.1.mlp.router_indices"])
    stored_round_trip(ig.exported.program)  # the disk cache's format holds the image-text program too
    out = ig(**inputs)
    with torch.no_grad():
        torch.testing.assert_close(out.logits, model(**inputs).logits, rtol=0, atol=1e-5)
    assert out["layers.1.mlp.router_indices"].shape == (*inputs["input_ids"].shape, 2)


def test_the_experts_neurons_are_each_routed_experts_act_gate_times_up(family, padded, eager_twin):
    _, model, _ = family
    ids, mask = padded
    ig = qgraph.instrument(model, values=["layers.1.mlp.experts_neurons", "layers.1.mlp.router_indices",
                                          "layers.1.mlp_input", "layers.1.mlp.experts_output"],
                           edits=["layers.1.mlp.experts_neurons"])
    out = ig(ids, mask)
    with torch.no_grad():
        torch.testing.assert_close(out.logits, model(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=1e-5)
        experts = model.model.layers[1].mlp.experts
        for j in range(model.config.num_experts):
            routed = out["layers.1.mlp.router_indices"] == j  # [batch seq top_k]: at most one slot per token
            gate, up = (out["layers.1.mlp_input"][routed.any(-1)] @ experts.gate_up_proj[j].T).chunk(2, dim=-1)
            torch.testing.assert_close(out["layers.1.mlp.experts_neurons"][routed],
                                       torch.nn.functional.silu(gate) * up, rtol=0, atol=1e-6)
    # one expert's neurons at the tokens routed to it, with those tokens' (batch, seq)
    j = int(out["layers.1.mlp.router_indices"][0, -1, 0])
    tokens, neurons = qgraph.expert_neurons(out, layer=1, expert=j)
    assert torch.equal(tokens, (out["layers.1.mlp.router_indices"] == j).any(-1).nonzero()) and len(tokens) > 0
    assert [0, ids.shape[1] - 1] in tokens.tolist()
    for (b, s), row in zip(tokens.tolist(), neurons):
        slot = out["layers.1.mlp.router_indices"][b, s].tolist().index(j)
        assert torch.equal(row, out["layers.1.mlp.experts_neurons"][b, s, slot])
    # zeroing every neuron of every expert leaves nothing of the routed experts
    zeroed = ig(ids, mask, edits={"layers.1.mlp.experts_neurons": qgraph.Zero()})
    assert torch.equal(zeroed["layers.1.mlp.experts_output"], torch.zeros_like(out["layers.1.mlp.experts_output"]))
    # asking for the neurons runs those blocks' experts by the eager loop, whatever the model's implementation
    # (grouped_mm here): with every block's, the logits are HF eager's bit for bit
    assert model.config._experts_implementation == "grouped_mm"
    split = qgraph.instrument(model, values=["layers.*.mlp.experts_neurons"])(ids, mask)
    with torch.no_grad():
        assert torch.equal(split.logits, eager_twin(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.slow  # it compiles with inductor: the slow tier
def test_compiled_and_with_a_config_that_asks_for_router_logits(family):
    name, model, _ = family
    if name != "qwen3_5_moe":
        pytest.skip("one family is enough for the compiled program (the experts op is the same)")
    from transformers import AutoModelForCausalLM
    ids = random_ids(2, 7, seed=9)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    # dynamo + AOTAutograd (the experts op's fake and autograd); inductor's codegen is tested in test_compile
    compiled = qgraph.instrument(model, values=["layers.1.mlp.router_weights"], compile={"backend": "aot_eager"})(ids)
    torch.testing.assert_close(compiled.logits, expected, rtol=0, atol=1e-5)
    # a config asking the forward for the load-balancing loss: the program still computes the logits alone
    asking = AutoModelForCausalLM.from_pretrained(model.name_or_path, output_router_logits=True).eval()
    logits = qgraph.instrument(asking)(ids).logits
    torch.testing.assert_close(logits, qgraph.instrument(model)(ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)

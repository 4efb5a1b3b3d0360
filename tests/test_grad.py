"""Gradients through qgraph's custom ops and instrumented programs equal the plain model's autograd (issue 12)."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import qgraph
from qgraph.kernels import ops
from qgraph.kernels.delta_states import chunk_gated_delta_rule_with_states
from conftest import random_ids
from test_vision import image, processor, prompt, vl_checkpoint, vl_model  # noqa: F401 (fixtures)

TOLERANCE = 1e-5
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.fixture(scope="module")
def kernels():
    """The model module's own delta-rule kernels registered as export registers them: (their name, them)."""
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    functions = {"chunk": module.torch_chunk_gated_delta_rule, "recurrent": module.torch_recurrent_gated_delta_rule}
    return ops.register_kernels(module.__name__, functions), functions


def _kernel_repeats() -> bool:
    """Whether transformers' kernel repeats narrower queries and keys to the value heads itself (from
    5.23; before, the DeltaNet repeats them first and the kernel takes them as wide as the values)."""
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    try:
        module.torch_recurrent_gated_delta_rule(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 2, 4),
                                                torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), initial_state=None,
                                                output_final_state=False)
    except RuntimeError:
        return False
    return True


K_HEADS = 2 if _kernel_repeats() else 4


def delta_inputs(seq=70, batch=2, k_heads=K_HEADS, v_heads=4, dim=8, seed=0, requires_grad=True):
    """Random delta-rule arguments: query, key, value, g (log decay <= 0), beta, initial state (q/k
    narrower than the values where the model's kernel repeats them)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    tensors = [rand(batch, seq, k_heads, dim), rand(batch, seq, k_heads, dim), rand(batch, seq, v_heads, dim),
               -F.softplus(rand(batch, seq, v_heads)), torch.sigmoid(rand(batch, seq, v_heads)),
               rand(batch, v_heads, dim, dim) * 0.1]
    return [t.requires_grad_(requires_grad) for t in tensors]


def grads_of(function, inputs, weights):
    """d/d inputs of sum_i <outputs_i, weights_i> under plain autograd (None for a constant output)."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    outputs = function(*inputs)
    loss = sum((out.float() * w).sum() for out, w in zip(outputs, weights) if w is not None)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def max_difference(got, want) -> float:
    worst = 0.0
    for a, b in zip(got, want):
        a = torch.zeros_like(b) if a is None else a
        worst = max(worst, (a.double() - b.double()).abs().max().item())
    return worst


def weights_for(outputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(out.shape, generator=gen) for out in outputs]


# ------------------------------------------------------------------ per op


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_delta_rule_op_passes_opcheck(kernels, kind):
    op = {"chunk": torch.ops.qgraph.chunk_gated_delta_rule, "recurrent": torch.ops.qgraph.recurrent_gated_delta_rule}
    torch.library.opcheck(op[kind], (*delta_inputs(seq=70 if kind == "chunk" else 5), True, kernels[0]),
                          test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_delta_rule_op_grads_equal_the_kernels_autograd(kernels, kind):
    op = {"chunk": torch.ops.qgraph.chunk_gated_delta_rule, "recurrent": torch.ops.qgraph.recurrent_gated_delta_rule}
    inputs = delta_inputs(seq=70 if kind == "chunk" else 9)

    def reference(query, key, value, g, beta, state):
        return kernels[1][kind](query, key, value, g=g, beta=beta, initial_state=state, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)

    weights = weights_for(reference(*inputs))
    want = grads_of(reference, inputs, weights)
    got = grads_of(lambda *x: op[kind](*x, True, kernels[0]), inputs, weights)
    assert all(g.abs().max() > 0 for g in want)  # every input matters here
    assert max_difference(got, want) <= TOLERANCE
    # an unused output (no gradient for the final state) is no different from a zero one
    got = grads_of(lambda *x: op[kind](*x, True, kernels[0])[:1], inputs, weights[:1])
    want = grads_of(reference, inputs, [weights[0], None])
    assert max_difference(got, want) <= TOLERANCE


@pytest.mark.parametrize("kind", ["chunk", "recurrent"])
def test_a_kept_recomputation_gives_every_backward_and_a_vmapped_one_the_kernels_grads(kernels, kind, monkeypatch):
    """Under keep_recomputation (an attribution graph's one forward, many backwards) every backward of the
    forward, one at a time or several under torch.func.vmap, equals the kernel's own autograd; inputs
    that need no gradient get none."""
    from qgraph.kernels.grad import keep_recomputation
    op = {"chunk": torch.ops.qgraph.chunk_gated_delta_rule, "recurrent": torch.ops.qgraph.recurrent_gated_delta_rule}
    inputs = delta_inputs(seq=70 if kind == "chunk" else 9)
    frozen = [x.detach() for x in inputs[:2]] + inputs[2:]  # queries and keys frozen, as the replacement model's

    def reference(query, key, value, g, beta, state):
        return kernels[1][kind](query, key, value, g=g, beta=beta, initial_state=state, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)

    with keep_recomputation():
        outputs = op[kind](*frozen, True, kernels[0])
    wanted = frozen[2:]
    directions = [weights_for(outputs, seed) for seed in (1, 2, 3)]
    expected = [[torch.autograd.grad(reference(*frozen), wanted, d, retain_graph=True)] for d in directions]
    runs = []
    monkeypatch.setattr(ops, "_run_kernel", lambda *args: runs.append(args))  # a backward that reruns it fails
    for d, (want,) in zip(directions, expected):  # one backward after another, the graph kept
        got = torch.autograd.grad(outputs, wanted, d, retain_graph=True)
        assert max_difference(got, want) <= TOLERANCE
    stacked = [torch.stack(parts) for parts in zip(*directions)]
    got = torch.func.vmap(lambda *d: torch.autograd.grad(outputs, wanted, d, retain_graph=True))(*stacked)
    for index, (want,) in enumerate(expected):
        assert max_difference([g[index] for g in got], want) <= TOLERANCE
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(outputs, frozen[:1], directions[0], retain_graph=True)
    assert runs == []  # four backwards, no kernel run: the forward's recomputation served them all


STATES_CASES = {
    "all states": {},
    "positions, heads, bf16": {"positions": torch.tensor([0, 65, 3, 65]), "heads": torch.tensor([3, 1]),
                               "states_dtype": torch.bfloat16},
    "no initial state": {"initial_state": None},
}


def states_call(case):
    options = dict(STATES_CASES[case])
    with_state = "initial_state" not in options
    options.pop("initial_state", None)
    positions, heads = options.get("positions"), options.get("heads")
    dtype = options.get("states_dtype", torch.float32)

    def op(query, key, value, g, beta, state=None):
        return torch.ops.qgraph.chunk_gated_delta_rule_states(query, key, value, g, beta, state, positions, heads,
                                                              True, 64, dtype)

    def reference(query, key, value, g, beta, state=None):
        return chunk_gated_delta_rule_with_states(query, key, value, g, beta, initial_state=state, positions=positions,
                                                  heads=heads, states_dtype=dtype)

    inputs = delta_inputs()
    return op, reference, inputs if with_state else inputs[:5]


@pytest.mark.parametrize("case", list(STATES_CASES))
def test_states_op_passes_opcheck(case):
    op, _, inputs = states_call(case)
    args = [*inputs, None][:6]
    options = STATES_CASES[case]
    args += [options.get("positions"), options.get("heads"), True, 64, options.get("states_dtype", torch.float32)]
    torch.library.opcheck(torch.ops.qgraph.chunk_gated_delta_rule_states, tuple(args), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("case", list(STATES_CASES))
def test_states_op_grads_equal_its_reference_under_autograd(case):
    op, reference, inputs = states_call(case)
    weights = weights_for(reference(*inputs))
    want = grads_of(reference, inputs, weights)
    assert max_difference(grads_of(op, inputs, weights), want) <= TOLERANCE
    # without a gradient for the states the backward skips them: the rest is unchanged
    want = grads_of(reference, inputs, [weights[0], None, weights[2]])
    assert max_difference(grads_of(lambda *x: op(*x)[::2], inputs, weights[::2]), want) <= TOLERANCE


def varlen_inputs(requires_grad=True):
    gen = torch.Generator().manual_seed(2)
    qkv = [torch.randn(1, 3, 30, 8, generator=gen).requires_grad_(requires_grad) for _ in range(3)]
    return (*qkv, torch.tensor([0, 12, 30], dtype=torch.int32), 0.3)


def test_varlen_attention_passes_opcheck():
    torch.library.opcheck(torch.ops.qgraph.varlen_attention, varlen_inputs(), test_utils=OPCHECK_UTILS)


def test_varlen_attention_grads_equal_per_image_softmax_attention():
    query, key, value, cu_seqlens, scale = varlen_inputs()

    def reference(query, key, value):  # plain softmax attention within each image
        outputs = []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            scores = query[:, :, a:b] @ key[:, :, a:b].transpose(-1, -2) * scale
            outputs.append((scores.softmax(-1) @ value[:, :, a:b]).transpose(1, 2))
        return (torch.cat(outputs, dim=1),)

    inputs = [query, key, value]
    weights = weights_for(reference(*inputs))
    want = grads_of(reference, inputs, weights)
    got = grads_of(lambda *x: (torch.ops.qgraph.varlen_attention(*x, cu_seqlens, scale),), inputs, weights)
    assert max_difference(got, want) <= TOLERANCE


def test_mark_passes_opcheck_and_its_grad_is_the_identity():
    x = torch.randn(3, 4, requires_grad=True)
    torch.library.opcheck(torch.ops.qgraph.mark, (x, "layers.0.input"), test_utils=OPCHECK_UTILS)
    weight = torch.randn(3, 4)
    (grad,) = torch.autograd.grad((torch.ops.qgraph.mark(x, "a") * weight).sum(), x)
    assert torch.equal(grad, weight)


def test_backward_ops_pass_opcheck(kernels):
    inputs = delta_inputs(seq=20, requires_grad=False)
    grad_output, grad_state = torch.randn(2, 20, 4, 8), torch.randn(2, 4, 8, 8)
    torch.library.opcheck(torch.ops.qgraph.delta_rule_backward, ("chunk", *inputs, True, kernels[0], grad_output, grad_state))
    torch.library.opcheck(torch.ops.qgraph.delta_rule_backward, ("chunk", *inputs, True, kernels[0], grad_output, None))
    grad_states = torch.randn(2, 20, 4, 8, 8)
    torch.library.opcheck(torch.ops.qgraph.delta_rule_states_backward,
                          (*inputs, None, None, True, 64, torch.float32, grad_output, grad_states, grad_state))
    query, key, value, cu_seqlens, scale = varlen_inputs(requires_grad=False)
    torch.library.opcheck(torch.ops.qgraph.varlen_attention_backward,
                          (query, key, value, cu_seqlens, scale, torch.randn(1, 30, 3, 8)))


# ------------------------------------------------------------------ whole models


def param_grads(model, loss_fn) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of ``loss_fn()`` (zeroed before; tied weights appear once)."""
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    grads = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
             for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def worst_param_difference(got, want) -> float:
    assert got.keys() == want.keys()
    return max((got[name] - want[name]).abs().max().item() for name in want)


def token_loss(logits, mask):
    """Mean log-probability of a fixed token over the real (unpadded) positions."""
    logprobs = logits.float().log_softmax(-1)[..., 7]
    return (logprobs * mask).sum() / mask.sum()


def left_padded(batch=2, seq=70, pad=6):
    ids = random_ids(batch, seq, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def hooked_output(model, path, run):
    """The output of ``model.get_submodule(path)`` during ``run()`` (via a forward hook)."""
    seen = []
    handle = model.get_submodule(path).register_forward_hook(
        lambda module, args, output: seen.append(output[0] if isinstance(output, tuple) else output))
    try:
        run()
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("load", ["sdpa_model", "eager_model"])
@pytest.mark.compat
def test_param_grads_of_a_logits_loss_equal_hf(request, load):
    model = request.getfixturevalue(load)
    ids, mask = left_padded()
    ig = qgraph.instrument(model, values=["layers.2.layer_output"])
    want = param_grads(model, lambda: token_loss(model(input_ids=ids, attention_mask=mask).logits, mask))
    got = param_grads(model, lambda: token_loss(ig(input_ids=ids, attention_mask=mask).logits, mask))
    assert "model.embed_tokens.weight" in want and all(g.abs().max() > 0 for g in want.values())
    assert worst_param_difference(got, want) <= TOLERANCE


def test_param_grads_of_a_loss_on_a_captured_value_equal_hf(sdpa_model):
    ids, mask = left_padded()
    ig = qgraph.instrument(sdpa_model, values=["layers.2.layer_output"], logits=False)
    weight = torch.randn(sdpa_model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    loss = lambda hidden: ((hidden * weight).sum(-1) * mask).mean()  # noqa: E731

    def hf_loss():
        run = lambda: sdpa_model(input_ids=ids, attention_mask=mask)  # noqa: E731
        return loss(hooked_output(sdpa_model, "model.layers.2", run))

    want = param_grads(sdpa_model, hf_loss)
    got = param_grads(sdpa_model, lambda: loss(ig(input_ids=ids, attention_mask=mask)["layers.2.layer_output"]))
    assert want["model.layers.0.linear_attn.A_log"].abs().max() > 0
    assert worst_param_difference(got, want) <= TOLERANCE


@pytest.mark.compat
def test_param_grads_through_the_states_kernel_equal_hf(sdpa_model):
    ids, mask = left_padded()
    ig = qgraph.instrument(sdpa_model, values={"layers.0.linear_attn.states": {}, "layers.1.linear_attn.state":
                                               {"positions": [3, -1], "heads": [1]}})
    want = param_grads(sdpa_model, lambda: token_loss(sdpa_model(input_ids=ids, attention_mask=mask).logits, mask))
    got = param_grads(sdpa_model, lambda: token_loss(ig(input_ids=ids, attention_mask=mask).logits, mask))
    assert worst_param_difference(got, want) <= TOLERANCE


@pytest.mark.compat
def test_param_grads_with_two_images_equal_hf(processor, vl_model):
    inputs = processor(text=prompt(processor, 2), images=[image(64, 64, 0), image(40, 100, 1)])
    mask = inputs["attention_mask"]
    ig = qgraph.instrument(vl_model, values=["vision.layers.1.layer_output", "layers.0.layer_output"])
    want = param_grads(vl_model, lambda: token_loss(vl_model(**inputs).logits, mask))
    got = param_grads(vl_model, lambda: token_loss(ig(**inputs).logits, mask))
    vision = [name for name in want if ".visual." in name]
    assert vision and all(want[name].abs().max() > 0 for name in vision)
    assert worst_param_difference(got, want) <= TOLERANCE


@pytest.mark.slow  # it compiles with inductor: the slow tier
def test_compiled_program_grads_equal_the_eager_programs(sdpa_model):
    ids, mask = left_padded(seq=20)
    values = ["layers.*.layer_output"]
    eager = qgraph.instrument(sdpa_model, values=values)
    # dynamo's capture and AOTAutograd's joint graph (where the custom ops' fakes and backwards are
    # used) without inductor's codegen, which compiles for a minute cold and does not see inside them
    compiled = qgraph.instrument(sdpa_model, values=values, compile={"backend": "aot_eager"})

    def loss(ig):
        out = ig(input_ids=ids, attention_mask=mask)
        return token_loss(out.logits, mask) + out["layers.1.layer_output"].mean()

    want = param_grads(sdpa_model, lambda: loss(eager))
    graphs = counters["stats"]["unique_graphs"]
    got = param_grads(sdpa_model, lambda: loss(compiled))
    assert counters["stats"]["unique_graphs"] > graphs  # the compiled program ran, with grad enabled
    assert worst_param_difference(got, want) <= TOLERANCE

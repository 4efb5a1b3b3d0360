"""The Qwen sparse MoE block, shared by the mixture-of-experts families (``qwen3_5_moe``, ``qwen3_next``).

The block replaces the dense MLP: a router (``mlp.gate``: linear, softmax, top-k, the top-k weights
renormalised), routed experts stored as 3-D tensors (``mlp.experts.gate_up_proj`` [experts 2*inner
hidden], ``down_proj`` [experts hidden inner]), a shared expert (``mlp.shared_expert``, a SwiGLU
MLP) and its gate (``mlp.shared_expert_gate``, a linear to one number per token, through a sigmoid):

    mlp_output = experts_output + sigmoid(shared_expert_gate) * shared_expert_output

While exporting (``patches``), the block and its router keep the ``[batch seq hidden]`` shape instead
of flattening the tokens (so every value keeps its layout; a linear on 3-D computes the same numbers),
the router's renormalisation is out of place (the top-k weights stay a value of their own), the block
spreads the top-k weights to one weight per expert (``expert_weights``, zero where not routed) and
runs the routed experts as the one op ``qgraph::moe_experts``: one program for every prompt, with
the router and the shared expert as visible nodes. The op runs the experts module's own experts
implementation (its config's, read while tracing: ``compat.experts_implementation_run``), so the
logits are the HF forward's bit for bit under each; switching it rebuilds the program.
"""
from __future__ import annotations

import contextlib

import torch

from .. import compat
from ..errors import UnsupportedModel
from .base import DimSource
from .rules import Port, Routing, ValueSpec

RESIDUAL = "Residual [batch seq hidden_size]"

HOSTS = {"shared_expert": "layers.{i}.mlp.shared_expert"}

# The program computes logits, not the router's load-balancing loss (a config may ask for it)
FORWARD_KWARGS = {"output_router_logits": False}

DIMS: dict[str, DimSource] = {
    "num_experts": "num_experts",
    "top_k": "num_experts_per_tok",
    "expert_intermediate_size": "moe_intermediate_size",
    "shared_intermediate_size": "shared_expert_intermediate_size",
}
EXPERTS_DOWN = "experts.down_proj"  # the routed experts' down projection [experts hidden inner], below the MLP

VALUES = (
    ValueSpec("router_logits", "mlp", "RouterLogits [batch seq num_experts]",
              "The router's logits, before its softmax and top-k (edit them to force or forbid routing)",
              Routing("logits")),
    ValueSpec("router_weights", "mlp", "Routing [batch seq top_k]",
              "The top-k experts' weights, after the renormalisation", Routing("weights")),
    ValueSpec("router_indices", "mlp", "Routing [batch seq top_k]",
              "Which experts each token is routed to (int64), in the top-k's order; read-only", Routing("indices")),
    ValueSpec("expert_weights", "mlp", "ExpertWeights [batch seq num_experts]",
              "Each expert's weight for each token: router_weights spread over the experts, zero where not "
              "routed (Zero(experts=[j]) removes expert j's contribution, rerouting nothing)",
              Routing("expert_weights")),
    ValueSpec("experts_neurons", "mlp", "ExpertNeurons [batch seq top_k expert_intermediate_size]",
              "What each of a token's top-k experts' down projection receives, act(gate) * up, in router_indices' "
              "order (expert j's tokens: experts_neurons[router_indices == j]); asking splits the experts op "
              "into two that run transformers' eager experts loop (whatever the model's experts implementation)",
              Routing("neurons")),
    ValueSpec("experts_output", "mlp", RESIDUAL, "The routed experts' weighted sum", Port("experts", "output")),
    ValueSpec("shared_expert_output", "mlp", RESIDUAL, "The shared expert's output, before its gate",
              Port("shared_expert", "output")),
    ValueSpec("shared_expert_gate", "mlp", "Gate [batch seq 1]", "The shared expert's gate, before the sigmoid",
              Port("shared_expert_gate", "output")),
    ValueSpec("mlp_output", "mlp", RESIDUAL,
              "What the MLP adds to the residual stream: experts_output + sigmoid(shared_expert_gate) * "
              "shared_expert_output", Port("", "output")),
    ValueSpec("mlp_activation", "shared_expert", "Neurons [batch seq shared_intermediate_size]",
              "The shared expert's activation function output", Port("act_fn", "output")),
    ValueSpec("mlp_neurons", "shared_expert", "Neurons [batch seq shared_intermediate_size]",
              "What the shared expert's down projection receives: act(gate) * up", Port("down_proj", "input")),
)


# The dense MLP's TransformerLens hooks the MoE block has no one value for, and what it has instead
ALIAS_INSTEAD = {
    "blocks.{i}.mlp.hook_post": (
        "The MoE block has no single layer of neurons: ask for layers.{i}.mlp.experts_neurons (what each of a "
        "token's top-k routed experts' down projection receives, [batch seq top_k expert_intermediate_size]) or "
        "layers.{i}.mlp.shared_expert.mlp_neurons (the shared expert's, [batch seq shared_intermediate_size]); "
        "blocks.{i}.hook_mlp_out is the block's output, layers.{i}.mlp.mlp_output"),
}


def is_block(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("gate", "experts", "shared_expert", "shared_expert_gate"))


@contextlib.contextmanager
def patches(model):
    """While exporting: every sparse MoE block keeps its tokens' shape and runs its routed experts
    as ``qgraph::moe_experts`` under their experts implementation (the classes' forwards are restored
    afterwards)."""
    from ..kernels.experts import ACTIVATIONS  # lazy: registers the op's kernels on first use
    activation = model.config.get_text_config().hidden_act
    if activation not in ACTIVATIONS:
        raise UnsupportedModel(f"the experts' activation {activation!r} is not one qgraph's experts op runs "
                               f"({', '.join(ACTIVATIONS)})")
    found = [module for module in model.modules() if is_block(module)]
    for block in found:  # an implementation the op cannot run is refused before tracing
        compat.experts_implementation_run(block.experts)
    forwards = {**{type(block): _block_forward for block in found},
                **{type(block.gate): _router_forward for block in found},
                **{type(block.experts): _experts_forward(activation) for block in found}}
    saved = {cls: cls.forward for cls in forwards}
    for cls, forward in forwards.items():
        cls.forward = forward
    try:
        yield
    finally:
        for cls, forward in saved.items():
            cls.forward = forward


def _block_forward(self, hidden_states):
    """The sparse MoE block's forward, as transformers computes it, on ``[batch seq hidden]``."""
    shared = self.shared_expert(hidden_states)
    _, weights, indices = self.gate(hidden_states)
    expert_weights = weights.new_zeros(*weights.shape[:-1], self.experts.gate_up_proj.shape[0])
    expert_weights = expert_weights.scatter(-1, indices, weights)
    routed = self.experts(hidden_states, indices, expert_weights)
    shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
    return routed + shared


def _router_forward(self, hidden_states):
    """The top-k router's forward, as transformers computes it, on ``[batch seq hidden]``."""
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    probabilities = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    weights, indices = torch.topk(probabilities, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Qwen3-Next's config may turn it off; Qwen3.5's always has it
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return router_logits, weights.to(router_logits.dtype), indices


def _experts_forward(activation: str):
    def forward(self, hidden_states, indices, expert_weights):
        return torch.ops.qgraph.moe_experts(hidden_states, indices, expert_weights, self.gate_up_proj,
                                            self.down_proj, activation, compat.experts_implementation_run(self))
    return forward

"""Qwen3.5 / Qwen3.6 text (``Qwen3_5ForCausalLM``; the text of ``Qwen3_5ForConditionalGeneration``).

Llama's pre-norm block with a hybrid mixer: three blocks in four carry a gated DeltaNet
(``linear_attn``), the fourth gated attention (``self_attn``), as ``config.layer_types`` says.
Every RMSNorm but the DeltaNet's own multiplies by ``1 + weight``.
"""
from .rules import Attention, DeltaRule, Derived, Port, ProgramInput, ProgramOutput, ProjectionHalf, ValueSpec

NAME = "qwen3_5_text"
MODEL_TYPES = ("qwen3_5_text",)

# Where the export finds the delta-rule kernels (module-level functions the mixer calls).
KERNEL_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
DELTA_RULE_KERNELS = {"chunk": "torch_chunk_gated_delta_rule", "recurrent": "torch_recurrent_gated_delta_rule"}

# Module paths as the spec names them: the text stack's prefix drops, the vision tower is "vision".
# Applied in order, first match wins; a path that becomes "" has no ports (the wrappers).
MODULE_PREFIXES = (
    ("model.language_model.", ""),
    ("model.visual.merger", "projector"),
    ("model.visual.", "vision."),
    ("model.", ""),
)
NO_PORTS = ("", "model", "model.language_model", "model.visual")

# The final norm and the unembedding, by their spec names (project_on_vocab)
READOUT = ("norm", "lm_head")
# config.layer_types entry -> the mixer module a block of that kind carries
MIXERS = {"linear_attention": "linear_attn", "full_attention": "self_attn"}

# Layout dim -> config attribute (batch, seq, query and key are the call's own sizes)
DIMS = {
    "hidden_size": "hidden_size",
    "vocab_size": "vocab_size",
    "intermediate_size": "intermediate_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "qk_head_dim": "head_dim",
    "key_heads": "linear_num_key_heads",
    "value_heads": "linear_num_value_heads",
    "key_dim": "linear_key_head_dim",
    "value_dim": "linear_value_head_dim",
}

RESIDUAL = "Residual [batch seq hidden_size]"

VALUES = (
    # the model
    ValueSpec("logits", "model", "Logits [batch seq vocab_size]",
              "The logits the model returns", ProgramOutput("logits")),
    ValueSpec("token_embeddings", "model", RESIDUAL,
              "The embedding module's output; layers.0.layer_input is what enters the first block",
              Port("embed_tokens", "output")),
    ValueSpec("final_norm_output", "model", RESIDUAL,
              "The residual stream after the final norm, what lm_head reads", Port("norm", "output")),
    ValueSpec("lm_head_output", "model", "Logits [batch seq vocab_size]",
              "The head's logits before anything the model does past lm_head", Port("lm_head", "output")),
    ValueSpec("next_token_probs", "model", "NextTokenProbs [batch vocab_size]",
              "The next-token distribution at the last position; derived, read-only",
              Derived("logits", "last_position_softmax")),
    ValueSpec("input_ids", "model", "Tokens [batch seq]",
              "The token ids the model was called with", ProgramInput("input_ids")),
    ValueSpec("attention_mask", "model", "Tokens [batch seq]",
              "The attention mask the model was called with; zeros are padding", ProgramInput("attention_mask")),
    ValueSpec("input_size", "model", "Size [2]",
              "(batch, seq) of the current call; read-only", Derived("input_ids", "size")),
    # every block
    ValueSpec("layer_input", "layer", RESIDUAL, "The residual stream entering the block", Port("", "input")),
    ValueSpec("attention_norm_output", "layer", RESIDUAL, "The normed stream entering the mixer",
              Port("input_layernorm", "output")),
    ValueSpec("layer_mid", "layer", RESIDUAL, "The residual stream after the mixer's add",
              Port("post_attention_layernorm", "input")),
    ValueSpec("mlp_norm_output", "layer", RESIDUAL, "The normed stream entering the MLP",
              Port("post_attention_layernorm", "output")),
    ValueSpec("mlp_input", "layer", RESIDUAL, "What the MLP is called with", Port("mlp", "input")),
    ValueSpec("layer_output", "layer", RESIDUAL, "The residual stream leaving the block", Port("", "output")),
    # the gated DeltaNet
    ValueSpec("attention_queries", "linear_attn", "LinearQK [batch seq key_heads key_dim]",
              "The queries entering the delta rule, before its l2 norm and 1/sqrt(key_dim) scale",
              DeltaRule("queries")),
    ValueSpec("attention_keys", "linear_attn", "LinearQK [batch seq key_heads key_dim]",
              "The keys entering the delta rule, before its l2 norm", DeltaRule("keys")),
    ValueSpec("attention_values", "linear_attn", "LinearV [batch seq value_heads value_dim]",
              "The values entering the delta rule", DeltaRule("values")),
    ValueSpec("decays", "linear_attn", "Gates [batch seq value_heads]",
              "The per-token log decay of the recurrent state", DeltaRule("decays")),
    ValueSpec("betas", "linear_attn", "Gates [batch seq value_heads]",
              "The per-token write strength into the state", DeltaRule("betas")),
    ValueSpec("state_input", "linear_attn", "State [batch value_heads key_dim value_dim]",
              "The recurrent state entering the layer (zeros at the start of a prompt)", DeltaRule("state_input")),
    ValueSpec("attention_head_outputs", "linear_attn", "LinearV [batch seq value_heads value_dim]",
              "The per-head outputs before the gated norm and the output projection", DeltaRule("head_outputs")),
    ValueSpec("state_output", "linear_attn", "State [batch value_heads key_dim value_dim]",
              "The recurrent state leaving the layer", DeltaRule("state_output")),
    ValueSpec("attention_output", "linear_attn", RESIDUAL,
              "What the mixer adds to the residual stream", Port("", "output")),
    # the gated attention
    ValueSpec("attention_queries", "self_attn", "Queries [batch num_heads seq qk_head_dim]",
              "The queries entering attention, after q_norm and the rotary", Attention("queries")),
    ValueSpec("attention_keys", "self_attn", "Keys [batch num_kv_heads seq qk_head_dim]",
              "The keys entering attention, after k_norm and the rotary", Attention("keys")),
    ValueSpec("attention_values", "self_attn", "Values [batch num_kv_heads seq head_dim]",
              "The values entering attention", Attention("values")),
    ValueSpec("attention_scores", "self_attn", "Pattern [batch num_heads query key]",
              "The attention scores entering the softmax, masked", Attention("scores")),
    ValueSpec("attention_probabilities", "self_attn", "Pattern [batch num_heads query key]",
              "The attention pattern the values are mixed with", Attention("probabilities")),
    ValueSpec("attention_head_outputs", "self_attn", "HeadOutputs [batch seq num_heads head_dim]",
              "The per-head outputs before the sigmoid gate and the output projection", Attention("head_outputs")),
    ValueSpec("attention_gate", "self_attn", "HeadOutputs [batch seq num_heads head_dim]",
              "Each head's gate half of q_proj's output, before the sigmoid", ProjectionHalf("q_proj", 1)),
    ValueSpec("attention_premix", "self_attn", "HeadOutputs [batch seq num_heads head_dim]",
              "Every head's gated output side by side, as the output projection takes it",
              Port("o_proj", "input", split_heads=("num_heads", "head_dim"))),
    ValueSpec("attention_output", "self_attn", RESIDUAL,
              "What the attention adds to the residual stream", Port("", "output")),
    # the MLP
    ValueSpec("mlp_activation", "mlp", "Neurons [batch seq intermediate_size]",
              "The activation function's output", Port("act_fn", "output")),
    ValueSpec("mlp_neurons", "mlp", "Neurons [batch seq intermediate_size]",
              "What the down projection receives: act(gate) * up", Port("down_proj", "input")),
    ValueSpec("mlp_output", "mlp", RESIDUAL, "What the MLP adds to the residual stream", Port("", "output")),
)

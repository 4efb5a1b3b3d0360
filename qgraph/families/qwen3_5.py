"""Qwen3.5 / Qwen3.6 (``Qwen3_5ForCausalLM``, and the image-text ``Qwen3_5ForConditionalGeneration``).

Llama's pre-norm block with a hybrid mixer: three blocks in four carry a gated DeltaNet
(``linear_attn``), the fourth gated attention (``self_attn``), as ``config.layer_types`` says.
Every RMSNorm but the DeltaNet's own multiplies by ``1 + weight``. The image-text model adds the
Qwen ViT (``qwen_vision``) and M-RoPE position ids (three rows: time, height, width).
"""
from .base import DimSource, Family, Kernels, Memory, Mixer, RepeatedBlocks
from .qwen_vision import IMAGES
from .registry import register_family
from .rules import (HEADS, Attention, ConvContext, DeltaRule, DeltaRuleReads, DeltaRuleStates, DeltaRuleWrites, Derived,
                    Port, ProgramInput, ProgramOutput, ProjectionHalf, ValueSpec)

# Module paths as the spec names them: the text stack's prefix drops, the vision tower is "vision"
# with its blocks' modules named like the text blocks', its merger is "projector". The first
# matching pattern renames.
MODULE_RENAMES = (
    (r"^model\.language_model\.", ""),
    (r"^model\.visual\.merger", "projector"),
    (r"^model\.visual\.blocks\.(\d+)\.norm1", r"vision.layers.\1.input_layernorm"),
    (r"^model\.visual\.blocks\.(\d+)\.norm2", r"vision.layers.\1.post_attention_layernorm"),
    (r"^model\.visual\.blocks\.(\d+)\.attn", r"vision.layers.\1.self_attn"),
    (r"^model\.visual\.blocks", "vision.layers"),
    (r"^model\.visual\.", "vision."),
    (r"^model\.visual$", "vision"),
    (r"^model\.", ""),
)

# config.layer_types entry -> the mixer a block of that kind carries, and what it carries from one
# decoding step to the next: the attention's keys and values grow; the DeltaNet carries its
# recurrent state and its causal conv's left context
MIXERS = {
    "linear_attention": Mixer("linear_attn", "gated DeltaNet", (
        Memory("state", ("value_heads", "key_dim", "value_dim"), ("state_input", "state_output"), float32=True),
        Memory("conv", ("conv_dim", "conv_context"), ("conv_state_input", "conv_state_output"))),
        heads=("out_proj", "value_heads")),  # its value heads, through the gated norm (per head) and out_proj
    "full_attention": Mixer("self_attn", "gated attention", (
        Memory("keys", ("num_kv_heads", "past", "head_dim")),
        Memory("values", ("num_kv_heads", "past", "head_dim"))),
        heads=("o_proj", "num_heads")),  # its gated heads, through o_proj
}
# Where each kind of host lives: {i} runs over the text blocks (a mixer only on blocks that have it);
# the vision tower's hosts are its image part's (qwen_vision.IMAGES).
HOSTS = {
    "model": "",
    "layer": "layers.{i}",
    "linear_attn": "layers.{i}.linear_attn",
    "self_attn": "layers.{i}.self_attn",
    "mlp": "layers.{i}.mlp",
}

# Layout dim -> config attribute of the text config, or a function of the model's config
# (batch, seq, query and key are the call's own sizes; the vision tower's dims are qwen_vision's)
DIMS: dict[str, DimSource] = {
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
    "conv_dim": lambda config: _conv_dim(config.get_text_config()),
    "conv_context": lambda config: config.get_text_config().linear_conv_kernel_dim - 1,
}


def _conv_dim(text) -> int:
    return (2 * text.linear_num_key_heads * text.linear_key_head_dim
            + text.linear_num_value_heads * text.linear_value_head_dim)


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
              "The next-token distribution after each row's last real token (the last position the "
              "attention mask keeps, so right padding is skipped); derived, read-only",
              Derived(("logits",), "last_position_softmax")),
    ValueSpec("input_ids", "model", "Tokens [batch seq]",
              "The token ids the model was called with", ProgramInput("input_ids")),
    ValueSpec("attention_mask", "model", "Tokens [batch seq]",
              "The attention mask the model was called with; zeros are padding", ProgramInput("attention_mask")),
    ValueSpec("input_size", "model", "Size [2]",
              "(batch, seq) of the current call; read-only", Derived(("input_ids",), "size")),
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
    ValueSpec("states", "linear_attn", "States [batch seq value_heads key_dim value_dim]",
              "The recurrent state after every token; options: dtype=torch.bfloat16, heads=[...]; read-only",
              DeltaRuleStates(at_positions=False)),
    ValueSpec("state", "linear_attn", "State [batch positions value_heads key_dim value_dim]",
              "The recurrent state after the tokens at positions=[...] (required option; also dtype=, heads=); "
              "read-only", DeltaRuleStates(at_positions=True)),
    ValueSpec("effective_attention", "linear_attn", "Pattern [batch value_heads query key]",
              "The delta rule read as attention, exactly: head_outputs = A @ values + initial_state_output, "
              "A[t, s] = beta_s k_s^T M_{s+1}..M_t q_t with M_r = exp(g_r)(I - beta_r k_r k_r^T); causal, float32; "
              "an edit makes the block read A' @ values + initial_state_output", DeltaRuleReads("attention")),
    ValueSpec("initial_state_output", "linear_attn", "LinearV [batch seq value_heads value_dim]",
              "What the initial state (state_input) adds to the head outputs, the part effective_attention leaves "
              "out (zeros on a plain prompt); float32, read-only", DeltaRuleReads("initial_state")),
    ValueSpec("write_values", "linear_attn", "LinearV [batch seq value_heads value_dim]",
              "What each token writes into the state along its key, beta_t (v_t - S^T k_t) with S the decayed "
              "state before it; edits apply inside the recurrence (region edits only); float32", DeltaRuleWrites()),
    ValueSpec("conv_state_input", "linear_attn", "ConvState [batch conv_dim conv_context]",
              "The causal conv's left context: zeros at a prompt's start; give a previous call's "
              "conv_state_output (with its state_output as state_input) to continue it", ConvContext("input")),
    ValueSpec("conv_state_output", "linear_attn", "ConvState [batch conv_dim conv_context]",
              "The conv input's last conv_kernel - 1 columns (mixed q, k, v before the conv): the next "
              "call's conv_state_input", ConvContext("output")),
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
              Port("o_proj", "input", view=HEADS)),
    ValueSpec("attention_output", "self_attn", RESIDUAL,
              "What the attention adds to the residual stream", Port("", "output")),
    # the MLP
    ValueSpec("mlp_activation", "mlp", "Neurons [batch seq intermediate_size]",
              "The activation function's output", Port("act_fn", "output")),
    ValueSpec("mlp_neurons", "mlp", "Neurons [batch seq intermediate_size]",
              "What the down projection receives: act(gate) * up", Port("down_proj", "input")),
    ValueSpec("mlp_output", "mlp", RESIDUAL, "What the MLP adds to the residual stream", Port("", "output")),
)

# TransformerLens hook names -> the value each is, by host kind: a block's mixer is its attention
# ("attn"), so hook_attn_out is either mixer's output and hook_z either's per-head outputs (the
# attention's before its sigmoid gate); the scores only attention blocks have, the pattern a DeltaNet's
# effective attention. The first name of a value is the one qgraph writes it under (a capture's SAELens
# columns: values.aliases.tl_names); SAE and transcoder files are read with every name here.
# Around the norms and the MLP, as the transcoders trained on these hooks read them:
# * hook_mlp_in is TransformerLens's copy of the stream its block hands the MLP's norm (ln2): the
#   residual stream after the mixer's add, hook_resid_mid's value under another name: layer_mid.
# * ln1/ln2.hook_normalized are the normed streams before the norms' weights; TransformerLens folds those
#   weights into the next weights when it loads a model (fold_ln, its default), so there each is what the
#   mixer / the MLP is called with, and qgraph reads them (the transcoders trained on ln2's too) as
#   attention_norm_output / mlp_input. (Unfolded, each would be that divided by the norm's weight, a
#   value qgraph does not name.)
# * mlp.hook_in / mlp.hook_out are circuit-tracer's hooks around the MLP: what it is called with, what it adds.
# Left out as not one value: attn.hook_q/k/v (before the rotary, and [batch seq heads dim]).
ALIASES = {
    "hook_embed": {"model": "token_embeddings"},
    "blocks.{i}.hook_resid_pre": {"layer": "layer_input"},
    "blocks.{i}.ln1.hook_normalized": {"layer": "attention_norm_output"},
    "blocks.{i}.hook_resid_mid": {"layer": "layer_mid"},
    "blocks.{i}.hook_mlp_in": {"layer": "layer_mid"},
    "blocks.{i}.ln2.hook_normalized": {"layer": "mlp_input"},
    "blocks.{i}.mlp.hook_in": {"layer": "mlp_input"},
    "blocks.{i}.hook_resid_post": {"layer": "layer_output"},
    "blocks.{i}.hook_attn_out": {"self_attn": "attention_output", "linear_attn": "attention_output"},
    "blocks.{i}.attn.hook_z": {"self_attn": "attention_head_outputs", "linear_attn": "attention_head_outputs"},
    "blocks.{i}.attn.hook_attn_scores": {"self_attn": "attention_scores"},
    "blocks.{i}.attn.hook_pattern": {"self_attn": "attention_probabilities", "linear_attn": "effective_attention"},
    "blocks.{i}.hook_mlp_out": {"mlp": "mlp_output"},
    "blocks.{i}.mlp.hook_out": {"mlp": "mlp_output"},
    "blocks.{i}.mlp.hook_post": {"mlp": "mlp_neurons"},
}


# transformers before 5.23 (5.9 among them) chooses the DeltaNet's padding mask in the text model's
# ``_update_linear_attn_mask`` with ``torch.all(attention_mask == 1)`` in Python (None when every token
# is real), which export cannot follow; 5.23 builds it with ``create_recurrent_attention_mask``. While
# exporting, the mask is kept as given: the DeltaNet multiplies its inputs by it, and by ones is the
# same number, so the values are those of the skipped mask.
def _padding_mask_as_given(self, attention_mask, past_key_values):
    if past_key_values is not None and past_key_values.has_previous_state():
        return None
    return attention_mask


QWEN3_5 = register_family(Family(
    name="qwen3_5_text",
    model_types=("qwen3_5_text",),
    classes="Qwen3_5ForCausalLM and Qwen3_5ForConditionalGeneration",
    values=VALUES,
    hosts=HOSTS,
    mixers=MIXERS,
    block_kinds="layer_types",
    dims=DIMS,
    module_renames=MODULE_RENAMES,
    no_ports=("", "model", "model.language_model"),
    readout=("norm", "lm_head"),
    rotary="rotary_emb",
    position_rows=3,
    kernels=Kernels("transformers.models.qwen3_5.modeling_qwen3_5",
                    chunk="torch_chunk_gated_delta_rule", recurrent="torch_recurrent_gated_delta_rule"),
    repeated_blocks=(RepeatedBlocks("model.layers", "layer_types"),
                     RepeatedBlocks("model.language_model.layers", "layer_types")),
    aliases=ALIASES,
    cache_indices=("layer_idx",),  # transformers 5.25 passes it to the conv's cache lookup, with no cache
    export_methods={"_update_linear_attn_mask": _padding_mask_as_given},
).with_images(IMAGES))

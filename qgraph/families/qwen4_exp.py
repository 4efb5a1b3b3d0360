"""Qwen3.8-Flash-Next, "a Qwen4 prototype" (``Qwen4ExpForCausalLM``, and the image-text
``Qwen4ExpForConditionalGeneration`` with Qwen3.5's vision tower; text model_type ``qwen4_exp_text``).

Qwen3.5-MoE's hybrid taken further. Its blocks (gated DeltaNet on ``linear_attention`` blocks, gated
attention with a sparse token selection on ``indexed_attention`` blocks, the sparse MoE block of
``qwen_moe`` on every block) read and write a residual stream ``hc_count`` streams wide:

* **Hyper-connections** replace the pre-norms. Before the mixer and before the MLP a mix
  (``attn_hyper_connection`` / ``mlp_hyper_connection``, named ``attention_mix`` / ``mlp_mix`` here)
  norms each stream (``hc_norm``), weighs it per channel (``mix_weights = sigmoid(up(silu(down(normed) /
  streams)))``) and averages the streams into what the mixer (the MLP) reads (``mixed_input``); the
  mixer's output is added back into every stream times its injection weight (``injection_weights =
  2 sigmoid(inject(normed) / streams)``). The embeddings enter as ``hc_count`` copies; after the last
  block the final mix (``hyper_connection_mixer``, ``final_mix``) collapses the streams into what
  ``lm_head`` reads. There is no final norm: ``final_norm_output`` is the final mix's output.
  ``layer_input`` / ``layer_output`` (TransformerLens's ``hook_resid_pre`` / ``hook_resid_post``) are
  the streams, ``[batch seq streams hidden_size]``.
* **Per-layer n-gram embeddings** (``ple``, on the blocks of ``ple_layer_ids``, one-indexed): hashed
  2..``ngram_size``-gram embeddings of the token ids gate a value per stream, then a dilated depthwise conv;
  its output is added to the streams before the block's mix (``ple_output``). Each order's embeddings are
  looked up apart (``heads_per_ngram`` hash heads each), so they are a value apart (``ngram_embeddings``).
* **QSA**: the attention's indexer pools keys in blocks and each query keeps its best blocks and the
  incomplete tail. transformers selects in a Python loop over rows and queries with data-dependent
  shapes; while exporting, ``_select_tokens`` runs ``select_tokens`` (``kernels.qsa``: the same
  selection vectorized, then the one ``qgraph::qsa_select`` node), so one program serves every prompt.

The export traces the first block of each kind and repeats it, as for Qwen3.5; a PLE block differs from its
kind's first block (a module more), so it is traced as a variant of its own (``qgraph.export.variants``).
A decoding step carries what HF's cache holds: beyond Qwen3.5's, each indexer's keys (``MIXERS``) and each
PLE layer's token and conv contexts (``PLE_MEMORY``); the rotary reads every position so far.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import replace

import torch

from ..kernels import qsa
from . import qwen_moe
from .base import Memory, Mixer
from .qwen3_5 import DIMS as QWEN3_5_DIMS
from .qwen3_5 import VALUES as QWEN3_5_VALUES
from .qwen3_5 import MIXERS as QWEN3_5_MIXERS
from .qwen3_5 import MODULE_RENAMES as QWEN3_5_RENAMES
from .qwen3_5_moe import QWEN3_5_MOE
from .qwen_vision import IMAGES
from .registry import register_family
from .rules import STREAMS, Applied, PaddedContext, Port, Selection, ValueSpec

# Module paths as the spec names them: the hyper-connections are the mixes they compute
MODULE_RENAMES = (
    (r"^model\.(?:language_model\.)?layers\.(\d+)\.attn_hyper_connection", r"layers.\1.attention_mix"),
    (r"^model\.(?:language_model\.)?layers\.(\d+)\.mlp_hyper_connection", r"layers.\1.mlp_mix"),
    (r"^model\.(?:language_model\.)?hyper_connection_mixer", "final_mix"),
    *QWEN3_5_RENAMES,  # the text stack's prefix, and the vision tower's as Qwen3.5 names it
)

# what a decoding step carries: the DeltaNet's state and conv context; the attention's keys and values, and its
# indexer's keys with them (a query's blocks pool every key it sees, cached ones included)
MIXERS = {
    "linear_attention": QWEN3_5_MIXERS["linear_attention"],
    "indexed_attention": Mixer("self_attn", "gated attention with QSA", (
        Memory("keys", ("num_kv_heads", "past", "head_dim")),
        Memory("values", ("num_kv_heads", "past", "head_dim")),
        Memory("index_keys", ("past", "index_dim"), grows="index_keys")),
        heads=("o_proj", "num_heads")),
}


def _eos(config) -> int:
    """The id the PLE layers pad a token history with (the model's first eos id)."""
    eos = config.get_text_config().eos_token_id
    return eos[0] if isinstance(eos, list) else eos


# and on each PLE layer: the last token ids its n-gram hashes read back (eos before a prompt, as the model pads
# them), and its dilated conv's left context
PLE_MEMORY = (
    Memory("ngram_context", ("ngram_context",), ("ngram_context_input", "ngram_context_output"), fill_id=_eos),
    Memory("conv", ("ple_channels", "ple_conv_context"), ("conv_state_input", "conv_state_output")),
)

HOSTS = {
    "model": "",
    "final_mix": "final_mix",
    "layer": "layers.{i}",
    "ple": "layers.{i}.ple",
    "attention_mix": "layers.{i}.attention_mix",
    "mlp_mix": "layers.{i}.mlp_mix",
    "linear_attn": "layers.{i}.linear_attn",
    "self_attn": "layers.{i}.self_attn",
    "mlp": "layers.{i}.mlp",
    **qwen_moe.HOSTS,
}


def _orders(config) -> int:
    """The PLE's n-gram orders: 2 to ``ngram_size``."""
    return config.get_text_config().ngram_size - 1


def _ngram_dim(config) -> int:
    """The width of one n-gram head's embedding (the PLE embedding's width split over every order's heads)."""
    text = config.get_text_config()
    return text.ple_embed_dim // (_orders(config) * text.heads_per_ngram)


DIMS = {**{name: source for name, source in QWEN3_5_DIMS.items() if name != "intermediate_size"}, **qwen_moe.DIMS,
        "streams": "hc_count", "index_heads": "indexer_n_heads", "index_dim": "indexer_head_dim",
        "orders": _orders, "ngram_heads": "heads_per_ngram", "ngram_dim": _ngram_dim,
        "order_dim": lambda config: config.get_text_config().heads_per_ngram * _ngram_dim(config),
        "ngram_context": _orders,  # the longest n-gram reads ngram_size - 1 tokens back
        "ple_channels": lambda config: config.get_text_config().hc_count * config.get_text_config().hidden_size,
        "ple_conv_context": lambda config: _ple_conv_context(config.get_text_config())}


def _ple_conv_context(text) -> int:
    return (text.ple_conv_kernel_size - 1) * text.ngram_size  # (kernel - 1) taps, dilated by the n-gram size

RESIDUAL = "Residual [batch seq hidden_size]"
STREAMED = "Streams [batch seq streams hidden_size]"


def _mix_values(host: str, what: str, injects: bool) -> tuple[ValueSpec, ...]:
    """A hyper-connection's values: the normed streams, its mix weights, what it hands ``what``, and
    (before a mixer or the MLP) the weights its output is added back into each stream with."""
    values = (
        ValueSpec("normed_streams", host, STREAMED, "Each stream after the mix's RMSNorm (its hc_norm, per stream)",
                  Port("hc_norm", "output", view=STREAMS)),
        ValueSpec("mix_weights", host, STREAMED,
                  "Each stream's per-channel weight in the mix, sigmoid(up(silu(down(normed_streams) / streams)))",
                  Applied("input_mix_weight_up", "output", ("sigmoid",), view=STREAMS)),
        ValueSpec("mixed_input", host, RESIDUAL, f"What {what} reads: the mean over the streams of mix_weights * "
                  "normed_streams", Port("", "output")),
    )
    if not injects:
        return values
    return (*values, ValueSpec(
        "injection_weights", host, "Injection [batch seq streams]",
        f"The weight {what}'s output is added into each stream with, 2 sigmoid(inject(normed_streams) / streams)",
        Applied("block_inject_weight", "output", ("div", "sigmoid", "mul"))))


_SKIPPED = {("model", "final_norm_output"), ("layer", "attention_norm_output"), ("layer", "mlp_norm_output"),
            ("layer", "layer_input"), ("layer", "layer_mid"), ("layer", "layer_output")}
_MODEL = tuple(spec for spec in QWEN3_5_VALUES if spec.host == "model" and (spec.host, spec.name) not in _SKIPPED)
_LAYER = tuple(spec for spec in QWEN3_5_VALUES if spec.host == "layer" and (spec.host, spec.name) not in _SKIPPED)
_MIXER = tuple(spec for spec in QWEN3_5_VALUES if spec.host in ("linear_attn", "self_attn"))

VALUES = (
    *_MODEL,
    ValueSpec("final_norm_output", "model", RESIDUAL,
              "What lm_head reads: the final mix's collapse of the streams (there is no final norm: its per-stream "
              "norm takes the place)", Port("final_mix", "output")),
    *_mix_values("final_mix", "lm_head", injects=False),
    ValueSpec("layer_input", "layer", STREAMED, "The streams entering the block (before its PLE layer, if any)",
              Port("", "input", view=STREAMS)),
    ValueSpec("layer_mid", "layer", STREAMED, "The streams after the mixer's injection", Port("mlp_mix", "input",
                                                                                           view=STREAMS)),
    ValueSpec("layer_output", "layer", STREAMED, "The streams leaving the block", Port("", "output", view=STREAMS)),
    *_LAYER,
    ValueSpec("ngram_embeddings", "ple", "NGrams [batch seq orders ngram_heads ngram_dim]",
              "Each token's hashed n-gram embeddings, apart per order (the 2-gram ending at the token, then the "
              "3-gram, ...) and per hash head: what the PLE layer's projections read, flattened",
              Port("ple_embedding", "output", view=(("heads", "orders", "order_dim"), ("heads", "ngram_heads",
                                                                                       "ngram_dim")))),
    ValueSpec("ple_output", "ple", STREAMED, "What the per-layer n-gram embedding adds to each stream before the "
              "block's mix", Port("", "output", view=STREAMS)),
    ValueSpec("ngram_context_input", "ple", "NgramContext [batch ngram_context]",
              "The token ids before the call's first that the n-gram hashes read (eos at a prompt's start, as the "
              "model pads them); give a previous call's ngram_context_output to continue it",
              PaddedContext("ple_embedding", "input")),
    ValueSpec("ngram_context_output", "ple", "NgramContext [batch ngram_context]",
              "The last ngram_size - 1 token ids the n-gram hashes read (padding as eos): the next call's "
              "ngram_context_input", PaddedContext("ple_embedding", "output")),
    ValueSpec("conv_state_input", "ple", "ConvState [batch ple_channels ple_conv_context]",
              "The dilated conv's left context: zeros at a prompt's start; give a previous call's conv_state_output "
              "(with its ngram_context_output as ngram_context_input) to continue it", PaddedContext("", "input")),
    ValueSpec("conv_state_output", "ple", "ConvState [batch ple_channels ple_conv_context]",
              "The conv input's last (ple_conv_kernel_size - 1) * ngram_size columns (the normed gated values of "
              "every stream): the next call's conv_state_input", PaddedContext("", "output")),
    *_mix_values("attention_mix", "the mixer", injects=True),
    *_mix_values("mlp_mix", "the MLP", injects=True),
    *_MIXER,
    ValueSpec("block_scores", "self_attn", "BlockScores [batch query blocks]",
              "The indexer's score of each block of the row's keys for each query, sum over its heads of relu(q . "
              "pooled block key) / sqrt(index_dim); -inf where the block is not a complete block of the keys the "
              "query sees", Selection("scores")),
    ValueSpec("index_keys", "self_attn", "IndexKeys [batch seq index_dim]",
              "The indexer's key of each token (index_qk_proj's key part), before its blocks pool them: what a "
              "decoding step caches for the selection", Selection("keys")),
    ValueSpec("selected_tokens", "self_attn", "Selection [batch query key]",
              "The keys each query's attention may read: its indexer_budget / indexer_compress_ratio best blocks "
              "and the incomplete tail of the keys it sees (nothing on a padded query)", Selection("tokens")),
    *qwen_moe.VALUES,
)

# TransformerLens names are Qwen3.5's (the family's aliases, kept), where the streams are the residual stream
# (hook_resid_pre/mid/post are [batch seq streams hidden_size]); ln2.hook_normalized stays what the MLP is
# called with (the MLP mix's mixed_input); hook_attn_out / hook_mlp_out are what the mixer / the MLP writes,
# before each stream's injection weight. ln1.hook_normalized (attention_norm_output) names no value here:
# there is no input_layernorm, so on a model it is refused by name with the nearest value, and a file naming
# it is read as Qwen3.5's without a model
ALIAS_INSTEAD = {
    **qwen_moe.ALIAS_INSTEAD,
    "blocks.{i}.ln1.hook_normalized": (
        "These blocks have no input_layernorm: the nearest value is layers.{i}.attention_mix.mixed_input, what the "
        "mixer reads (each stream RMS-normed, weighed per channel and averaged: [batch seq hidden_size]); "
        "layers.{i}.attention_mix.normed_streams is the streams after that mix's per-stream norm"),
}


def select_tokens(self, hidden_states, q, raw_keys, full_cos, full_sin, attention_mask, **kwargs):
    """``Qwen4ExpTextQSAIndexer._select_tokens`` while exporting: the selection its loop makes, vectorized
    (``kernels.qsa``): the same ``[batch 1 query key]`` mask."""
    visible = (attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0)[:, 0]
    rotary = sys.modules[type(self).__module__].apply_rotary_pos_emb  # the model's own rotary
    scores = qsa.block_scores(q, raw_keys, full_cos, full_sin, visible, self.k_layernorm, rotary,
                              self.compress_ratio)
    return torch.ops.qgraph.qsa_select(scores, visible, self.compress_ratio, self.block_topk).unsqueeze(1)


def _ple_blocks(config) -> list[int]:
    return [layer - 1 for layer in config.get_text_config().ple_layer_ids]


MODELING = "transformers.models.qwen4_exp.modeling_qwen4_exp"


def _check(config) -> str | None:
    """transformers 5.23 and 5.24 select the sparse attention's tokens inside the indexer's forward, a loop export
    cannot follow; from 5.25 the selection is its own method (``_select_tokens``), which ``export_methods`` swaps
    for the vectorized one while exporting."""
    indexer = importlib.import_module(MODELING).Qwen4ExpTextQSAIndexer
    if hasattr(indexer, "_select_tokens"):
        return None
    import transformers  # loaded with the model: only its version is read
    return (f"transformers {transformers.__version__} selects the sparse attention's tokens inside the indexer's "
            f"forward, a Python loop torch.export cannot follow; qgraph reads qwen4_exp models with transformers 5.25 "
            f"or later, where the selection is a method of its own that qgraph replaces while exporting: pip install "
            f"'transformers>=5.25'")


# Qwen3.5-MoE's text family (its no_ports, rotary and M-RoPE rows, cache indices, the MoE block's export
# patches, forward arguments, TransformerLens aliases and experts_down) with this model's own tables
QWEN4_EXP = register_family(replace(
    QWEN3_5_MOE.without_images(),
    name="qwen4_exp_text",
    model_types=("qwen4_exp_text",),
    classes="Qwen4ExpForCausalLM and Qwen4ExpForConditionalGeneration",
    values=VALUES,
    hosts=HOSTS,
    mixers=MIXERS,
    dims=DIMS,
    module_renames=MODULE_RENAMES,
    readout=("final_mix", "lm_head"),
    kernels=replace(QWEN3_5_MOE.kernels, module=MODELING),
    check=_check,
    alias_instead=ALIAS_INSTEAD,
    export_methods={"_select_tokens": select_tokens},
    host_blocks={"ple": _ple_blocks},
    memory={"ple": PLE_MEMORY},
    rotary_reads_past=True,  # the indexer rotates each block of keys, cached ones too, at its first token's position
    # torch's contiguity checks on the indexer's pooled blocks (seq // indexer_compress_ratio of them) guard their
    # count against 0 and 1, so named dims fail ("not all values of seq satisfy seq >= 2 * ratio") and the export
    # would trace twice; those guards only pick strides, and the values equal HF's at every length (tested down to
    # one token)
    named_dims=False,
).with_images(IMAGES))

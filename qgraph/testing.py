"""Tiny random Qwen3.5 checkpoints, built from a config and saved with ``save_pretrained``.

Tests and the demo load them with ``from_pretrained``, so the real loading path runs; nothing is
ever downloaded.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

# A byte-level vocabulary: 256 byte tokens, then the specials the chat template uses.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]
VOCAB_SIZE = 272  # 256 bytes + specials, rounded up

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n"
    "{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_text_config(**overrides):
    """The config of the tiny text model: 4 blocks (3 DeltaNet + 1 attention), 2 key heads over
    4 value heads in the DeltaNet, partial rotary 0.25, 4 query heads over 2 key/value heads."""
    from transformers import Qwen3_5TextConfig
    settings = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=0, pad_token_id=0,
    )
    settings.update(overrides)
    return Qwen3_5TextConfig(**settings)


def tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges: every byte is a token, plus the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(sorted(byte_chars))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:], model_input_names=["input_ids", "attention_mask"])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3_5(path: str | os.PathLike, seed: int = 0, **config_overrides) -> Path:
    """Build the tiny random ``Qwen3_5ForCausalLM`` and its tokenizer, save both at ``path``.

    Norm gains are moved off zero (``1 + weight`` matters) and the weights are seeded, so the same
    seed always gives the same checkpoint. Returns the path, ready for ``from_pretrained``.
    """
    from transformers import Qwen3_5ForCausalLM
    path = Path(path)
    tokenizer = tiny_tokenizer()
    config = tiny_text_config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              **config_overrides)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                parameter.normal_(0.0, 0.3)  # the gain is 1 + weight (the gated norm's is weight)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cached_tiny_qwen3_5(cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny checkpoint in qgraph's cache dir, built on first use."""
    root = Path(cache_dir or os.environ.get("QGRAPH_CACHE") or Path.home() / ".cache" / "qgraph")
    path = root / "tiny-qwen3_5"
    if not (path / "config.json").exists():
        tiny_qwen3_5(path)
    return path

"""Tiny random Qwen3.5 checkpoints, built from a config and saved with ``save_pretrained``.

Tests and the demo load them with ``from_pretrained``, so the real loading path runs; nothing is
ever downloaded.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .saes.fixtures import write_qwen_scope, write_saelens, write_sparsify  # noqa: F401  (tiny random SAEs)
from .saes.fixtures import write_transcoders  # noqa: F401  (tiny random transcoders)
from .saes.fixtures import tiny_clt  # noqa: F401  (tiny random cross-layer transcoders)

# A byte-level vocabulary: 256 byte tokens, then the specials the chat template uses.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]
VOCAB_SIZE = 272  # 256 bytes + specials, rounded up

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
# Qwen3.5's template shape: content is a string or a list of {"type": "text"|"image"|"video"} items; the
# generation prompt closes an empty think block unless enable_thinking=True (as on 0.8B and 2B).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}" + IMAGE_PLACEHOLDER +
    "{% elif item['type'] == 'video' %}" + VIDEO_PLACEHOLDER +
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
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
    tokenizer = tiny_tokenizer()
    config = tiny_text_config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              **config_overrides)
    return _save(Qwen3_5ForCausalLM, config, path, seed, tokenizer)


def tiny_vision_config(**overrides) -> dict:
    """The tiny vision tower: 2 blocks of width 32, 2 heads, 16-pixel patches, 2x2 merge."""
    settings = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
                    spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64, in_channels=3,
                    deepstack_visual_indexes=[])
    settings.update(overrides)
    return settings


def tiny_qwen3_5_vl(path: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny random ``Qwen3_5ForConditionalGeneration`` (the tiny text model plus a 2-block
    vision tower) and save it with its image processor config and tokenizer at ``path``.

    Load the processor with ``load_processor(path)``.
    """
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    tokenizer = tiny_tokenizer()
    text = tiny_text_config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = Qwen3_5Config(text_config=text.to_dict(), vision_config=tiny_vision_config(), tie_word_embeddings=True,
                           **_image_token_ids(tokenizer))
    return _save(Qwen3_5ForConditionalGeneration, config, path, seed, tokenizer, image_processor=True)


# The tiny MoE block: 8 experts, top-2, each expert and the shared expert narrower than the dense MLP
# (config keyword arguments)
TINY_MOE: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48)


def tiny_qwen3_5_moe(path: str | os.PathLike, seed: int = 0, images: bool = False) -> Path:
    """Build the tiny random ``Qwen3_5MoeForCausalLM`` (the tiny text model's blocks with the MoE
    block of ``TINY_MOE``), or with ``images=True`` the image-text ``Qwen3_5MoeForConditionalGeneration``
    (plus the tiny vision tower and its image processor), and save it at ``path``."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration, \
        Qwen3_5MoeTextConfig
    tokenizer = tiny_tokenizer()
    settings = {key: value for key, value in tiny_text_config().to_dict().items()
                if key in Qwen3_5MoeTextConfig().to_dict() and key not in ("model_type", "architectures", "dtype")}
    text = Qwen3_5MoeTextConfig(**{**settings, **TINY_MOE, "eos_token_id": tokenizer.eos_token_id,
                                   "pad_token_id": tokenizer.pad_token_id})
    if not images:
        return _save(Qwen3_5MoeForCausalLM, text, path, seed, tokenizer)
    config = Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=tiny_vision_config(), tie_word_embeddings=True,
                              **_image_token_ids(tokenizer))
    return _save(Qwen3_5MoeForConditionalGeneration, config, path, seed, tokenizer, image_processor=True)


def tiny_qwen3_next(path: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny random ``Qwen3NextForCausalLM`` (the tiny text model's sizes, a 1-D rotary, the
    MoE block of ``TINY_MOE`` on every block) and save it at ``path``."""
    from transformers import Qwen3NextConfig
    from transformers import Qwen3NextForCausalLM
    tokenizer = tiny_tokenizer()
    dense = tiny_text_config()
    rope = {key: dense.rope_parameters[key] for key in ("rope_type", "rope_theta", "partial_rotary_factor")}
    config = Qwen3NextConfig(**{key: getattr(dense, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types", "max_position_embeddings",
        "tie_word_embeddings")}, **TINY_MOE, rope_parameters=rope, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    return _save(Qwen3NextForCausalLM, config, path, seed, tokenizer)


# The tiny Qwen3.8-Flash-Next (qwen4_exp) text model: the tiny text model's widths, 4 blocks (DeltaNet, QSA
# attention, DeltaNet with a PLE layer before it, QSA attention), 3 residual streams with a rank-16 mix, the MoE
# block of TINY_MOE, 2-gram and 3-gram PLE heads over small hashed tables (2 shards as saved), and an indexer
# whose budget (8 tokens: 2 blocks of 4) selects on any prompt past 11 tokens (config keyword arguments)
TINY_QWEN4_EXP: dict[str, Any] = dict(
    layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    hc_count=3, hc_lowrank=16, ple_layer_ids=[3], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=1000,
    make_ngram_vocab_size_divisible_by=16, split_ngram_parts=2, indexer_n_heads=2, indexer_kv_heads=1,
    indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, output_gate_type="sigmoid")


def tiny_qwen4_exp(path: str | os.PathLike, seed: int = 0, images: bool = False, **config_overrides) -> Path:
    """Build the tiny random ``Qwen4ExpForCausalLM`` (``TINY_QWEN4_EXP`` on the tiny text model's sizes), or
    with ``images=True`` the image-text ``Qwen4ExpForConditionalGeneration`` (plus the tiny vision tower and
    its image processor), and save it at ``path``. Every norm gain, the PLE conv (zeros at init) and the
    hyper-connections' mixes are drawn off their init, so each part moves the logits."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration, \
        Qwen4ExpTextConfig
    tokenizer = tiny_tokenizer()
    dense = tiny_text_config()
    text = Qwen4ExpTextConfig(**{key: getattr(dense, key) for key in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "linear_conv_kernel_dim", "rope_parameters", "max_position_embeddings")},
        **TINY_MOE, **{**TINY_QWEN4_EXP, **config_overrides}, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    drawn = ("norm_key.weight", "norm_query.weight", "norm_conv.weight", "ple.conv1d.weight", "hc_norm.weight")
    if not images:
        return _save(Qwen4ExpForCausalLM, text, path, seed, tokenizer, drawn=drawn)
    config = Qwen4ExpConfig(text_config=text.to_dict(), vision_config=tiny_vision_config(),
                            **_image_token_ids(tokenizer))
    return _save(Qwen4ExpForConditionalGeneration, config, path, seed, tokenizer, image_processor=True, drawn=drawn)


def _image_token_ids(tokenizer) -> dict:
    return {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}


def _save(model_class, config, path, seed: int, tokenizer, image_processor: bool = False,
          drawn: tuple[str, ...] = ()) -> Path:
    """Build ``model_class(config)`` seeded, with its text norm gains off zero and its routers spread
    (at their init std 0.02 every token would route nearly alike), and the parameters whose names end
    with one of ``drawn`` drawn like the norm gains, and save it with ``tokenizer``."""
    path = Path(path)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "visual" not in name and (name.endswith(("norm.weight", "layernorm.weight", *drawn))):
                parameter.normal_(0.0, 0.3)
            if name.endswith("mlp.gate.weight"):
                parameter.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if image_processor:
        from transformers import Qwen2VLImageProcessorPil
        Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                 size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128}).save_pretrained(path)
    return path


def load_processor(path: str | os.PathLike):
    """The checkpoint's processor: ``AutoProcessor.from_pretrained``, or where that cannot load (its
    video processor needs torchvision), ``ImageTextProcessor`` over the checkpoint's own image
    processor (the slow one where the fast needs torchvision) and tokenizer, loaded with ``from_pretrained``."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    try:
        return AutoProcessor.from_pretrained(path)
    except (ImportError, ValueError, AttributeError, OSError):
        try:
            images = AutoImageProcessor.from_pretrained(path)
        except ImportError:  # transformers before 5.15 maps the checkpoint's class to its torchvision backend
            import transformers
            named = json.loads((Path(path) / "preprocessor_config.json").read_text())["image_processor_type"]
            images = getattr(transformers, f"{named}Pil").from_pretrained(path)
        return ImageTextProcessor(images, AutoTokenizer.from_pretrained(path))


class ImageTextProcessor:
    """What Qwen3.5's processor does for images and videos, without a video processor (which needs
    torchvision): each ``<|image_pad|>`` becomes one token per merged 2x2 patch block of its image;
    each video's placeholder (``<|vision_start|><|video_pad|><|vision_end|>``, or a bare
    ``<|video_pad|>``) becomes, per temporal patch, its timestamp ``<t seconds>``, a vision start,
    one ``<|video_pad|>`` per merged block of the frame and a vision end, as the Qwen3-VL processor
    lays them out; ``mm_token_type_ids`` marks image tokens 1 and video tokens 2 among text (0).
    A video is ``[frames, height, width, 3]`` uint8 (``qgraph.testing.video``), patched by ``video_patches``."""

    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"

    def __init__(self, image_processor, tokenizer):
        self.image_processor, self.tokenizer = image_processor, tokenizer

    def __call__(self, text, images=None, videos=None, return_tensors="pt", fps: float = 2.0, **tokenizer_kwargs):
        texts = [text] if isinstance(text, str) else list(text)
        image_inputs = self.image_processor(images=images, return_tensors="pt") if images else {}
        merge = self.image_processor.merge_size
        if images:
            counts = iter((image_inputs["image_grid_thw"].prod(-1) // merge**2).tolist())
            texts = [self._expand(t, counts) for t in texts]
        video_inputs = video_patches(videos, self.image_processor) if videos else {}
        if videos:
            grids = iter(video_inputs["video_grid_thw"].tolist())
            texts = [self._expand_videos(t, grids, fps) for t in texts]
        encoded = self.tokenizer(texts, return_tensors=return_tensors, **tokenizer_kwargs)
        ids = encoded["input_ids"]
        types = (ids == self.tokenizer.convert_tokens_to_ids(self.image_token)).int() + \
            2 * (ids == self.tokenizer.convert_tokens_to_ids(self.video_token)).int()
        return {**encoded, **image_inputs, **video_inputs, "mm_token_type_ids": types}

    def _expand(self, text: str, counts) -> str:
        parts = text.split(self.image_token)
        return parts[0] + "".join(self.image_token * next(counts) + part for part in parts[1:])

    def _expand_videos(self, text: str, grids, fps: float) -> str:
        placeholder = VIDEO_PLACEHOLDER if VIDEO_PLACEHOLDER in text else self.video_token
        parts = text.split(placeholder)
        return parts[0] + "".join(self._video_tokens(next(grids), fps) + part for part in parts[1:])

    def _video_tokens(self, grid: list[int], fps: float) -> str:
        """One video's tokens: per temporal patch its timestamp (the mean of its frames' times), then
        its frame's tokens between a vision start and end."""
        t, h, w = grid
        step = self.image_processor.temporal_patch_size
        per_frame = h * w // self.image_processor.merge_size**2
        times = [(k * step + (k * step + step - 1)) / 2 / fps for k in range(t)]
        return "".join(f"<{time:.1f} seconds><|vision_start|>" + self.video_token * per_frame + "<|vision_end|>"
                       for time in times)

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def video(frames: int, height: int, width: int, seed: int = 0):
    """A random video, ``[frames, height, width, 3]`` uint8 (what ``ImageTextProcessor(videos=...)`` takes)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, height, width, 3), dtype=torch.uint8, generator=generator)


def video_patches(videos, image_processor) -> dict:
    """``pixel_values_videos`` and ``video_grid_thw`` of ``videos`` as the Qwen3-VL video processor
    makes them: each frame resized to a multiple of patch x merge pixels, rescaled and normalised with
    the image processor's mean and std, the frames padded to a multiple of the temporal patch with the
    last one, then cut into patches in merge-block order (the image processor's layout)."""
    p, step, merge = image_processor.patch_size, image_processor.temporal_patch_size, image_processor.merge_size
    mean = torch.tensor(image_processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(image_processor.image_std).view(1, 3, 1, 1)
    pixels, grids = [], []
    for clip in videos:
        clip = torch.as_tensor(clip).permute(0, 3, 1, 2).float() / 255  # [frames, 3, height, width]
        unit = p * merge
        size = [max(unit, round(side / unit) * unit) for side in clip.shape[-2:]]
        clip = torch.nn.functional.interpolate(clip, size=size, mode="bilinear", antialias=True, align_corners=False)
        clip = (clip - mean) / std
        if clip.shape[0] % step:
            clip = torch.cat([clip, clip[-1:].expand(step - clip.shape[0] % step, -1, -1, -1)])
        t, h, w = clip.shape[0] // step, size[0] // p, size[1] // p
        patches = clip.reshape(t, step, 3, h // merge, merge, p, w // merge, merge, p)
        pixels.append(patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, 3 * step * p * p))
        grids.append([t, h, w])
    return {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)}


def video_prompt(processor, videos: int = 1, images: int = 0, text: str = "what happens here?") -> str:
    """A user turn with ``images`` images, then ``videos`` videos, then ``text``, through the chat
    template with the generation prompt (thinking off): what ``processor(text=..., images=...,
    videos=...)`` expands."""
    content = [{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)


def _cache_root(cache_dir) -> Path:
    return Path(cache_dir or os.environ.get("QGRAPH_CACHE") or Path.home() / ".cache" / "qgraph")


def cached_tiny_qwen3_5(cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny checkpoint in qgraph's cache dir, built on first use."""
    path = _cache_root(cache_dir) / "tiny-qwen3_5"
    if not (path / "config.json").exists():
        tiny_qwen3_5(path)
    return path


def cached_tiny_qwen4_exp(cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny qwen4_exp text checkpoint in qgraph's cache dir, built on first use."""
    path = _cache_root(cache_dir) / "tiny-qwen4_exp"
    if not (path / "config.json").exists():
        tiny_qwen4_exp(path)
    return path


cached_tiny_model = cached_tiny_qwen3_5  # the demo's model, whatever family it is of

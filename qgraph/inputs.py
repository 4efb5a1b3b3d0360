"""What the user passes -> what the exported program takes, with errors that say what is wrong.

A text program takes ``input_ids`` and ``attention_mask``. The image-text program also takes the
tensors that depend on the image grids through Python loops, computed here with transformers' own
functions: the M-RoPE ``position_ids`` (``get_rope_index``), and the vision tower's ``cu_seqlens``,
rotary positions and pos_embed resampling indices and weights.

Every input is checked first, cheaply (a min and max over the ids, a pass over the mask): ids in
the vocabulary, no empty prompt, a 0/1 mask of the ids' shape with a token in every row, image
inputs that agree with each other and the prompt. Lists and arrays are converted to tensors.
"""
from __future__ import annotations

import torch
from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids)

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")


# Keyword arguments of a Hugging Face forward that an instrumented call does not take, and what to do instead
_INSTEAD = {
    "output_hidden_states": "ask for values=['layers.*.layer_output'] instead",
    "output_attentions": "ask for values=['layers.*.self_attn.attention_probabilities'] (eager load) instead",
    "labels": "compute the loss from out.logits instead",
    "past_key_values": "use ig.generate(...) to decode from a cache",
    "use_cache": "use ig.generate(...) to decode from a cache",
    "position_ids": "positions follow the attention_mask (left padding is handled)",
    "inputs_embeds": "edit 'layers.0.layer_input' instead (ig(ids, edits={'layers.0.layer_input': Replace(x)}))",
}


def prepare(model, images: bool, input_ids=None, attention_mask=None, pixel_values=None, image_grid_thw=None,
            mm_token_type_ids=None, **unexpected) -> dict:
    """The program inputs for one call (``images``: for the image-text program), checked: a bad
    input raises a TypeError or ValueError that says what is wrong and what to pass instead."""
    if unexpected:
        hints = "".join(f"; {name}: {_INSTEAD[name]}" for name in sorted(unexpected) if name in _INSTEAD)
        raise TypeError(f"unexpected inputs {sorted(unexpected)}: an instrumented model takes input_ids, "
                        f"attention_mask{', pixel_values, image_grid_thw, mm_token_type_ids' if images else ''} "
                        f"and edits{hints}")
    input_ids, attention_mask = _text(model, input_ids, attention_mask)
    if not images:
        return {"input_ids": input_ids, "attention_mask": attention_mask}
    config = model.config
    pixel_values, image_grid_thw, mm_token_type_ids = _images(model, input_ids, pixel_values, image_grid_thw,
                                                              mm_token_type_ids)
    if mm_token_type_ids is None:
        mm_token_type_ids = (input_ids == config.image_token_id).int()
    position_ids, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids,
                                                 image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    vision = config.vision_config
    indices, weights = get_vision_interpolation_indices_and_weights(
        image_grid_thw, num_grid_per_side=model.model.visual.num_grid_per_side,
        mode=model.model.visual.interpolation_mode, align_corners=model.model.visual.interpolation_align_corners,
        spatial_merge_size=vision.spatial_merge_size)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
            "image_cu_seqlens": get_vision_cu_seqlens(image_grid_thw),
            "image_position_ids": get_vision_position_ids(image_grid_thw, vision.spatial_merge_size),
            "image_interp_indices": indices, "image_interp_weights": weights}


def _text(model, input_ids, attention_mask):
    input_ids = _ids(input_ids)
    _check_device(model, input_ids)
    _check_vocabulary(model, input_ids)
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    return input_ids, _mask(attention_mask, input_ids)


def _ids(input_ids) -> torch.Tensor:
    """``input_ids`` as a LongTensor [batch, seq] with at least one token (lists and arrays are converted)."""
    if input_ids is None:
        raise TypeError("input_ids is required: a LongTensor [batch, seq] (e.g. ig(**tokenizer(text, return_tensors='pt')))")
    if isinstance(input_ids, str):
        raise TypeError(f"input_ids is the text {input_ids[:40]!r}: tokenize it first, "
                        f"ig(**tokenizer(text, return_tensors='pt'))")
    input_ids = _as_tensor(input_ids, "input_ids")
    if input_ids.dim() == 1:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; it must be [batch, seq]: "
                         f"add the batch dim with input_ids[None]")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: an empty prompt; give at least one prompt "
                         f"of at least one token (an empty text tokenizes to nothing: add text or the chat template)")
    return input_ids.long()


def _check_device(model, input_ids: torch.Tensor) -> None:
    """input_ids must be where the embedding is (a model on meta, not loaded yet, is not checked)."""
    device = model.get_input_embeddings().weight.device
    if input_ids.device != device and device.type != "meta":
        raise ValueError(f"input_ids is on {input_ids.device} but the model's embedding is on {device}: pass "
                         f"input_ids.to('{device}') (and the attention_mask too)")


def _check_vocabulary(model, input_ids: torch.Tensor) -> None:
    """Every id must index a row of the model's embedding (one min and max over the ids)."""
    rows = model.get_input_embeddings().num_embeddings
    low, high = (int(v) for v in torch.aminmax(input_ids))
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids hold {bad}, outside the vocabulary: the model's embedding has {rows} rows "
                         f"(ids 0 to {rows - 1}). Tokenize with this model's tokenizer (and replace any -100 or "
                         f"-1 padding ids with its pad_token_id)")


def _mask(attention_mask, input_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask as a LongTensor of 0/1 of input_ids' shape, every row with a token."""
    attention_mask = _as_tensor(attention_mask, "attention_mask")
    if attention_mask.device != input_ids.device:
        raise ValueError(f"attention_mask is on {attention_mask.device} but input_ids is on {input_ids.device}: "
                         f"pass both on the model's device")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                         f"{tuple(input_ids.shape)}; they must match (a [batch, seq] mask of 1 for tokens, "
                         f"0 for padding, as the tokenizer returns it)")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(f"attention_mask is {attention_mask.dtype}; it must be bool or integer 1 (token) / 0 "
                        f"(padding), as the tokenizer returns it: pass attention_mask.long() if it holds 0/1 "
                        f"(an additive mask of 0/-inf is not taken)")
    if attention_mask.dtype != torch.bool:
        stray = (attention_mask != 0) & (attention_mask != 1)
        if bool(stray.any()):
            found = sorted(set(attention_mask[stray].unique()[:5].tolist()))
            raise ValueError(f"attention_mask holds {found}; it must hold only 1 (token) and 0 (padding)")
    empty = ~attention_mask.bool().any(-1)
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"attention_mask rows {rows} are all padding: those prompts hold no token, and a model's "
                         f"output for them is meaningless (Hugging Face returns arbitrary finite values). Drop those "
                         f"rows, or give each at least one token")
    return attention_mask.long()


def _as_tensor(data, what: str) -> torch.Tensor:
    """A tensor from a tensor, a nested list or an array; a named error for anything else."""
    if isinstance(data, torch.Tensor):
        return data
    try:
        return torch.as_tensor(data)
    except (TypeError, ValueError, RuntimeError) as error:
        ragged = isinstance(data, (list, tuple)) and "sequence" in str(error)
        problem = ("its rows have different lengths: pad them (tokenizer(texts, padding=True, return_tensors='pt')) "
                   "and pass the attention_mask") if ragged else f"{type(data).__name__} is not a tensor of integers"
        raise (ValueError if ragged else TypeError)(f"{what}: {problem}") from None


def _images(model, input_ids, pixel_values, image_grid_thw, mm_token_type_ids):
    """The image inputs, checked against each other and the prompt; pixel_values in the vision tower's dtype."""
    config = model.config
    if image_grid_thw is None:
        raise ValueError("pixel_values came without image_grid_thw: pass both, as the processor returns them "
                         "(ig(**processor(text=..., images=..., return_tensors='pt')))")
    image_grid_thw = _grid(_as_tensor(image_grid_thw, "image_grid_thw"), config.vision_config.spatial_merge_size)
    pixel_values = _pixels(model, _as_tensor(pixel_values, "pixel_values"), input_ids.device)
    merge = config.vision_config.spatial_merge_size
    patches = int(image_grid_thw.prod(-1).sum())
    if pixel_values.shape[0] != patches:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patch rows but image_grid_thw "
                         f"{image_grid_thw.tolist()} describes {patches}")
    expected = patches // merge**2
    found = int((input_ids == config.image_token_id).sum())
    if found != expected:
        raise ValueError(f"input_ids hold {found} image tokens (id {config.image_token_id}) but the images give "
                         f"{expected} (image_grid_thw {image_grid_thw.tolist()}, {merge}x{merge} patches per "
                         f"token): build the prompt with the processor so each image's placeholder is expanded")
    if mm_token_type_ids is not None:
        mm_token_type_ids = _as_tensor(mm_token_type_ids, "mm_token_type_ids")
        if mm_token_type_ids.shape != input_ids.shape:
            raise ValueError(f"mm_token_type_ids has shape {tuple(mm_token_type_ids.shape)} but input_ids has "
                             f"{tuple(input_ids.shape)}; they must match (or leave it out: it is computed from "
                             f"the image tokens)")
    return pixel_values, image_grid_thw, mm_token_type_ids


def _grid(image_grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """image_grid_thw as a LongTensor [images, 3] of positive (t, h, w), h and w multiples of the merge."""
    if image_grid_thw.dim() != 2 or image_grid_thw.shape[-1] != 3:
        raise ValueError(f"image_grid_thw has shape {tuple(image_grid_thw.shape)}; it must be [images, 3], one "
                         f"(t, h, w) row per image, as the processor returns it (image_grid_thw[None] for one image)")
    image_grid_thw = image_grid_thw.long()
    bad = (image_grid_thw < 1).any(-1) | (image_grid_thw[:, 1:] % merge != 0).any(-1)
    if bool(bad.any()):
        raise ValueError(f"image_grid_thw rows {image_grid_thw[bad].tolist()} are not image grids: t, h and w must be "
                         f"positive and h, w multiples of the {merge}x{merge} merge; pass the processor's "
                         f"image_grid_thw")
    return image_grid_thw


def _pixels(model, pixel_values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """pixel_values as [patches, patch width] in the vision tower's dtype (as Hugging Face casts them)."""
    vision = model.config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    if pixel_values.dim() != 2 or pixel_values.shape[1] != width:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; it must be [patches, {width}] (each row "
                         f"one {vision.temporal_patch_size}x{vision.patch_size}x{vision.patch_size} patch of "
                         f"{vision.in_channels} channels): pass the processor's pixel_values, not an image tensor")
    if not pixel_values.is_floating_point():
        raise TypeError(f"pixel_values is {pixel_values.dtype}; it must be the processor's normalised floating "
                        f"patches, not raw pixels")
    if pixel_values.device != device:
        raise ValueError(f"pixel_values is on {pixel_values.device} but input_ids is on {device}: move both to the "
                         f"model's device")
    return pixel_values.to(model.model.visual.dtype)

"""What the user passes -> what the exported program takes, with errors that say what is wrong.

A text program takes ``input_ids`` and ``attention_mask``. The image-text program also takes the
tensors that depend on the image grids through Python loops, computed here with transformers' own
functions: the M-RoPE ``position_ids`` (``get_rope_index``), and the vision tower's ``cu_seqlens``,
rotary positions and pos_embed resampling indices and weights.
"""
from __future__ import annotations

import torch
from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids)

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")


def prepare(model, images: bool, input_ids=None, attention_mask=None, pixel_values=None, image_grid_thw=None,
            mm_token_type_ids=None, **unexpected) -> dict:
    """The program inputs for one call (``images``: for the image-text program)."""
    if unexpected:
        raise TypeError(f"unexpected inputs {sorted(unexpected)}: an instrumented model takes input_ids, "
                        f"attention_mask{', pixel_values, image_grid_thw, mm_token_type_ids' if images else ''} "
                        f"and edits")
    input_ids, attention_mask = _text(input_ids, attention_mask)
    if not images:
        return {"input_ids": input_ids, "attention_mask": attention_mask}
    config = model.config
    pixel_values, image_grid_thw = _images(config, input_ids, pixel_values, image_grid_thw)
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


def _text(input_ids, attention_mask):
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError("input_ids is required: a LongTensor [batch, seq] (e.g. ig(**tokenizer(text, return_tensors='pt')))")
    if input_ids.dim() == 1:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; it must be [batch, seq]: "
                         f"add the batch dim with input_ids[None]")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")
    input_ids = input_ids.long()
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                         f"{tuple(input_ids.shape)}; they must match")
    return input_ids, attention_mask.long()


def _images(config, input_ids, pixel_values, image_grid_thw):
    if image_grid_thw is None:
        raise ValueError("pixel_values came without image_grid_thw: pass both, as the processor returns them "
                         "(ig(**processor(text=..., images=..., return_tensors='pt')))")
    image_grid_thw = torch.as_tensor(image_grid_thw).long()
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
    return pixel_values, image_grid_thw

"""The Qwen ViT of the image-text Qwen3.5 / Qwen3.6 models: its call inputs and its export patches.

The image-text program takes the tensors that depend on the image grids through Python loops,
computed before each call with transformers' own functions: the M-RoPE ``position_ids``
(``get_rope_index``), and the vision tower's ``cu_seqlens``, rotary positions and pos_embed
resampling indices and weights (``compat.vision_inputs``, the functions the ViT's forward calls).
While the image-text program is exported, the vision attention runs as one
``qgraph::varlen_attention`` node over all images and the image features stay packed, so one
program serves every number and size of images. Every family with this tower uses ``IMAGES``.
"""
from __future__ import annotations

import contextlib

import torch
from torch.export import Dim

from ..compat import attn_implementation_set, vision_inputs
from ..inputs import as_tensor
from ..inputs import prepare as prepare_inputs
from .base import Images

KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
INPUTS = ("position_ids", "pixel_values", "image_grid_thw", "image_cu_seqlens", "image_position_ids",
          "image_interp_indices", "image_interp_weights")


def prepare(model, input_ids, attention_mask, pixel_values=None, image_grid_thw=None, mm_token_type_ids=None) -> dict:
    """The image-text program's inputs beyond the text, checked against each other and the prompt."""
    config = model.config
    pixel_values, image_grid_thw, mm_token_type_ids = _images(model, input_ids, pixel_values, image_grid_thw,
                                                              mm_token_type_ids)
    if mm_token_type_ids is None:
        mm_token_type_ids = (input_ids == config.image_token_id).int()
    position_ids, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids,
                                                 image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    vision = vision_inputs(model.model.visual, image_grid_thw)  # cu_seqlens, position_ids, interp_*
    return {"position_ids": position_ids, "pixel_values": pixel_values, "image_grid_thw": image_grid_thw,
            **{f"image_{name}": tensor for name, tensor in vision.items()}}


def example(model):
    """Two prompts with two images each, of different grids, through the real input preparation;
    and the program inputs' dynamic dims."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    grid = torch.tensor([[1, 2 * merge, 2 * merge], [1, merge, 3 * merge]] * 2)
    row = []
    for count in (grid.prod(-1) // merge**2).tolist()[:2]:
        row += [1, 2] + [config.image_token_id] * count + [3]
    input_ids = torch.tensor([row + [4, 5]] * 2)
    pixel_values = torch.zeros(int(grid.prod(-1).sum()), _patch_width(config.vision_config))
    inputs = prepare_inputs(model, IMAGES, input_ids, with_images=True, pixel_values=pixel_values, image_grid_thw=grid)
    batch, seq = Dim("batch", min=1), Dim("seq", min=1)
    images, blocks = Dim("images", min=1), Dim("merge_blocks", min=1)
    patches = merge**2 * blocks
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq},
               "position_ids": {1: batch, 2: seq}, "pixel_values": {0: patches}, "image_grid_thw": {0: images},
               "image_cu_seqlens": {0: images + 1}, "image_position_ids": {0: patches},
               "image_interp_indices": {0: patches}, "image_interp_weights": {0: patches}}
    return inputs, dynamic


def _patch_width(vision_config) -> int:
    return vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2


@contextlib.contextmanager
def patches(model):
    """While exporting the image-text program: the vision attention runs once over all patches
    (``qgraph::varlen_attention``, through transformers' varlen path), and the image features stay
    packed instead of being split per image with ``tolist()``."""
    from transformers import AttentionInterface

    image_model = type(model.model)  # the class whose get_image_features splits per image
    original_features = image_model.get_image_features
    AttentionInterface.register(_VARLEN, _varlen_attention)
    image_model.get_image_features = _packed_image_features
    try:
        with attn_implementation_set(model.model.visual.config, _VARLEN):
            yield
    finally:
        image_model.get_image_features = original_features


# transformers takes its varlen (cu_seqlens) path for implementations named *flash*
_VARLEN = "qgraph_flash_varlen"


def _varlen_attention(module, query, key, value, attention_mask=None, scaling=None, cu_seq_lens_q=None, **kwargs):
    return torch.ops.qgraph.varlen_attention(query, key, value, cu_seq_lens_q, scaling), None


def _packed_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
    """get_image_features, the features left packed. The model's forward passes on its other keyword
    arguments: the ``image_*`` ones (the precomputed inputs) reach the ViT without the prefix, as
    transformers' own get_image_features takes them; ``video_*`` ones are not for it."""
    kwargs = {name.removeprefix("image_"): value for name, value in kwargs.items() if not name.startswith("video_")}
    outputs = self.visual(pixel_values.type(self.visual.dtype), grid_thw=image_grid_thw, **kwargs)
    outputs.pooler_output = (outputs.pooler_output,)  # one packed tensor: the caller concatenates
    return outputs


def _images(model, input_ids, pixel_values, image_grid_thw, mm_token_type_ids):
    """The image inputs, checked against each other and the prompt; pixel_values in the vision tower's dtype."""
    config = model.config
    if image_grid_thw is None:
        raise ValueError("pixel_values came without image_grid_thw: pass both, as the processor returns them "
                         "(ig(**processor(text=..., images=..., return_tensors='pt')))")
    image_grid_thw = _grid(as_tensor(image_grid_thw, "image_grid_thw"), config.vision_config.spatial_merge_size)
    pixel_values = _pixels(model, as_tensor(pixel_values, "pixel_values"), input_ids.device)
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
        mm_token_type_ids = as_tensor(mm_token_type_ids, "mm_token_type_ids")
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


# max_seqlen is read by flash kernels only (qgraph's varlen op does not): given, the ViT does not read it
# off cu_seqlens with .item()
IMAGES = Images(keys=KEYS, inputs=INPUTS, prepare=prepare, example=example, patches=patches,
                forward_kwargs={"image_max_seqlen": 1})

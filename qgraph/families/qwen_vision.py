"""The Qwen ViT of the image-text Qwen3.5 / Qwen3.6 models: the image part a family adds with
``Family.with_images(IMAGES)``: the vision tower's values, hosts and dims, its call inputs and its
export patches.

The image-text program takes the tensors that depend on the image grids through Python loops,
computed before each call with transformers' own functions: the M-RoPE ``position_ids``
(``get_rope_index``), and the vision tower's ``cu_seqlens``, rotary positions and pos_embed
resampling indices and weights (``compat.vision_inputs``, the functions the ViT's forward calls).
While the image-text program is exported, the vision attention runs as one
``qgraph::varlen_attention`` node over all images and the image features stay packed, so one
program serves every number and size of images. Every family with this tower adds ``IMAGES``.
"""
from __future__ import annotations

import contextlib

import torch
from torch.export import Dim

from ..errors import InvalidArgument, InvalidType
from ..compat import attn_implementation_set, vision_forward_kwargs, vision_inputs
from ..inputs import as_tensor
from ..inputs import prepare as prepare_inputs
from .base import Images, RepeatedBlocks
from .rules import BATCH1, Derived, Port, ScatterSource, ValueSpec, VarlenAttention

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
    patches = merge**2 * blocks  # as multiples() says
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq},
               "position_ids": {1: batch, 2: seq}, "pixel_values": {0: patches}, "image_grid_thw": {0: images},
               "image_cu_seqlens": {0: images + 1}, "image_position_ids": {0: patches},
               "image_interp_indices": {0: patches}, "image_interp_weights": {0: patches}}
    return inputs, dynamic


def multiples(config) -> dict[str, int]:
    """The image inputs whose dim 0 (the patches) is a multiple of the merge unit (merge² patches), as
    ``example``'s derived dim says (none for a text config: the text program of an image-text family)."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return {}
    merge = vision.spatial_merge_size
    return dict.fromkeys(("pixel_values", "image_position_ids", "image_interp_indices", "image_interp_weights"),
                         merge**2)


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
    outputs = self.visual(pixel_values.type(self.visual.dtype), grid_thw=image_grid_thw, **vision_forward_kwargs(kwargs))
    outputs.pooler_output = (outputs.pooler_output,)  # one packed tensor: the caller concatenates
    return outputs


def _images(model, input_ids, pixel_values, image_grid_thw, mm_token_type_ids):
    """The image inputs, checked against each other and the prompt; pixel_values in the vision tower's dtype."""
    config = model.config
    if image_grid_thw is None:
        raise InvalidArgument("pixel_values came without image_grid_thw: pass both, as the processor returns them "
                              "(ig(**processor(text=..., images=..., return_tensors='pt')))")
    image_grid_thw = _grid(as_tensor(image_grid_thw, "image_grid_thw"), config.vision_config.spatial_merge_size)
    pixel_values = _pixels(model, as_tensor(pixel_values, "pixel_values"), input_ids.device)
    merge = config.vision_config.spatial_merge_size
    patches = int(image_grid_thw.prod(-1).sum())
    if pixel_values.shape[0] != patches:
        raise InvalidArgument(f"pixel_values has {pixel_values.shape[0]} patch rows but image_grid_thw "
                              f"{image_grid_thw.tolist()} describes {patches}")
    expected = patches // merge**2
    found = int((input_ids == config.image_token_id).sum())
    if found != expected:
        raise InvalidArgument(f"input_ids hold {found} image tokens (id {config.image_token_id}) but the images give "
                              f"{expected} (image_grid_thw {image_grid_thw.tolist()}, {merge}x{merge} patches per "
                              f"token): build the prompt with the processor so each image's placeholder is expanded")
    if mm_token_type_ids is not None:
        mm_token_type_ids = as_tensor(mm_token_type_ids, "mm_token_type_ids")
        if mm_token_type_ids.shape != input_ids.shape:
            raise InvalidArgument(f"mm_token_type_ids has shape {tuple(mm_token_type_ids.shape)} but input_ids has "
                                  f"{tuple(input_ids.shape)}; they must match (or leave it out: it is computed from "
                                  f"the image tokens)")
    return pixel_values, image_grid_thw, mm_token_type_ids


def _grid(image_grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """image_grid_thw as a LongTensor [images, 3] of positive (t, h, w), h and w multiples of the merge."""
    if image_grid_thw.dim() != 2 or image_grid_thw.shape[-1] != 3:
        raise InvalidArgument(f"image_grid_thw has shape {tuple(image_grid_thw.shape)}; it must be [images, 3], one "
                         f"(t, h, w) row per image, as the processor returns it (image_grid_thw[None] for one image)")
    image_grid_thw = image_grid_thw.long()
    bad = (image_grid_thw < 1).any(-1) | (image_grid_thw[:, 1:] % merge != 0).any(-1)
    if bool(bad.any()):
        raise InvalidArgument(f"image_grid_thw rows {image_grid_thw[bad].tolist()} are not image grids: t, h and w must be "
                              f"positive and h, w multiples of the {merge}x{merge} merge; pass the processor's "
                              f"image_grid_thw")
    return image_grid_thw


def _pixels(model, pixel_values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """pixel_values as [patches, patch width] in the vision tower's dtype (as Hugging Face casts them)."""
    vision = model.config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    if pixel_values.dim() != 2 or pixel_values.shape[1] != width:
        raise InvalidArgument(f"pixel_values has shape {tuple(pixel_values.shape)}; it must be [patches, {width}] (each row "
                              f"one {vision.temporal_patch_size}x{vision.patch_size}x{vision.patch_size} patch of "
                              f"{vision.in_channels} channels): pass the processor's pixel_values, not an image tensor")
    if not pixel_values.is_floating_point():
        raise InvalidType(f"pixel_values is {pixel_values.dtype}; it must be the processor's normalised floating "
                          f"patches, not raw pixels")
    if pixel_values.device != device:
        raise InvalidArgument(f"pixel_values is on {pixel_values.device} but input_ids is on {device}: move both to the "
                              f"model's device")
    return pixel_values.to(model.model.visual.dtype)


# Where each kind of vision host lives: {j} runs over the vision blocks (named like the text blocks'
# by the family's module_renames); they exist only on the image-text model
HOSTS = {
    "vision": "vision",
    "vision_layer": "vision.layers.{j}",
    "vision_self_attn": "vision.layers.{j}.self_attn",
    "vision_mlp": "vision.layers.{j}.mlp",
}

# The vision tower's layout dims, functions of the model's config (patches and image_tokens are the
# call's own sizes)
DIMS = {
    "vision_hidden_size": lambda config: config.vision_config.hidden_size,
    "vision_num_heads": lambda config: config.vision_config.num_heads,
    "vision_head_dim": lambda config: config.vision_config.hidden_size // config.vision_config.num_heads,
    "vision_intermediate_size": lambda config: config.vision_config.intermediate_size,
}

# The vision tower's values: stream values are served [1, patches, width]
VALUES = (
    ValueSpec("image_token_mask", "vision", "ImageTokenMask [batch seq]",
              "Which positions hold image tokens: input_ids == the config's image_token_id; read-only",
              Derived(("input_ids",), "image_token_mask")),
    ValueSpec("patch_embeddings", "vision", "Patches [1 patches vision_hidden_size]",
              "The patch embedding's output, one row per patch (before the learned pos_embed)",
              Port("patch_embed", "output", view=BATCH1)),
    ValueSpec("tower_output", "vision", "Patches [1 patches vision_hidden_size]",
              "The last block's stream, what the projector reads", Port("projector", "input", BATCH1, absolute=True)),
    ValueSpec("image_features", "vision", "ImageFeatures [image_tokens hidden_size]",
              "The image features the text model receives at the image tokens, flat over them", ScatterSource()),
    ValueSpec("layer_input", "vision_layer", "Patches [1 patches vision_hidden_size]",
              "The tower's stream entering the block", Port("", "input", BATCH1)),
    ValueSpec("attention_norm_output", "vision_layer", "Patches [1 patches vision_hidden_size]",
              "The normed stream entering the attention", Port("input_layernorm", "output", BATCH1)),
    ValueSpec("layer_mid", "vision_layer", "Patches [1 patches vision_hidden_size]",
              "The tower's stream after the attention add", Port("post_attention_layernorm", "input", BATCH1)),
    ValueSpec("mlp_norm_output", "vision_layer", "Patches [1 patches vision_hidden_size]",
              "The normed stream entering the MLP", Port("post_attention_layernorm", "output", BATCH1)),
    ValueSpec("mlp_input", "vision_layer", "Patches [1 patches vision_hidden_size]",
              "What the MLP is called with", Port("mlp", "input", BATCH1)),
    ValueSpec("layer_output", "vision_layer", "Patches [1 patches vision_hidden_size]",
              "The tower's stream leaving the block", Port("", "output", BATCH1)),
    ValueSpec("attention_queries", "vision_self_attn", "Queries [1 vision_num_heads patches vision_head_dim]",
              "The queries of every image, after the 2D rotary", VarlenAttention("queries")),
    ValueSpec("attention_keys", "vision_self_attn", "Keys [1 vision_num_heads patches vision_head_dim]",
              "The keys of every image, after the 2D rotary", VarlenAttention("keys")),
    ValueSpec("attention_values", "vision_self_attn", "Values [1 vision_num_heads patches vision_head_dim]",
              "The values of every image", VarlenAttention("values")),
    ValueSpec("attention_scores", "vision_self_attn", "Pattern [images] x [vision_num_heads patches_j patches_j]",
              "Each image's scaled scores entering the softmax: a list, one tensor per image; read-only",
              Derived(("{host}.attention_queries", "{host}.attention_keys"), "per_image_scores")),
    ValueSpec("attention_probabilities", "vision_self_attn", "Pattern [images] x [vision_num_heads patches_j patches_j]",
              "Each image's attention pattern: a list, one tensor per image; read-only",
              Derived(("{host}.attention_queries", "{host}.attention_keys"), "per_image_probabilities")),
    ValueSpec("attention_head_outputs", "vision_self_attn", "HeadOutputs [1 patches vision_num_heads vision_head_dim]",
              "The per-head outputs before the output projection", VarlenAttention("head_outputs")),
    ValueSpec("attention_premix", "vision_self_attn", "HeadOutputs [1 patches vision_num_heads vision_head_dim]",
              "Every head's output side by side, as the output projection takes it",
              Port("proj", "input", view=BATCH1 + (("heads", "vision_num_heads", "vision_head_dim"),))),
    ValueSpec("attention_output", "vision_self_attn", "Patches [1 patches vision_hidden_size]",
              "What the attention adds to the tower's stream", Port("", "output", BATCH1)),
    ValueSpec("mlp_activation", "vision_mlp", "Neurons [1 patches vision_intermediate_size]",
              "The activation function's output", Port("act_fn", "output", BATCH1)),
    ValueSpec("mlp_neurons", "vision_mlp", "Neurons [1 patches vision_intermediate_size]",
              "What the second projection receives", Port("linear_fc2", "input", BATCH1)),
    ValueSpec("mlp_output", "vision_mlp", "Patches [1 patches vision_hidden_size]",
              "What the MLP adds to the tower's stream", Port("", "output", BATCH1)),
)

# max_seqlen is read by flash kernels only (qgraph's varlen op does not): given, the ViT does not read it
# off cu_seqlens with .item()
IMAGES = Images(keys=KEYS, inputs=INPUTS, prepare=prepare, example=example, patches=patches,
                values=VALUES, hosts=HOSTS, dims=DIMS, mixer="self_attn",
                blocks=(RepeatedBlocks("model.visual.blocks", None, image_only=True),),
                forward_kwargs={"image_max_seqlen": 1}, multiples=multiples)

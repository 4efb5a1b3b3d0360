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

from ..errors import InternalError, InvalidArgument, InvalidType
from ..compat import attn_implementation_set, vision_forward_kwargs, vision_inputs
from ..inputs import as_tensor
from ..inputs import prepare as prepare_inputs
from . import qwen_layout, qwen_video
from .base import DimSource, Images, RepeatedBlocks
from .rules import BATCH1, Derived, Port, ScatterSource, ValueSpec, VarlenAttention

KEYS = ("pixel_values", "image_grid_thw", *qwen_video.VIDEO_KEYS, "mm_token_type_ids")
INPUTS = ("position_ids", "pixel_values", "image_grid_thw", "image_cu_seqlens", "image_position_ids",
          "image_interp_indices", "image_interp_weights", "video_start")


def prepare(model, input_ids, attention_mask, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
            video_grid_thw=None, mm_token_type_ids=None) -> dict:
    """The image-text program's inputs beyond the text, checked against each other and the prompt: the
    images' patches then the videos' in one row (``qwen_video``), as the tower runs them."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    pixel_values, image_grid_thw = _images(model, input_ids, pixel_values, image_grid_thw, "image")
    pixel_values_videos, video_grid_thw = _images(model, input_ids, pixel_values_videos, video_grid_thw, "video")
    mm_token_type_ids = qwen_video.type_ids(input_ids, config, mm_token_type_ids)
    qwen_layout.check_runs(input_ids, attention_mask, config, image_grid_thw, video_grid_thw)
    position_ids, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids,
                                                 image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                                                 attention_mask=attention_mask)
    grid = qwen_video.packed(image_grid_thw, None if video_grid_thw is None else qwen_video.frames(video_grid_thw))
    if grid is None:  # inputs.prepare asks for the image inputs only of a call that has images or videos
        raise InternalError("the image inputs of a call with neither images nor videos")
    vision = vision_inputs(model.model.visual, grid)  # cu_seqlens, position_ids, interp_*
    image_tokens = 0 if image_grid_thw is None else int(image_grid_thw.prod(-1).sum()) // merge**2
    return {"position_ids": position_ids, "pixel_values": qwen_video.packed(pixel_values, pixel_values_videos),
            "image_grid_thw": grid, **{f"image_{name}": tensor for name, tensor in vision.items()},
            "video_start": qwen_video.video_start(image_tokens, input_ids.device)}


def example(model):
    """Two prompts with two images and a video of two temporal patches each, of different grids,
    through the real input preparation; and the program inputs' dynamic dims."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    grid = torch.tensor([[1, 2 * merge, 2 * merge], [1, merge, 3 * merge]] * 2)
    videos = torch.tensor([[2, merge, 2 * merge]] * 2)
    row = []
    for count in (grid.prod(-1) // merge**2).tolist()[:2]:
        row += [1, 2] + [config.image_token_id] * count + [3]
    for _ in range(int(videos[0, 0])):  # each temporal patch its own group, as the processor lays them out
        row += [4, 2] + [config.video_token_id] * int(videos[0, 1:].prod() // merge**2) + [3]
    input_ids = torch.tensor([row + [4, 5]] * 2)
    width = _patch_width(config.vision_config)
    inputs = prepare_inputs(model, IMAGES, input_ids, with_images=True,
                            pixel_values=torch.zeros(int(grid.prod(-1).sum()), width), image_grid_thw=grid,
                            pixel_values_videos=torch.zeros(int(videos.prod(-1).sum()), width), video_grid_thw=videos)
    batch, seq = Dim("batch", min=1), Dim("seq", min=1)
    # the images and videos' temporal patches (the tower's spans), and the image tokens + 1
    images, blocks, split = Dim("images", min=1), Dim("merge_blocks", min=1), Dim("image_tokens_and_one", min=1)
    patches = merge**2 * blocks  # as multiples() says
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq},
               "position_ids": {1: batch, 2: seq}, "pixel_values": {0: patches}, "image_grid_thw": {0: images},
               "image_cu_seqlens": {0: images + 1}, "image_position_ids": {0: patches},
               "image_interp_indices": {0: patches}, "image_interp_weights": {0: patches}, "video_start": {0: split}}
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
    (``qgraph::varlen_attention``, through transformers' varlen path), and one tower run over the
    images then the videos gives both scatters their packed part (``qwen_video.packed_features``)
    instead of features split per image with ``tolist()``."""
    from transformers import AttentionInterface

    AttentionInterface.register(_VARLEN, _varlen_attention)
    with qwen_video.packed_features(type(model.model), _packed_features), \
            attn_implementation_set(model.model.visual.config, _VARLEN):
        yield


# transformers takes its varlen (cu_seqlens) path for implementations named *flash*
_VARLEN = "qgraph_flash_varlen"


def _varlen_attention(module, query, key, value, attention_mask=None, scaling=None, cu_seq_lens_q=None, **kwargs):
    return torch.ops.qgraph.varlen_attention(query, key, value, cu_seq_lens_q, scaling), None


def _packed_features(self, pixel_values, grid_thw, kwargs):
    """The tower's one run over the call's packed patches. The model's forward passes on its other
    keyword arguments: the ``image_*`` ones (the precomputed inputs) reach the ViT without the prefix,
    as transformers' own get_image_features takes them; ``video_*`` ones are not for it."""
    kwargs = {name.removeprefix("image_"): value for name, value in kwargs.items() if not name.startswith("video_")}
    return self.visual(pixel_values.type(self.visual.dtype), grid_thw=grid_thw, **vision_forward_kwargs(kwargs))


def _images(model, input_ids, pixel_values, grid_thw, what: str):
    """One kind's (``image`` or ``video``) inputs, checked against each other and the prompt's tokens of
    that kind; pixels in the vision tower's dtype. ``(None, None)`` for a kind the call does not have."""
    config = model.config
    pixels, grid = ("pixel_values", "image_grid_thw") if what == "image" else qwen_video.VIDEO_KEYS
    token_id = config.image_token_id if what == "image" else config.video_token_id
    merge = config.vision_config.spatial_merge_size
    if pixel_values is None:
        if grid_thw is not None:
            raise InvalidArgument(f"{grid} came without {pixels}: pass both, as the processor returns them")
        qwen_video.check_tokens(input_ids, token_id, 0, what, None)
        return None, None
    if grid_thw is None:
        raise InvalidArgument(f"{pixels} came without {grid}: pass both, as the processor returns them "
                              f"(ig(**processor(text=..., {what}s=..., return_tensors='pt')))")
    grid_thw = _grid(as_tensor(grid_thw, grid, f"pass the processor's {grid}, one (t, h, w) row per {what}"),
                     merge, grid)
    pixel_values = _pixels(model, as_tensor(pixel_values, pixels), input_ids.device, pixels)
    patches = int(grid_thw.prod(-1).sum())
    if pixel_values.shape[0] != patches:
        raise InvalidArgument(f"{pixels} has {pixel_values.shape[0]} patch rows but {grid} "
                              f"{grid_thw.tolist()} describes {patches}")
    qwen_video.check_tokens(input_ids, token_id, patches // merge**2, what, grid_thw)
    return pixel_values, grid_thw


def _grid(image_grid_thw: torch.Tensor, merge: int, name: str = "image_grid_thw") -> torch.Tensor:
    """image_grid_thw (or video_grid_thw) as a LongTensor [images, 3] of positive (t, h, w), h and w
    multiples of the merge, at least one row."""
    kind = name.split("_")[0]
    if image_grid_thw.dim() != 2 or image_grid_thw.shape[-1] != 3:
        raise InvalidArgument(f"{name} has shape {tuple(image_grid_thw.shape)}; it must be [{kind}s, 3], one "
                              f"(t, h, w) row per {kind}, as the processor returns it ({name}[None] for one {kind})")
    if image_grid_thw.dtype == torch.bool or image_grid_thw.is_floating_point() or image_grid_thw.is_complex():
        raise InvalidArgument(f"{name} is {image_grid_thw.dtype}; it must be an integer tensor [{kind}s, 3] of "
                              f"patch counts, as the processor returns it ({name}.long() if it holds whole numbers)")
    if image_grid_thw.shape[0] == 0:
        raise InvalidArgument(f"{name} has no rows: a call without {kind}s leaves out both {name} and its pixels")
    image_grid_thw = image_grid_thw.long()
    bad = (image_grid_thw < 1).any(-1) | (image_grid_thw[:, 1:] % merge != 0).any(-1)
    if bool(bad.any()):
        raise InvalidArgument(f"{name} rows {image_grid_thw[bad].tolist()} are not {kind} grids: t, h and w must be "
                              f"positive and h, w multiples of the {merge}x{merge} merge; pass the processor's "
                              f"{name}")
    return image_grid_thw


def _pixels(model, pixel_values: torch.Tensor, device: torch.device, name: str = "pixel_values") -> torch.Tensor:
    """pixel_values as [patches, patch width] in the vision tower's dtype (as Hugging Face casts them)."""
    vision = model.config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    if pixel_values.dim() != 2 or pixel_values.shape[1] != width:
        raise InvalidArgument(f"{name} has shape {tuple(pixel_values.shape)}; it must be [patches, {width}] (each row "
                              f"one {vision.temporal_patch_size}x{vision.patch_size}x{vision.patch_size} patch of "
                              f"{vision.in_channels} channels): pass the processor's pixel_values, not an image tensor")
    if not pixel_values.is_floating_point():
        raise InvalidType(f"{name} is {pixel_values.dtype}; it must be the processor's normalised floating "
                          f"patches, not raw pixels")
    if pixel_values.device != device:
        raise InvalidArgument(f"{name} is on {pixel_values.device} but input_ids is on {device}: move both to the "
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
DIMS: dict[str, DimSource] = {
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
    ValueSpec("video_features", "vision", "VideoFeatures [video_tokens hidden_size]",
              "The video features the text model receives at the video tokens, flat over them (every video's "
              "temporal patches in turn)", Port("video_features", "output")),
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
              "Each image's scaled scores entering the softmax: a list, one tensor per image, then one per "
              "temporal patch of each video; read-only",
              Derived(("{host}.attention_queries", "{host}.attention_keys"), "per_image_scores")),
    ValueSpec("attention_probabilities", "vision_self_attn",
              "Pattern [images] x [vision_num_heads patches_j patches_j]",
              "Each image's attention pattern: a list, one tensor per image, then one per temporal patch of each "
              "video; read-only",
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

"""Video on the Qwen ViT: the call's video inputs checked and packed after its images, and the export
patch that runs the tower once over both and hands each scatter its part.

Transformers runs the vision tower once for the images (``get_image_features``) and once more for
the videos (``get_video_features``), then scatters the image features at the image tokens and the
video features at the video tokens. Every op of the tower but its attention works patch by patch,
and the attention runs within one ``cu_seqlens`` span (an image, or one temporal patch of a video),
so one run over the images' patches followed by the videos' gives both runs' values. The
image-text program runs it so: ``pixel_values`` is every image's patches then every video's, its
``image_grid_thw`` the images' grids then each video's temporal patches as ``(1, h, w)`` rows (the
tower's inputs are the same: the video's rows repeat per temporal patch), and ``video_start``, a
tensor of ``image tokens + 1`` zeros, says by its length where the videos' features begin in the
packed features (a size export follows, where a count read off a tensor would not be). One program
thus serves images, videos and both.
"""
from __future__ import annotations

import contextlib

import torch

from ..errors import InvalidArgument
from ..inputs import as_tensor

VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")
# the port marker at what the video scatter writes (``vision.video_features``: a Port on host "vision")
VIDEO_FEATURES_PORT = "vision.video_features.output"


def check_tokens(input_ids: torch.Tensor, token_id: int, expected: int, what: str, grid) -> None:
    """The prompt must hold one ``token_id`` per merged patch block of the call's ``what``."""
    found = int((input_ids == token_id).sum())
    if found != expected:
        given = f"{what}_grid_thw {grid.tolist()}" if grid is not None else f"no {what}s"
        raise InvalidArgument(f"input_ids hold {found} {what} tokens (id {token_id}) but the {what}s give {expected} "
                              f"({given}): build the prompt with the processor so each {what}'s placeholder is "
                              f"expanded (qgraph.testing.video_prompt for the tiny model's videos)")


def type_ids(input_ids: torch.Tensor, config, mm_token_type_ids) -> torch.Tensor:
    """``mm_token_type_ids`` as the processor makes them (text 0, image tokens 1, video tokens 2); the
    caller's must be those (``get_rope_index`` groups the tokens by them, the scatters by input_ids)."""
    types = (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()
    if mm_token_type_ids is None:
        return types
    mm_token_type_ids = as_tensor(mm_token_type_ids, "mm_token_type_ids")
    if mm_token_type_ids.shape != input_ids.shape:
        raise InvalidArgument(f"mm_token_type_ids has shape {tuple(mm_token_type_ids.shape)} but input_ids has "
                              f"{tuple(input_ids.shape)}; they must match (or leave it out: it is computed from "
                              f"the image and video tokens)")
    wrong = mm_token_type_ids.to(types.device) != types
    if bool(wrong.any()):
        row, position = wrong.nonzero()[0].tolist()
        given, token = mm_token_type_ids[row, position].item(), int(input_ids[row, position])
        raise InvalidArgument(f"mm_token_type_ids mark {int(wrong.sum())} positions unlike input_ids' tokens, the "
                              f"first row {row}, position {position}: {given} at token {token}, where "
                              f"{int(types[row, position])} is its type (0 text, 1 image token "
                              f"{config.image_token_id}, 2 video token {config.video_token_id}); pass the processor's "
                              f"mm_token_type_ids with its input_ids, or leave it out: it is computed from the image "
                              f"and video tokens")
    return types


def frames(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """Each video's grid split into its temporal patches, one ``(1, h, w)`` row each (what the tower's
    ``cu_seqlens`` spans, and what ``get_rope_index`` places one after another)."""
    rows = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    rows[:, 0] = 1
    return rows


def packed(images, videos) -> torch.Tensor | None:
    """The images' tensor followed by the videos' (either may be None)."""
    parts = [part for part in (images, videos) if part is not None]
    return torch.cat(parts) if parts else None


def video_start(image_tokens: int, device) -> torch.Tensor:
    """The program input whose length - 1 is the row of the packed features where the videos' begin."""
    return torch.zeros(image_tokens + 1, dtype=torch.long, device=device)


@contextlib.contextmanager
def packed_features(image_model: type, vision_forward):
    """While exporting: ``image_model``'s forward takes ``video_start`` and hands the tower's one run
    over images then videos to both scatters: ``get_image_features`` runs it (``vision_forward(self,
    pixel_values, grid, kwargs)`` -> the merged features, packed) and keeps the rows from
    ``video_start``'s length on for ``get_video_features``, which returns them behind a port marker."""
    names = ("forward", "get_image_features", "get_video_features", "get_placeholder_mask")
    originals = {name: getattr(image_model, name) for name in names}
    forward = originals["forward"]
    held: dict = {}

    def model_forward(self, *args, video_start=None, **kwargs):
        held["start"] = video_start
        # not None: transformers' forward asks get_video_features for the video part and scatters it
        kwargs["pixel_values_videos"] = video_start
        try:
            return forward(self, *args, **kwargs)
        finally:
            held.clear()

    def get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
        outputs = vision_forward(self, pixel_values, image_grid_thw, kwargs)
        features = outputs.pooler_output
        images = held["start"].shape[0] - 1
        torch._check(images <= features.shape[0])
        held["videos"] = features[images:]
        outputs.pooler_output = (features[:images],)
        return outputs

    def get_video_features(self, pixel_values_videos, video_grid_thw=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPooling
        marked = torch.ops.qgraph.mark(held.pop("videos"), VIDEO_FEATURES_PORT)
        return BaseModelOutputWithPooling(pooler_output=(marked,))

    def get_placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None):
        # The masks alone: the counts are checked before the call (check_tokens). Releases before 5.23
        # (5.9) check them by indexing the embeddings with the mask, a size export bounds by the
        # example's (at least one image), which a call with videos only would then fail.
        config = self.config
        return tuple((input_ids == token).unsqueeze(-1).expand_as(inputs_embeds)
                     for token in (config.image_token_id, config.video_token_id))

    for name, function in zip(names, (model_forward, get_image_features, get_video_features, get_placeholder_mask)):
        setattr(image_model, name, function)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(image_model, name, function)

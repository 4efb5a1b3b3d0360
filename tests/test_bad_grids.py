"""Image and video grids that do not fit the call get a named error from qgraph before the model runs
(issue 53, item 5): a grid of the wrong dtype or shape."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import qgraph
from qgraph.testing import load_processor, tiny_qwen3_5_vl, video, video_prompt


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(tiny_qwen3_5_vl(tmp_path_factory.mktemp("tiny-qwen3_5-vl-grids")))


@pytest.fixture(scope="module")
def ig(processor):
    from transformers import AutoModelForImageTextToText
    model = AutoModelForImageTextToText.from_pretrained(processor.tokenizer.name_or_path).eval()
    return qgraph.instrument(model, values=["vision.video_features"])


@pytest.fixture(scope="module")
def one_video(processor):
    """One video of 2 temporal patches of 4x6 patches: 48 patch rows, two groups of 6 video tokens."""
    inputs = processor(text=video_prompt(processor), videos=[video(4, 64, 96, seed=0)])
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 6]]
    return inputs


def image(height, width, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def two_images(processor):
    """Two images of 4x4 and 4x8 patches: 48 patch rows, groups of 4 then 8 image tokens."""
    inputs = processor(text=video_prompt(processor, videos=0, images=2),
                       images=[image(64, 64, 1), image(64, 128, 2)])
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]
    return inputs


def call(ig, inputs, **changed):
    with torch.no_grad():
        return ig(**{**inputs, **changed})


# -- the grid itself ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grid, match", [
    (torch.tensor([[2.0, 4, 6]]), r"video_grid_thw is torch\.float32; it must be an integer tensor \[videos, 3\] "
                                  r"of patch counts.*\(video_grid_thw\.long\(\) if it holds whole numbers\)"),
    (torch.tensor([[2.5, 4, 6]]), r"video_grid_thw is torch\.float32"),
    (torch.ones(1, 3, dtype=torch.bool), r"video_grid_thw is torch\.bool"),
    (torch.zeros(0, 3, dtype=torch.long), r"video_grid_thw has no rows: a call without videos leaves out both "
                                          r"video_grid_thw and its pixels"),
    ([[2, 4, 6], [1]], r"video_grid_thw: its rows have different lengths: pass the processor's video_grid_thw, one "
                       r"\(t, h, w\) row per video"),
    (torch.tensor([[0, 4, 12]]), r"video_grid_thw rows \[\[0, 4, 12\]\] are not video grids: t, h and w must be "
                                 r"positive"),
    (torch.tensor([[2, 3, 8]]), r"video_grid_thw rows \[\[2, 3, 8\]\] are not video grids.*h, w multiples of the "
                                r"2x2 merge"),
])
def test_a_grid_of_the_wrong_dtype_or_shape(ig, one_video, grid, match):
    with pytest.raises(qgraph.InvalidArgument, match=match):
        call(ig, one_video, video_grid_thw=grid)

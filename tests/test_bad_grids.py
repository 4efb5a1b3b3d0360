"""Image and video grids that do not fit the call get a named error from qgraph before the model runs
(issue 53, item 5): a grid of the wrong dtype or shape, and a grid with the right totals but another
layout than the prompt's (transformers' get_rope_index fails on those with a bare RuntimeError or
StopIteration)."""
from __future__ import annotations

import re

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


# -- the grid against the prompt's layout ------------------------------------------------------------------------
@pytest.mark.parametrize("grid, expected, found", [
    # 48 patch rows and 12 tokens, as the prompt's [[2, 4, 6]]: another split into temporal patches
    ([[3, 4, 4]], "[4, 4, 4]", r"group 0 \(video 0's temporal patch 0, grid row \[3, 4, 4\]\) needs 4 tokens but "
                               r"input_ids row 0 has 6 from position \d+"),
    ([[1, 4, 12]], "[12]", r"group 0 \(video 0's temporal patch 0, grid row \[1, 4, 12\]\) needs 12 tokens"),
    ([[4, 2, 6]], "[3, 3, 3, 3]", r"needs 3 tokens but input_ids row 0 has 6"),
])
def test_a_video_grid_of_another_temporal_layout(ig, one_video, grid, expected, found):
    with pytest.raises(qgraph.InvalidArgument) as caught:
        call(ig, one_video, video_grid_thw=torch.tensor(grid))
    message = str(caught.value)
    assert message.startswith(f"video_grid_thw {grid} does not fit the prompt's video tokens (id "
                               f"{ig.config.video_token_id}): it gives groups of {expected} (one group of h*w/4 video "
                               f"tokens per temporal patch, as the processor lays them out) but input_ids hold groups "
                               f"of [6, 6]; ")
    assert re.search(found, message)
    assert message.endswith("Pass the video_grid_thw the processor returned with this prompt, or build the prompt "
                            "from these videos with the processor (qgraph.testing.video_prompt for the tiny model's "
                            "videos)")


def test_the_temporal_patches_run_together_in_the_prompt(ig, one_video):
    """The right grid, but a prompt whose two temporal patches form one group (no vision end and start
    between them): one group of 12 where the grid gives two of 6."""
    ids = one_video["input_ids"]
    video_token = ig.config.video_token_id
    at = (ids[0] == video_token).nonzero().flatten()
    kept = torch.ones_like(ids[0], dtype=torch.bool)
    kept[at[5] + 1:at[6]] = False  # what separates the two temporal patches
    inputs = {**one_video, "input_ids": ids[:, kept], "attention_mask": one_video["attention_mask"][:, kept]}
    inputs.pop("mm_token_type_ids")
    with pytest.raises(qgraph.InvalidArgument, match=r"video_grid_thw \[\[2, 4, 6\]\] does not fit .* gives groups of "
                                                     r"\[6, 6\] .* but input_ids hold groups of \[12\]; group 0 "
                                                     r"\(video 0's temporal patch 0, grid row \[2, 4, 6\]\) needs 6 "
                                                     rf"tokens but input_ids row 0 has 12 from position {int(at[0])}"):
        call(ig, inputs)


def test_two_image_grids_in_the_other_order(ig, two_images):
    with pytest.raises(qgraph.InvalidArgument,
                       match=r"image_grid_thw \[\[1, 4, 8\], \[1, 4, 4\]\] does not fit the prompt's image tokens "
                             r"\(id \d+\): it gives groups of \[8, 4\] \(one group of t\*h\*w/4 image tokens per "
                             r"image, .*\) but input_ids hold groups of \[4, 8\]; group 0 \(image 0, grid row "
                             r"\[1, 4, 8\]\) needs 8 tokens but input_ids row 0 has 4 .* Pass the image_grid_thw the "
                             r"processor returned with this prompt, or build the prompt from these images with the "
                             r"processor$"):
        call(ig, two_images, image_grid_thw=torch.tensor([[1, 4, 8], [1, 4, 4]]))


def test_one_image_grid_for_two_images(ig, two_images):
    """Two images' patches described as one image: the prompt holds one group more than the grid gives."""
    with pytest.raises(qgraph.InvalidArgument, match=r"image_grid_thw \[\[1, 4, 12\]\] does not fit .* groups of "
                                                     r"\[12\] .* groups of \[4, 8\]; group 0 .* needs 12 tokens but "
                                                     r"input_ids row 0 has 4"):
        call(ig, two_images, image_grid_thw=torch.tensor([[1, 4, 12]]))


def test_a_batch_of_two_videos_with_their_grids_swapped(ig, processor):
    """Each row's groups take the next grid rows in batch order: swapped, the first row's group does not fit."""
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=[video_prompt(processor, text="short"), video_prompt(processor, text="a longer one")],
                       videos=[video(2, 32, 64, seed=1), video(4, 64, 96, seed=2)], padding=True)
    assert inputs["video_grid_thw"].tolist() == [[1, 2, 4], [2, 4, 6]]
    call(ig, inputs)  # as laid out, it runs
    first = int((inputs["input_ids"][0] == ig.config.video_token_id).nonzero()[0])
    with pytest.raises(qgraph.InvalidArgument, match=r"video_grid_thw \[\[2, 4, 6\], \[1, 2, 4\]\] does not fit .* "
                                                     r"groups of \[6, 6, 2\] .* groups of \[2, 6, 6\]; group 0 \(video "
                                                     r"0's temporal patch 0, grid row \[2, 4, 6\]\) needs 6 tokens but "
                                                     rf"input_ids row 0 has 2 from position {first}\."):
        call(ig, inputs, video_grid_thw=inputs["video_grid_thw"].flip(0))


def test_runs_end_where_a_prompt_row_does_and_join_over_padding():
    """Tokens of one kind at the end of a row and the start of the next are two groups, as get_rope_index
    walks the rows one by one; padding between two tokens of a kind does not part them (it drops it)."""
    from qgraph.families.qwen_layout import _runs
    hit = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 1], [1, 0, 0, 1]], dtype=torch.bool)
    real = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 1]], dtype=torch.bool)
    assert _runs(hit, real).tolist() == [2, 2, 1, 2]
    assert _runs(hit, torch.ones_like(real)).tolist() == [2, 2, 1, 1, 1]
    assert _runs(torch.zeros_like(hit), real).tolist() == []


def test_a_group_under_the_attention_mask(ig, one_video):
    """get_rope_index walks the real tokens only: a temporal patch's group masked out is a group short."""
    at = (one_video["input_ids"][0] == ig.config.video_token_id).nonzero().flatten()
    mask = one_video["attention_mask"].clone()
    mask[0, at[6]:at[-1] + 1] = 0
    with pytest.raises(qgraph.InvalidArgument, match=r"groups of \[6, 6\] .* groups of \[6\]; group 1 \(video 0's "
                                                     r"temporal patch 1, grid row \[2, 4, 6\]\) needs 6 tokens but the "
                                                     r"real tokens of input_ids \(attention_mask 1\) hold only 1 in all"):
        call(ig, one_video, attention_mask=mask)


@pytest.mark.parametrize("change, match", [
    (lambda types, video: torch.zeros_like(types), r"mm_token_type_ids mark 12 positions unlike input_ids' tokens, the "
                                                   r"first row 0, position (\d+): 0 at token {video}, where 2 is its "
                                                   r"type \(0 text, 1 image token \d+, 2 video token {video}\); pass the "
                                                   r"processor's mm_token_type_ids with its input_ids, or leave it out"),
    (lambda types, video: types.roll(1, 1), r"mm_token_type_ids mark 4 positions unlike input_ids' tokens, the first "
                                            r"row 0, position \d+: 0 at token {video}, where 2 is its type"),
])
def test_type_ids_that_do_not_mark_the_prompt_s_tokens(ig, one_video, change, match):
    """get_rope_index groups the tokens by mm_token_type_ids: ones that disagree with input_ids would lay
    out other groups than the scatters fill (a RuntimeError, or positions silently off)."""
    video_token = ig.config.video_token_id
    with pytest.raises(qgraph.InvalidArgument, match=match.format(video=video_token)):
        call(ig, one_video, mm_token_type_ids=change(one_video["mm_token_type_ids"], video_token))

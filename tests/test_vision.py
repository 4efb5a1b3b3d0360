"""The image-text model: vision values, per-image patterns, logits with images, errors (issue 5)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import qgraph
from qgraph.testing import load_processor, tiny_qwen3_5_vl
from conftest import graph_structure

TEXT_VALUES = ["layers.*.layer_input", "layers.*.layer_output", "layers.*.*.attention_output", "layers.*.mlp.mlp_output",
               "layers.3.self_attn.attention_gate", "layers.0.linear_attn.state_output"]


def image(height, width, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="session")
def vl_checkpoint(tmp_path_factory):
    return tiny_qwen3_5_vl(tmp_path_factory.mktemp("tiny-qwen3_5-vl"))


@pytest.fixture(scope="session")
def processor(vl_checkpoint):
    return load_processor(vl_checkpoint)


@pytest.fixture(scope="session")
def vl_model(vl_checkpoint):
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(vl_checkpoint).eval()


@pytest.fixture(scope="session")
def vl_ig(vl_model):
    return qgraph.instrument(vl_model, values=["vision.**", "projector.input", "projector.output", *TEXT_VALUES],
                             edits=["vision.image_features"])


def prompt(processor, images: int) -> str:
    content = [{"type": "image"}] * images + [{"type": "text", "text": "what is in these?"}]
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)


@pytest.fixture(scope="session")
def two_images(processor, vl_ig):
    inputs = processor(text=prompt(processor, 2), images=[image(64, 64, 0), image(40, 100, 1)])
    with torch.no_grad():
        return inputs, vl_ig(**inputs)


def hf(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_the_two_images_have_different_grids(two_images):
    inputs, _ = two_images
    grids = inputs["image_grid_thw"].tolist()
    assert len(grids) == 2 and grids[0] != grids[1]


@pytest.mark.parametrize("case", ["one image", "two images", "batch of two prompts", "text only"])
@pytest.mark.compat
def test_logits_equal_the_plain_forward(processor, vl_model, vl_ig, case):
    if case == "one image":
        inputs = processor(text=prompt(processor, 1), images=[image(48, 80, 2)])
    elif case == "two images":
        inputs = processor(text=prompt(processor, 2), images=[image(64, 64, 0), image(40, 100, 1)])
    elif case == "batch of two prompts":
        texts = [prompt(processor, 1), "A longer second prompt about " + prompt(processor, 2)]
        processor.tokenizer.padding_side = "left"
        inputs = processor(text=texts, images=[image(32, 32, 3), image(64, 32, 4), image(32, 96, 5)], padding=True)
    else:
        inputs = processor(text="only words here")
    out = vl_ig(**inputs)
    torch.testing.assert_close(out.logits, hf(vl_model, inputs), atol=1e-6, rtol=0)
    if case == "batch of two prompts":
        assert inputs["attention_mask"][0].eq(0).any()  # the first prompt really is padded


@pytest.mark.compat
def test_image_features_are_what_the_first_block_reads_at_image_tokens(two_images, vl_model):
    inputs, out = two_images
    mask = out["vision.image_token_mask"]
    assert torch.equal(mask, inputs["input_ids"] == vl_model.config.image_token_id)
    assert torch.equal(out["vision.image_features"], out["layers.0.layer_input"][mask])
    assert torch.equal(out["vision.image_features"], out["projector.output"])


def test_projector_rows_fold_four_patches_into_one_token(two_images):
    inputs, out = two_images
    grid = inputs["image_grid_thw"]
    fed = out["projector.input"]
    assert fed.shape[0] // 4 == int(out["vision.image_token_mask"].sum())
    per_image = fed.split(grid.prod(-1).tolist())
    assert [p.shape[0] for p in per_image] == grid.prod(-1).tolist()
    assert torch.equal(out["vision.tower_output"][0], fed)
    assert torch.equal(out["vision.layers.1.layer_output"][0], fed)  # no norm between the last block and the merger


def test_each_image_pattern_times_its_values_gives_its_head_outputs(two_images):
    inputs, out = two_images
    bounds = [0, *inputs["image_grid_thw"].prod(-1).cumsum(0).tolist()]
    for block in (0, 1):
        attn = f"vision.layers.{block}.self_attn"
        patterns = out[f"{attn}.attention_probabilities"]
        values, heads = out[f"{attn}.attention_values"], out[f"{attn}.attention_head_outputs"]
        assert len(patterns) == 2
        for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            assert patterns[j].shape == (2, b - a, b - a)
            torch.testing.assert_close(patterns[j].sum(-1), torch.ones(2, b - a))
            torch.testing.assert_close(patterns[j] @ values[0, :, a:b], heads[0, a:b].transpose(0, 1), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(out[f"{attn}.attention_scores"][j].softmax(-1), patterns[j])


def test_vision_block_identity_and_premix(two_images):
    _, out = two_images
    for block in (0, 1):
        prefix = f"vision.layers.{block}"
        total = out[f"{prefix}.layer_input"] + out[f"{prefix}.self_attn.attention_output"] + out[f"{prefix}.mlp.mlp_output"]
        assert torch.equal(total, out[f"{prefix}.layer_output"])
        assert torch.equal(out[f"{prefix}.layer_input"] + out[f"{prefix}.self_attn.attention_output"],
                           out[f"{prefix}.layer_mid"])
        assert torch.equal(out[f"{prefix}.mlp_input"], out[f"{prefix}.mlp_norm_output"])
        assert torch.equal(out[f"{prefix}.self_attn.attention_premix"], out[f"{prefix}.self_attn.attention_head_outputs"])
    assert torch.equal(out["vision.layers.1.layer_input"], out["vision.layers.0.layer_output"])


def test_text_values_work_with_images(two_images):
    _, out = two_images
    for block, mixer in ((0, "linear_attn"), (3, "self_attn")):
        total = (out[f"layers.{block}.layer_input"] + out[f"layers.{block}.{mixer}.attention_output"]
                 + out[f"layers.{block}.mlp.mlp_output"])
        assert torch.equal(total, out[f"layers.{block}.layer_output"])
    assert out["layers.3.self_attn.attention_gate"].shape[:2] == out["layers.3.layer_output"].shape[:2]


def test_text_only_call_serves_the_text_values(processor, vl_model, vl_ig):
    inputs = processor(text="only words here")
    out = vl_ig(**inputs)
    assert "layers.2.layer_output" in out and "vision.image_features" not in out
    assert not out["vision.image_token_mask"].any()
    with pytest.raises(KeyError, match="was not captured"):
        out["vision.layers.0.layer_output"]


def test_zeroing_one_images_features_changes_only_what_follows_it(processor, vl_ig, two_images):
    inputs, base = two_images
    first = int(inputs["image_grid_thw"][0].prod()) // 4
    out = vl_ig(**inputs, edits={"vision.image_features": qgraph.Zero(positions=range(first))})
    assert out["vision.image_features"][:first].eq(0).all()
    assert torch.equal(out["vision.image_features"][first:], base["vision.image_features"][first:])
    positions = base["vision.image_token_mask"][0].nonzero().flatten()
    start = int(positions[0])
    assert torch.equal(out.logits[:, :start], base.logits[:, :start])  # causal: tokens before the image
    assert not torch.allclose(out.logits[:, -1], base.logits[:, -1])


def test_bad_image_inputs_say_what_is_wrong(processor, vl_ig, two_images, sdpa_model):
    inputs, _ = two_images
    with pytest.raises(ValueError, match="image tokens"):
        vl_ig(**{**inputs, "image_grid_thw": inputs["image_grid_thw"][:1],
                 "pixel_values": inputs["pixel_values"][:int(inputs["image_grid_thw"][0].prod())]})
    with pytest.raises(ValueError, match="without image_grid_thw"):
        vl_ig(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"])
    with pytest.raises(qgraph.UnknownValue, match="no vision encoder"):
        qgraph.instrument(sdpa_model, values=["vision.image_features"])
    with pytest.raises(TypeError, match="text-only"):
        qgraph.instrument(sdpa_model)(**inputs)


def test_support_table_lists_vision_values(vl_model, vl_ig):
    table = qgraph.support(vl_model)
    names = [row.name for row in table.rows]
    assert "vision.layers.{j}.self_attn.attention_probabilities" in names and "vision.image_features" in names
    row = next(row for row in table.rows if row.name == "vision.layers.{j}.layer_output")
    assert row.blocks == {0: None, 1: None} and row.shape == (1, "patches", 32)


@pytest.mark.compat
def test_text_only_generation_on_the_image_text_model(processor, vl_model, vl_ig):
    """generate runs the text program of the image-text model: HF's greedy ids, left padding included;
    images are refused with a clear message (issue 8)."""
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = vl_ig.generate(ids, mask, max_new_tokens=5, values=["layers.3.layer_output"])
    with torch.no_grad():
        reference = vl_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(out.sequences, reference)
    fresh = vl_ig(out.sequences[1:, :13])
    torch.testing.assert_close(out.steps[3]["layers.3.layer_output"][1:, -1], fresh["layers.3.layer_output"][:, -1],
                               atol=1e-5, rtol=0)
    inputs = processor(text=prompt(processor, 1), images=[image(64, 64, 0)])
    with pytest.raises(NotImplementedError, match="images"):
        vl_ig.generate(**inputs, max_new_tokens=2)


def test_the_image_program_repeats_its_text_and_vision_blocks_exactly(vl_model):
    from qgraph.export import trace as export_module
    from qgraph.families import family_for
    from qgraph.export.repeat import repeated_blocks
    family = family_for(vl_model)
    blocks = repeated_blocks(vl_model, family, images=True)
    assert [b.path for b in blocks] == ["model.language_model.layers", "model.visual.blocks"]
    assert [b.path for b in repeated_blocks(vl_model, family, images=False)] == ["model.language_model.layers"]
    full, _ = export_module._export(vl_model, family, True, export_module.TEXT_INPUTS + family.images.inputs, [])
    repeated = export_module.export_model(vl_model).program
    assert graph_structure(repeated) == graph_structure(full)

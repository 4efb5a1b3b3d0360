"""Video on the image-text model (issue 39): the vision values over a video's patches (packed after the
images), vision.video_features, per-span patterns, text values at video tokens and edits, all against
Hugging Face's forward with plain hooks; one program for images, videos and both."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import qgraph
from qgraph.testing import load_processor, tiny_qwen3_5_vl, video, video_prompt

VALUES = ["vision.layers.*.layer_output", "vision.patch_embeddings", "vision.image_features", "vision.video_features",
          "vision.layers.*.self_attn.attention_probabilities", "vision.layers.*.self_attn.attention_values",
          "vision.layers.*.self_attn.attention_head_outputs", "layers.*.layer_output"]
CLOSE = dict(atol=1e-5, rtol=1e-5)  # one tower run over images and videos vs transformers' two


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(tiny_qwen3_5_vl(tmp_path_factory.mktemp("tiny-qwen3_5-vl-video")))


@pytest.fixture(scope="module")
def model(processor):
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(processor.tokenizer.name_or_path).eval()


@pytest.fixture(scope="module")
def ig(model):
    return qgraph.instrument(model, values=VALUES, edits=["vision.video_features"])


def image(height, width, seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def hooked(model, inputs, vision_edit=None, merger_edit=None):
    """Transformers' forward with plain hooks: every vision block's output and the merger's, per tower
    call (images first, then videos, as the forward runs them), and each text block's output.
    ``vision_edit(call, output)`` / ``merger_edit(call, output)`` may change the first block's / the
    merger's output of a call."""
    record = {"vision": [], "merger": [], "text": {}}
    visual = model.model.visual

    def block_hook(index):
        def hook(module, args, output):
            if index == 0 and vision_edit is not None:
                output = vision_edit(len(record["merger"]), output)
            record["vision"].append((len(record["merger"]), index, output))
            return output
        return hook

    def merger_hook(module, args, output):
        if merger_edit is not None:
            output = merger_edit(len(record["merger"]), output)
        record["merger"].append(output)
        return output

    def text_hook(index):
        def hook(module, args, output):
            record["text"][index] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [block.register_forward_hook(block_hook(j)) for j, block in enumerate(visual.blocks)]
    handles.append(visual.merger.register_forward_hook(merger_hook))
    handles += [layer.register_forward_hook(text_hook(i)) for i, layer in enumerate(model.model.language_model.layers)]
    try:
        with torch.no_grad():
            record["logits"] = model(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()
    calls = len(record["merger"])
    record["blocks"] = {j: torch.cat([out for call in range(calls) for c, i, out in record["vision"] if c == call and i == j])
                        for j in range(len(visual.blocks))} if calls else {}
    return record


def assert_matches(out, ref, inputs, videos_call: int):
    """qgraph's values equal the hooked forward's: the vision stream packed over the tower's calls,
    video_features the video call's merger output, text blocks at every real token."""
    torch.testing.assert_close(out.logits, ref["logits"], atol=1e-6, rtol=0)
    for j, packed in ref["blocks"].items():
        torch.testing.assert_close(out[f"vision.layers.{j}.layer_output"][0], packed, **CLOSE)
    torch.testing.assert_close(out["vision.video_features"], ref["merger"][videos_call], **CLOSE)
    real = inputs["attention_mask"].bool()
    for i, hidden in ref["text"].items():
        torch.testing.assert_close(out[f"layers.{i}.layer_output"][real], hidden[real], **CLOSE)


def assert_patterns(out, inputs):
    """One pattern per image and per temporal patch of each video, each over its own span: its pattern
    times its values is its part of the head outputs."""
    frames = [1] * len(inputs.get("image_grid_thw", ())) + \
        [int(t) for t in inputs["video_grid_thw"][:, 0]]
    spans = [int(g[1] * g[2]) for g in inputs.get("image_grid_thw", [])] + \
        [int(g[1] * g[2]) for g in inputs["video_grid_thw"] for _ in range(int(g[0]))]
    host = "vision.layers.1.self_attn"
    patterns = out[f"{host}.attention_probabilities"]
    assert len(patterns) == sum(frames) and [p.shape[-1] for p in patterns] == spans
    values, heads = out[f"{host}.attention_values"][0], out[f"{host}.attention_head_outputs"][0]
    start = 0
    for pattern, size in zip(patterns, spans):
        mixed = (pattern @ values[:, start:start + size]).transpose(0, 1)
        torch.testing.assert_close(mixed, heads[start:start + size], **CLOSE)
        start += size


@pytest.fixture(scope="module")
def one_video(processor):
    return processor(text=video_prompt(processor), videos=[video(4, 64, 96, seed=0)])


def test_the_processor_lays_out_each_temporal_patch(processor, model, one_video):
    ids = one_video["input_ids"][0].tolist()
    config = model.config
    t, h, w = one_video["video_grid_thw"][0].tolist()
    assert (t, h, w) == (2, 4, 6) and one_video["pixel_values_videos"].shape == (t * h * w, 3 * 2 * 16 * 16)
    text = processor.tokenizer.decode(ids)
    assert "<0.2 seconds><|vision_start|>" in text and "<1.2 seconds><|vision_start|>" in text
    assert ids.count(config.video_token_id) == t * h * w // 4 and ids.count(config.vision_start_token_id) == t
    assert torch.equal(one_video["mm_token_type_ids"], 2 * (one_video["input_ids"] == config.video_token_id).int())


@pytest.mark.compat
def test_one_video_equals_the_hooked_forward(processor, model, ig, one_video):
    given = {k: v for k, v in one_video.items() if k != "mm_token_type_ids"}  # qgraph derives it
    out = ig(**given)
    ref = hooked(model, one_video)
    assert_matches(out, ref, one_video, videos_call=0)
    assert out["vision.image_features"].shape[0] == 0
    assert_patterns(out, one_video)


@pytest.mark.compat
def test_a_padded_batch_of_two_videos_equals_the_hooked_forward(processor, model, ig):
    processor.tokenizer.padding_side = "left"
    texts = [video_prompt(processor, text="short"), video_prompt(processor, text="a longer question about it")]
    inputs = processor(text=texts, videos=[video(2, 32, 64, seed=1), video(6, 64, 32, seed=2)], padding=True)
    assert inputs["attention_mask"][0].eq(0).any() and inputs["video_grid_thw"].tolist() == [[1, 2, 4], [3, 4, 2]]
    out = ig(**inputs)
    assert_matches(out, hooked(model, inputs), inputs, videos_call=0)
    assert_patterns(out, inputs)


@pytest.fixture(scope="module")
def image_and_video(processor):
    return processor(text=video_prompt(processor, images=1), images=[image(48, 80, 3)],
                     videos=[video(4, 32, 64, seed=4)])


@pytest.mark.compat
def test_an_image_and_a_video_equal_the_hooked_forward(model, ig, image_and_video):
    inputs = image_and_video
    out = ig(**inputs)
    ref = hooked(model, inputs)
    assert len(ref["merger"]) == 2  # transformers ran the tower twice: the image, then the video
    assert_matches(out, ref, inputs, videos_call=1)
    torch.testing.assert_close(out["vision.image_features"], ref["merger"][0], **CLOSE)
    image_patches = int(inputs["image_grid_thw"].prod())
    # the packed row is the image's patches, then the video's (not the other way round)
    torch.testing.assert_close(out["vision.patch_embeddings"][0, :image_patches],
                               model.model.visual.patch_embed(inputs["pixel_values"]), **CLOSE)
    assert_patterns(out, inputs)


@pytest.mark.compat
def test_edits_at_video_values_equal_hooked_edits(model, ig, image_and_video):
    inputs = image_and_video
    first = int(inputs["image_grid_thw"].prod())
    patches = int(inputs["video_grid_thw"].prod())
    frame = int(inputs["video_grid_thw"][0, 1:].prod())
    # zero the video's second temporal patch in the first vision block
    out = ig(**inputs, edits={"vision.layers.0.layer_output": qgraph.Zero(positions=range(first + frame, first + patches))})

    def zero_second_frame(call, output):
        if call == 1:
            output = output.clone()
            output[frame:] = 0
        return output

    ref = hooked(model, inputs, vision_edit=zero_second_frame)
    torch.testing.assert_close(out.logits, ref["logits"], atol=1e-6, rtol=0)
    assert out["vision.layers.0.layer_output"][0, first + frame:first + patches].eq(0).all()
    # scale what the video scatter writes (a declared edit slot)
    scaled = ig(**inputs, edits={"vision.video_features": qgraph.Scale(0.5)})
    ref = hooked(model, inputs, merger_edit=lambda call, output: output * 0.5 if call == 1 else output)
    torch.testing.assert_close(scaled.logits, ref["logits"], atol=1e-6, rtol=0)
    plain = ig(**inputs)
    assert not torch.allclose(scaled.logits, plain.logits)


def test_one_program_serves_images_videos_and_both(processor, model, ig, image_and_video, one_video, monkeypatch):
    from qgraph.export import trace
    from qgraph.program import Program
    ran, exports = [], []
    run, export = Program.run, trace._export
    monkeypatch.setattr(Program, "run", lambda self, *a, **k: ran.append(self) or run(self, *a, **k))
    monkeypatch.setattr(trace, "_export", lambda *a, **k: exports.append(a[2]) or export(*a, **k))
    fresh = qgraph.instrument(model, values=["vision.video_features", "vision.image_features", "layers.3.layer_output"])
    only_image = processor(text=video_prompt(processor, videos=0, images=1), images=[image(64, 32, 5)])
    calls = {"images": only_image, "videos": one_video, "both": image_and_video,
             "neither": processor(text="only words here")}
    outputs = {kind: fresh(**inputs) for kind, inputs in calls.items()}
    assert ran[0] is ran[1] is ran[2]  # one program for images, videos and both
    assert ran[3] is not ran[0] and not ran[3].exported.images  # a text-only call runs the text program
    assert exports.count(True) <= 1  # the image-text program exported at most once (else the session's)
    for kind, inputs in calls.items():
        torch.testing.assert_close(outputs[kind].logits, hooked(model, inputs)["logits"], atol=1e-6, rtol=0)
    assert outputs["images"]["vision.video_features"].shape[0] == 0
    assert "vision.video_features" not in outputs["neither"]


def test_bad_video_inputs_say_what_is_wrong(ig, one_video):
    inputs = dict(one_video)
    with pytest.raises(ValueError, match="video_grid_thw came without pixel_values_videos"):
        ig(input_ids=inputs["input_ids"], video_grid_thw=inputs["video_grid_thw"])
    with pytest.raises(ValueError, match="pixel_values_videos came without video_grid_thw"):
        ig(input_ids=inputs["input_ids"], pixel_values_videos=inputs["pixel_values_videos"])
    ids = inputs["input_ids"].clone()
    ids[0, (ids[0] == ig.config.video_token_id).nonzero()[0]] = ord("a")  # one video token short
    with pytest.raises(ValueError, match="input_ids hold 11 video tokens .* but the videos give 12"):
        ig(input_ids=ids, pixel_values_videos=inputs["pixel_values_videos"], video_grid_thw=inputs["video_grid_thw"])

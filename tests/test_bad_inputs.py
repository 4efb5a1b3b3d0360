"""Every bad input gets a named error raised by qgraph, never a traceback from inside torch (issue 12, part 5).

Each test asserts the exception type and that the message names the problem and the way out.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import qgraph
from qgraph import Add, EditError, Replace, Scale, Zero
from qgraph.export import disk_cache as cache
from conftest import hf_logits, random_ids

HEADS = "layers.3.self_attn.attention_head_outputs"  # [batch seq num_heads head_dim], 4 heads on the tiny model
STATES = "layers.0.linear_attn.states"
STATE = "layers.0.linear_attn.state"


@pytest.fixture(scope="module")
def small(sdpa_model):
    """The sdpa load with the block outputs and two declared edit slots."""
    return qgraph.instrument(sdpa_model, values=["layers.*.layer_output"], edits=["layers.1.layer_output", HEADS])


@pytest.fixture(scope="module")
def ids6():
    return random_ids(2, 6, seed=3)


def call(instrumented, *args, **kwargs):
    with torch.no_grad():
        return instrumented(*args, **kwargs)


# -- call inputs (qgraph/inputs.py) ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, "rows"])
def test_token_ids_outside_the_vocabulary(small, sdpa_model, bad):
    rows = sdpa_model.get_input_embeddings().num_embeddings
    token = rows if bad == "rows" else bad
    with pytest.raises(ValueError, match=rf"input_ids hold {token}, outside the vocabulary: the model's embedding "
                                         rf"has {rows} rows \(ids 0 to {rows - 1}\)\. Tokenize with this model's "
                                         rf"tokenizer"):
        call(small, torch.tensor([[5, token, 7]]))


@pytest.mark.parametrize("shape", [(1, 0), (0, 4)])
def test_an_empty_prompt(small, shape):
    with pytest.raises(ValueError, match=rf"input_ids has shape {re.escape(str(shape))}: an empty prompt; give at "
                                         r"least one prompt of at least one token"):
        call(small, torch.zeros(shape, dtype=torch.long))


def test_a_float_attention_mask(small, ids6):
    with pytest.raises(TypeError, match=r"attention_mask is torch.float32; it must be bool or integer 1 \(token\) / 0 "
                                        r"\(padding\).*attention_mask.long\(\)"):
        call(small, ids6, torch.ones(2, 6))


def test_an_attention_mask_with_values_other_than_0_and_1(small, ids6):
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 2] = 2
    with pytest.raises(ValueError, match=r"attention_mask holds \[2\]; it must hold only 1 \(token\) and "
                                         r"0 \(padding\)"):
        call(small, ids6, mask)


def test_a_wrongly_shaped_attention_mask(small, ids6):
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\) but input_ids has \(2, 6\); "
                                         r"they must match"):
        call(small, ids6, torch.ones(2, 5, dtype=torch.long))


def test_bool_and_integer_masks_are_taken_and_equal(small, sdpa_model, ids6):
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])  # left padding
    expected = hf_logits(sdpa_model, ids6, mask)
    for given in (mask, mask.bool(), mask.int()):
        torch.testing.assert_close(call(small, ids6, given).logits, expected, atol=1e-5, rtol=0)


def test_a_list_of_token_ids_is_converted(small, sdpa_model, ids6):
    torch.testing.assert_close(call(small, ids6.tolist(), ids6.ne(-1).long().tolist()).logits,
                               hf_logits(sdpa_model, ids6), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"add the batch dim with input_ids\[None\]"):
        call(small, ids6[0].tolist())


def test_ragged_lists_of_token_ids(small):
    with pytest.raises(qgraph.InvalidArgument, match=r"input_ids: its rows have different lengths: pad them "
                                                     r"\(tokenizer\(texts, padding=True"):
        call(small, [[1, 2, 3], [4, 5]])
    with pytest.raises(qgraph.InvalidType, match=r"input_ids: object is not a tensor of integers"):
        call(small, object())


def test_text_instead_of_token_ids(small):
    with pytest.raises(TypeError, match=r"input_ids is the text 'Hello': tokenize it first"):
        call(small, "Hello")


def test_unknown_call_keyword_arguments(small, ids6):
    with pytest.raises(TypeError, match=r"unexpected inputs \['foo'\]: an instrumented model takes input_ids, "
                                        r"attention_mask and edits$"):
        call(small, ids6, foo=1)
    with pytest.raises(TypeError, match=r"unexpected inputs \['output_hidden_states'\].*output_hidden_states: ask for "
                                        r"values=\['layers\.\*\.layer_output'\] instead"):
        call(small, ids6, output_hidden_states=True)


def test_an_all_padding_row(small, sdpa_model, ids6):
    # Hugging Face returns finite values for a row with no token: meaningless, so qgraph refuses the row
    mask = torch.tensor([[1] * 6, [0] * 6])
    assert torch.isfinite(hf_logits(sdpa_model, ids6, mask)).all()
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] are all padding: those prompts hold no token.*"
                                         r"Drop those rows, or give each at least one token"):
        call(small, ids6, mask)


# -- values= and their options ---------------------------------------------------------------------------------
def test_values_none_is_no_values(sdpa_model, ids6):
    instrumented = qgraph.instrument(sdpa_model, values=None)
    assert instrumented.values == []
    out = call(instrumented, ids6)
    assert out.values == {}
    torch.testing.assert_close(out.logits, hf_logits(sdpa_model, ids6), atol=1e-5, rtol=0)


def test_a_bare_string_is_one_name(sdpa_model):
    assert qgraph.instrument(sdpa_model, values="layers.*.layer_output").values == [
        f"layers.{i}.layer_output" for i in range(4)]


def test_an_int_as_values(sdpa_model):
    with pytest.raises(TypeError, match=r"int 3 is not a value name or a list of them: give names as strings"):
        qgraph.instrument(sdpa_model, values=3)


def test_a_non_name_inside_values_or_edits(sdpa_model, small, ids6):
    with pytest.raises(TypeError, match=r"int 3: not a value name; names are strings, e.g. 'layers\.3\.layer_output'"):
        qgraph.instrument(sdpa_model, values=["layers.0.layer_output", 3])
    with pytest.raises(TypeError, match=r"int 1 is not a value name"):
        call(small, ids6, edits={1: Zero()})


def test_a_non_dict_option(sdpa_model):
    with pytest.raises(TypeError, match=r"values=\{'layers\.0\.layer_output': 3\}: a value's options are a dict, "
                                        r"e\.g\. \{'grad': True\}"):
        qgraph.instrument(sdpa_model, values={"layers.0.layer_output": 3})


@pytest.mark.parametrize("positions, error, match", [
    ([], ValueError, r"the list is empty, so it selects nothing; positions takes an int or a non-empty list of ints"),
    (slice(0, 2), TypeError, r"got slice\(0, 2, None\); positions takes .* \(for a range write "
                             r"list\(range\(start, stop\)\)\)"),
    ([0, "a"], TypeError, r"\['a'\] are not ints; positions takes an int or a non-empty list of ints"),
    ([0.5], TypeError, r"\[0\.5\] are not ints"),
])
def test_bad_state_positions(sdpa_model, positions, error, match):
    with pytest.raises(error, match=rf"'{STATE}' option positions: " + match):
        qgraph.instrument(sdpa_model, values={STATE: {"positions": positions}})


@pytest.mark.parametrize("heads, error, match", [
    ([99], ValueError, r"heads: \[99\] out of range; it has 4 heads \(0 to 3, or negative from the end\)"),
    ([], ValueError, r"heads: the list is empty, so it selects nothing"),
])
def test_bad_state_heads(sdpa_model, heads, error, match):
    with pytest.raises(error, match=rf"'{STATES}' option " + match):
        qgraph.instrument(sdpa_model, values={STATES: {"heads": heads}})


@pytest.mark.parametrize("dtype", ["float16", torch.int64])
def test_an_unknown_states_dtype(sdpa_model, dtype):
    with pytest.raises(TypeError, match=rf"'{STATES}' option dtype: .* is not a floating torch dtype; give one such "
                                        r"as torch\.float32"):
        qgraph.instrument(sdpa_model, values={STATES: {"dtype": dtype}})


def test_good_state_options_are_normalised(sdpa_model, ids6):
    every = qgraph.instrument(sdpa_model, values={STATES: {"heads": [-1]}})
    one = qgraph.instrument(sdpa_model, values={STATE: {"positions": 2}})
    assert every.options[STATES]["heads"] == [3] and one.options[STATE]["positions"] == [2]
    states, state = call(every, ids6)[STATES], call(one, ids6)[STATE]
    assert states.shape == (2, 6, 1, 16, 16) and state.shape == (2, 1, 4, 16, 16)
    # head -1 is head 3; position 2's state is the third token's
    torch.testing.assert_close(states[:, 2, 0], state[:, 0, 3], atol=1e-6, rtol=0)


# -- edits (qgraph/edits.py) -----------------------------------------------------------------------------------
def test_heads_out_of_range(small, ids6):
    with pytest.raises(EditError, match=rf"Zero\(heads=\[99\]\) at '{HEADS}' .*\[99\] out of range for its num_heads "
                                        r"axis of size 4: give indices from -4 to 3"):
        call(small, ids6, edits={HEADS: Zero(heads=[99])})


def test_positions_out_of_range(small, ids6):
    with pytest.raises(EditError, match=r"Zero\(positions=\[6\]\) at 'layers\.1\.layer_output' .*out of range for its "
                                        r"seq axis of size 6: give indices from -6 to 5"):
        call(small, ids6, edits={"layers.1.layer_output": Zero(positions=[6])})


@pytest.mark.parametrize("make, error, match", [
    (lambda: Zero(positions=slice(0, 2)), TypeError, r"Zero\(positions=\.\.\.\): got slice\(0, 2, None\).*list\(range"),
    (lambda: Zero(heads=[]), ValueError, r"Zero\(heads=\.\.\.\): the list is empty, so it selects nothing"),
    (lambda: Add(torch.ones(64), positions=["last"]), TypeError, r"Add\(positions=\.\.\.\): \['last'\] are not ints"),
    (lambda: Scale("2"), TypeError, r"Scale\(factor=\.\.\.\): got str '2'; it takes a tensor \(or a number"),
    (lambda: Add(torch.ones(64), scale="a"), TypeError, r"Add\(scale='a'\): scale takes a number"),
    (lambda: Replace("x"), TypeError, r"Replace\(tensor=\.\.\.\): got str 'x'; it takes a tensor"),
])
def test_edits_are_checked_when_made(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_a_replace_tensor_of_the_wrong_shape(small, ids6):
    with pytest.raises(EditError, match=r"Replace at 'layers\.1\.layer_output' .*got a tensor of shape \(3,\), "
                                        r"expected one broadcastable to \(2, 6, 64\)"):
        call(small, ids6, edits={"layers.1.layer_output": Replace(torch.ones(3))})


def test_a_replace_tensor_of_the_wrong_dtype(small, ids6):
    with pytest.raises(EditError, match=r"Replace at 'layers\.1\.layer_output' .*the tensor is torch\.int64 but the "
                                        r"value is torch\.float32: give a floating tensor"):
        call(small, ids6, edits={"layers.1.layer_output": Replace(torch.ones(64, dtype=torch.long))})


def test_a_replace_tensor_on_another_device(small, ids6):
    with pytest.raises(EditError, match=r"Replace at 'layers\.1\.layer_output' .*the tensor is on meta but the value "
                                        r"is on cpu: move it there \(\.to\('cpu'\)\)"):
        call(small, ids6, edits={"layers.1.layer_output": Replace(torch.ones(64, device="meta"))})


def test_numbers_lists_and_tensor_factors_are_taken(small, ids6):
    base = call(small, ids6)["layers.1.layer_output"]
    as_list = call(small, ids6, edits={"layers.1.layer_output": Replace([0.5] * 64)})["layers.1.layer_output"]
    assert torch.equal(as_list, torch.full_like(base, 0.5))
    factor = torch.arange(6.0)[:, None]  # one factor per position
    scaled = call(small, ids6, edits={"layers.1.layer_output": Scale(factor)})["layers.1.layer_output"]
    torch.testing.assert_close(scaled, base * factor, atol=0, rtol=0)


def test_an_edit_that_is_neither_an_edit_nor_callable(small, ids6):
    with pytest.raises(EditError, match=r"the edit at 'layers\.1\.layer_output' .* is 3: give Replace, Add, Scale, "
                                        r"Zero, Edit or a function tensor -> tensor"):
        call(small, ids6, edits={"layers.1.layer_output": 3})


@pytest.mark.parametrize("function, match", [
    (lambda x: x[:, :1], r"returned \(2, 1, 64\); it must return a tensor of the value's shape \(2, 6, 64\)"),
    (lambda x: None, r"returned NoneType; it must return a tensor of the value's shape \(2, 6, 64\)"),
    (lambda x: x.long(), r"its result is torch\.int64 but the value is torch\.float32: give a floating tensor"),
])
def test_a_function_edit_that_returns_the_wrong_thing(small, ids6, function, match):
    with pytest.raises(EditError, match=r"the function edit at 'layers\.1\.layer_output' .*" + match):
        call(small, ids6, edits={"layers.1.layer_output": function})


def test_a_function_edit_that_raises_leaves_the_next_call_clean(small, sdpa_model, ids6):
    def broken(x):
        raise ZeroDivisionError("my bug")

    with pytest.raises(ZeroDivisionError, match="my bug") as error:
        call(small, ids6, edits={"layers.1.layer_output": broken})
    assert error.value.__notes__ == ["(raised by the function edit at 'layers.1.layer_output' (Residual "
                                     "[batch seq hidden_size]))"]
    assert torch.equal(call(small, ids6).logits, hf_logits(sdpa_model, ids6))


# -- the disk cache (qgraph/export/disk_cache.py) --------------------------------------------------------------------------
def _fresh(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


def test_a_cache_path_that_is_a_file(checkpoint, tmp_path, monkeypatch):
    blocking = tmp_path / "not-a-dir"
    blocking.write_text("")
    monkeypatch.setenv("QGRAPH_CACHE", str(blocking))
    monkeypatch.setenv("QGRAPH_PROGRAM_CACHE", "1")
    model = _fresh(checkpoint)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        instrumented = qgraph.instrument(model, values=["layers.0.layer_output"])
    messages = [str(w.message) for w in caught if "qgraph" in str(w.message)]
    assert messages == [f"qgraph: {blocking} is a file, not a directory, so exported programs are not cached on disk: "
                        f"point $QGRAPH_CACHE at a directory (or set QGRAPH_PROGRAM_CACHE=0)"]
    ids = random_ids(1, 5)
    torch.testing.assert_close(call(instrumented, ids).logits, hf_logits(model, ids), atol=1e-5, rtol=0)


def test_a_truncated_cache_file_warns_in_one_line(checkpoint, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("QGRAPH_CACHE", str(tmp_path))
    monkeypatch.setenv("QGRAPH_PROGRAM_CACHE", "1")
    model = _fresh(checkpoint)
    qgraph.instrument(model, values=["layers.0.layer_output"])
    path = cache.path_for(model, False)
    path.write_bytes(path.read_bytes()[:1000])  # a copy cut short
    capfd.readouterr()
    second = _fresh(checkpoint)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        instrumented = qgraph.instrument(second, values=["layers.0.layer_output"])
    messages = [str(w.message) for w in caught if "qgraph" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert messages[0].startswith(f"qgraph: ignoring the cached program {path} (") and messages[0].endswith(
        "); exporting again")
    assert "Traceback" not in capfd.readouterr().err  # torch's own traceback of the failed load is silenced
    assert not instrumented.exported.from_cache
    ids = random_ids(1, 5)
    torch.testing.assert_close(call(instrumented, ids).logits, hf_logits(second, ids), atol=1e-5, rtol=0)


# -- image inputs (qgraph/inputs.py) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The tiny image-text model instrumented for one value, and a good call's inputs: one 4x4-patch image."""
    from transformers import AutoModelForImageTextToText
    from qgraph.testing import tiny_qwen3_5_vl
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_5_vl(tmp_path_factory.mktemp("vl"))).eval()
    config = model.config
    grid = torch.tensor([[1, 4, 4]])
    ids = torch.tensor([[1, 2] + [config.image_token_id] * 4 + [3]])
    vision = config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(16, width, generator=torch.Generator().manual_seed(0))
    return qgraph.instrument(model, values=["vision.image_features"]), ids, pixels, grid


@pytest.mark.parametrize("change, error, match", [
    (lambda p, g: (p[:, :-1], g), ValueError, r"pixel_values has shape \(16, 1535\); it must be \[patches, 1536\].*"
                                              r"pass the processor's pixel_values, not an image tensor"),
    (lambda p, g: (p.long(), g), TypeError, r"pixel_values is torch\.int64; it must be the processor's normalised "
                                            r"floating patches"),
    (lambda p, g: (p, g[0]), ValueError, r"image_grid_thw has shape \(3,\); it must be \[images, 3\].*"
                                         r"image_grid_thw\[None\] for one image"),
    (lambda p, g: (p, -g), ValueError, r"image_grid_thw rows \[\[-1, -4, -4\]\] are not image grids: t, h and w must "
                                       r"be positive"),
])
def test_bad_image_inputs(vl, change, error, match):
    instrumented, ids, pixels, grid = vl
    pixel_values, image_grid_thw = change(pixels, grid)
    with pytest.raises(error, match=match):
        call(instrumented, ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw)


def test_a_wrongly_shaped_mm_token_type_ids(vl):
    instrumented, ids, pixels, grid = vl
    with pytest.raises(ValueError, match=r"mm_token_type_ids has shape \(1, 2\) but input_ids has \(1, 7\); they must "
                                         r"match \(or leave it out"):
        call(instrumented, ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=torch.zeros(1, 2))


def test_pixel_values_are_cast_to_the_vision_dtype_as_hf_does(vl):
    instrumented, ids, pixels, grid = vl
    expected = call(instrumented, ids, pixel_values=pixels, image_grid_thw=grid)["vision.image_features"]
    as_double = call(instrumented, ids, pixel_values=pixels.double(), image_grid_thw=grid.tolist())
    assert torch.equal(as_double["vision.image_features"], expected)

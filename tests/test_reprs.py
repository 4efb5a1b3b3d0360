"""Short reprs (issue 28, item 1): ``repr(out)`` is a header and a row per value (name, shape, dtype),
never tensor data, and ``out._repr_html_()`` the same as a self-contained table; ``out.keys()``,
``out.items()`` and ``out.stack(glob)`` (block order: numeric); the same short reprs for an
instrumented model (its module tree is ``ig.tree()``), ``qgraph.support``, generate's output and a
loaded capture."""
from __future__ import annotations

import re

import pytest
import torch

import qgraph
from qgraph.capture import capture, load_capture
from qgraph.output import Output
from qgraph.reprs import TEXT_ROWS


def _expand(name: str) -> list[str]:
    """``layers.{0-2,5}.x`` -> the names it stands for."""
    found = re.search(r"\{([\d,-]+)\}", name)
    if found is None:
        return [name]
    blocks = []
    for part in found.group(1).split(","):
        low, _, high = part.partition("-")
        blocks += range(int(low), int(high or low) + 1)
    return [name[:found.start()] + str(block) + name[found.end():] for block in blocks]


def _rows(text: str, columns: int) -> dict[str, tuple]:
    """The text table's rows, each name expanded: ``{name: (cells...)}``."""
    rows = {}
    for line in text.splitlines()[2:]:  # the title, the column names
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) == columns and line.startswith("  "):
            for name in _expand(cells[0]):
                rows[name] = tuple(cells[1:])
    return rows


def _html_rows(page: str) -> list[list[str]]:
    body = page.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body)]


def _self_contained(page: str) -> None:
    assert "<table" in page and "http" not in page and "<script" not in page and "<link" not in page


@pytest.fixture(scope="module")
def standard(ig, out) -> Output:
    """The tiny model's call with every standard value (no module ports)."""
    values = {name: tensor for name, tensor in out.values.items() if ig.catalogue[name].spec is not None}
    return Output(out.logits, values, out.blocks)


def _spelled(value) -> tuple[str, str]:
    if isinstance(value, torch.Tensor):
        return "[" + " ".join(map(str, value.shape)) + "]", str(value.dtype).removeprefix("torch.")
    return f"[{len(value)}]", type(value).__name__


# -- Output -------------------------------------------------------------------------------------------------------
def test_output_repr_is_short_and_names_every_value(standard):
    text = repr(standard)
    assert len(standard.values) > 60  # more values than the repr has lines
    assert len(text.splitlines()) < 60
    assert text.splitlines()[0] == f"Output: logits [2 70 272] float32, {len(standard.values)} values on cpu"
    assert "tensor(" not in text and not re.search(r"\d\.\d", text)  # no tensor data
    rows = _rows(text, 3)
    assert rows == {name: _spelled(value) for name, value in standard.values.items()}
    assert "layers.{0-3}.layer_output" in text and "layers.{0-2}.linear_attn.decays" in text  # one row per value kind
    assert re.search(r"^  layers\.3\.self_attn\.attention_probabilities +\[2 4 70 70\] +float32$", text, re.M)
    first = next(line.split()[0] for line in text.splitlines() if "{" in line)  # the note names the first group
    assert text.splitlines()[-1] == f"({first}: one row for blocks {first.split('{')[1].split('}')[0]}, alike in " \
                                    f"every other column)"


def test_output_repr_with_module_ports_is_cut_short(out):
    text = repr(out)
    assert len(out.values) > 200
    assert len(text.splitlines()) < 60 and re.search(r"^  \.\.\. \d+ more$", text, re.M)


def test_the_group_note_is_there_only_where_rows_are_grouped():
    grouped = Output(None, {**{f"layers.{i}.x": torch.ones(2) for i in (0, 1, 2, 5)}, "final": torch.zeros(3)}, 6)
    lines = repr(grouped).splitlines()
    assert lines[2:] == ["  layers.{0-2,5}.x  [2]    float32", "  final             [3]    float32",
                         "(layers.{0-2,5}.x: one row for blocks 0-2,5, alike in every other column)"]
    assert "one row for" not in grouped._repr_html_()  # the HTML has a row per value: nothing grouped there
    alone = Output(None, {"layers.1.x": torch.ones(2), "layers.2.x": torch.ones(3), "final": torch.zeros(2)}, 3)
    assert "one row for" not in repr(alone) and "{" not in repr(alone)  # shapes differ: nothing grouped
    assert repr(alone).splitlines()[-1] == "  final       [2]    float32"
    past = {**{f"v{i}": torch.zeros(1) for i in range(TEXT_ROWS)}, **{f"layers.{i}.x": torch.ones(2) for i in range(3)}}
    text = repr(Output(None, past, 3))  # the grouped row is past the rows shown: no note for what is not there
    assert text.splitlines()[-1] == "  ... 1 more" and "one row for" not in text


def test_output_html_is_a_table_with_a_row_per_value(standard):
    page = standard._repr_html_()
    _self_contained(page)
    rows = _html_rows(page)
    assert {row[0]: tuple(row[1:]) for row in rows} == {name: _spelled(v) for name, v in standard.values.items()}
    assert [row[0] for row in rows] == list(standard.values)  # in capture order
    assert "tensor(" not in page and not re.search(r"\d\.\d", page)


def test_keys_and_items_are_the_values_in_capture_order(standard):
    assert list(standard.keys()) == list(standard.values)
    assert all(tensor is standard.values[name] for name, tensor in standard.items())
    fake = Output(torch.zeros(1, 2, 3), {"layers.1.x": torch.ones(2), "final_norm_output": torch.zeros(2)}, 2)
    assert list(fake.keys()) == ["layers.1.x", "final_norm_output"]  # out.logits is not one of them
    assert dict(fake) == dict(fake.items())  # keys() and [] make an Output a mapping to dict()
    assert "logits [1 2 3] float32, 2 values" in repr(fake)


def test_stack_is_in_block_order(standard):
    stacked = standard.stack("layers.*.layer_output")
    assert torch.equal(stacked, torch.stack([standard[f"layers.{i}.layer_output"] for i in range(4)]))
    assert torch.equal(standard.stack("layers[*].layer_output"), stacked)
    assert torch.equal(standard.stack("layers.*.linear_attn.decays"),
                       torch.stack([standard[f"layers.{i}.linear_attn.decays"] for i in range(3)]))


def test_stack_orders_blocks_numerically_and_refuses_what_does_not_stack():
    tensors = {f"layers.{i}.layer_output": torch.full((2, 3), float(i)) for i in (10, 2, 11, 0, 1)}
    fake = Output(None, {**tensors, "layers.3.mlp.mlp_neurons": torch.zeros(5)}, blocks=12)
    assert fake.stack("layers.*.layer_output")[:, 0, 0].tolist() == [0, 1, 2, 10, 11]
    assert "layers.{0-2,10,11}.layer_output" in repr(fake) and "no logits" in repr(fake)
    with pytest.raises(qgraph.NotCaptured, match="matches no captured value"):
        fake.stack("layers.*.attention_output")
    fake.values["layers.5.layer_output"] = torch.zeros(4)
    with pytest.raises(qgraph.InvalidArgument, match=r"layers\.5\.layer_output \[4\]"):
        fake.stack("layers.*.layer_output")


# -- the instrumented model, support, generate, capture -----------------------------------------------------------
def test_instrumented_model_repr_is_short_and_tree_is_the_annotated_tree(ig, sdpa_model):
    text = repr(ig)
    lines = text.splitlines()
    assert len(lines) < 15
    assert lines[0] == ("InstrumentedModel of Qwen3_5ForCausalLM (family qwen3_5_text, 4 blocks: 3 linear_attention, "
                        "1 full_attention)")
    assert f"values       {len(ig.values)}: " in text and "compiled     no" in text and "logits       yes" in text
    assert ig.tree().startswith("Qwen3_5ForCausalLM(") and "(attention_gate)* -> " in ig.tree()
    _self_contained(ig._repr_html_())
    small = qgraph.instrument(sdpa_model, values=["layers.*.layer_output"], edits=["layers.1.layer_output"],
                              logits=False)
    text = repr(small)
    assert "values       4: layers.{0-3}.layer_output" in text
    assert "edit slots   1: layers.1.layer_output" in text and "logits       no (values only)" in text
    assert [row[0] for row in _html_rows(small._repr_html_())][:3] == ["values", "edit slots", "logits"]


def test_support_repr_is_short_and_str_keeps_the_reasons(sdpa_model):
    table = qgraph.support(sdpa_model)
    text = repr(table)
    rows = _rows(text, 4)
    assert set(rows) == {row.name for row in table.rows}
    assert len(text.splitlines()) == len(table.rows) + 3  # title, column names, the note
    assert rows["layers.{i}.linear_attn.decays"] == ("Gates", "[batch seq 4]", "blocks 0-2")
    assert rows["layers.{i}.self_attn.attention_gate"][-1] == "blocks 3" and rows["logits"][-1] == "yes"
    reason = "block 0 is a linear_attention"
    assert reason not in text and "linear_attention" in str(table)  # print(table): the long one, with reasons
    page = table._repr_html_()
    _self_contained(page)
    assert len(_html_rows(page)) == len(table.rows) and "is a linear_attention" in page


def test_generate_output_repr(ig, ids):
    generated = ig.generate(ids[:, :8], max_new_tokens=2)
    text = repr(generated)
    assert text.splitlines()[0] == (f"GenerateOutput: sequences [2 10] (8 prompt + 2 new tokens), 3 steps (0: the prompt "
                                    f"pass, k: the pass over new token k), {len(generated.steps[0])} values per step")
    assert len(text.splitlines()) < 60 and "tensor(" not in text
    rows = _rows(text, 4)
    assert rows["layers.2.layer_output"] == ("[2 8 64]", "[2 1 64]", "float32")
    assert rows["layers.3.self_attn.attention_probabilities"] == ("[2 4 8 8]", "[2 4 1 9]", "float32")
    page = generated._repr_html_()
    _self_contained(page)
    assert len(_html_rows(page)) == len(generated.steps[0])


def test_loaded_capture_repr(sdpa_model, tokenizer, tmp_path):
    texts = ["a short document", "another one, a little longer than the first"]
    run = capture(sdpa_model, tokenizer, texts, ["layers.*.layer_output", "layers.0.linear_attn.decays"],
                  tmp_path / "acts", context=16, batch_size=2, dtype=torch.float32, progress=False)
    loaded = load_capture(run.out)
    text = repr(loaded)
    assert text.splitlines()[0].startswith(f"Capture at {run.out}: {len(loaded)} rows of 16 tokens ({run.tokens} real), "
                                           f"5 values, {run.shards} shard")
    assert "from Qwen3_5ForCausalLM" in text.splitlines()[0]
    assert _rows(text, 3) == {**{f"layers.{i}.layer_output": ("Residual [batch seq hidden_size]", "float32")
                                 for i in range(4)},
                              "layers.0.linear_attn.decays": ("Gates [batch seq value_heads]", "float32")}
    page = loaded._repr_html_()
    _self_contained(page)
    assert len(_html_rows(page)) == 5

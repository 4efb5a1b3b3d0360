"""``qgraph demo`` (issue 57, item 3): one screen that tells the truth. It fits 40 lines of at most 100
characters and says the tiny checkpoint's weights are random; the statistics it prints are those of the
values a separate ``qgraph.instrument`` call captures; the edit's effect it prints is what zeroing the head
does to the plain transformers model; it loads attention as ``from_pretrained(path)`` does (the load
``qgraph.instrument`` gets in every example); ``--table`` and ``--tree`` print the long forms."""
from __future__ import annotations

import io
import re
from contextlib import redirect_stdout

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import qgraph
from qgraph import cli
from qgraph.demo import block_mixers, default_values
from qgraph.values.support import plain_text

PROMPT = "The Eiffel Tower is in the city of"  # the demo's default prompt
ROW = re.compile(r"^(\S+)\s+\(([\d, ]+)\)\s+(\d+)\s+(-?\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$")  # a value's statistics


def demo(*argv: str) -> str:
    """What ``qgraph demo argv`` prints (it must succeed)."""
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert cli.main(["demo", *argv]) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def screens() -> dict[str, str]:
    """The demo, and the demo with its long forms, each run once; the disk cache keeps the tiny model's
    program between the runs (each loads a fresh model)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QGRAPH_PROGRAM_CACHE", "1")
        yield {"short": demo(), "long": demo("--table", "--tree")}


@pytest.fixture(scope="module")
def path():
    return cli.checkpoint_path(None)  # the embedded tiny checkpoint the demo loads


@pytest.fixture(scope="module")
def reference(path):
    """The tiny checkpoint loaded and called apart from the demo: (model, tokenized prompt)."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return model, AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")


def test_fits_one_screen_and_says_the_weights_are_random(screens):
    lines = screens["short"].splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 100, (len(lines), max(map(len, lines)))
    text = screens["short"]
    assert "Its weights are random, so its predictions are noise" in text
    assert "4 blocks: 0-2 linear_attention (gated DeltaNet), 3 full_attention (gated attention)" in text
    for where in ("qgraph demo --table", "qgraph demo --tree", "qgraph support", "qgraph render --block 3",
                  "docs/getting-started.md"):
        assert where in text, where
    assert "== support table ==" not in text and "Qwen3_5ForCausalLM(" not in text  # no long form unasked


def test_statistics_are_those_of_the_values_instrument_captures(screens, reference):
    model, inputs = reference
    values = default_values(block_mixers(model))
    with torch.no_grad():
        out = qgraph.instrument(model, values=values)(**inputs)
    rows = {found.group(1): found.groups()[1:] for line in screens["short"].splitlines() if (found := ROW.match(line))}
    assert list(rows) == values  # every value asked, in order, each with its statistics
    for name, (shape, masked, mean, std, largest) in rows.items():
        value = out[name].double()
        assert tuple(int(size) for size in shape.split(",")) == tuple(value.shape), name
        assert int(masked) == 0, name  # nothing in these is -inf
        for printed, computed in ((mean, value.mean()), (std, value.std()), (largest, value.abs().max())):
            assert float(printed) == pytest.approx(computed.item(), abs=6e-5), (name, printed, computed)


def test_the_edit_does_what_zeroing_the_head_in_transformers_does(screens, reference, path):
    model, inputs = reference
    attention = model.model.layers[3].self_attn
    width = model.config.head_dim  # head 0's columns of what o_proj reads (after the gate, per head)

    def zero_head_0(module, args):
        heads = args[0].clone()
        heads[..., :width] = 0
        return (heads,)

    with torch.no_grad():
        plain = model(**inputs).logits[0, -1]
        handle = attention.o_proj.register_forward_pre_hook(zero_head_0)
        try:
            edited = model(**inputs).logits[0, -1]
        finally:
            handle.remove()
    text = screens["short"]
    assert "edits={'layers.3.self_attn.attention_head_outputs': qgraph.Zero(heads=[0])}" in text
    before, after, change = re.search(r"logit of .* (-?\d+\.\d+) -> (-?\d+\.\d+) \(([+-]\d+\.\d+)\)", text).groups()
    top = int(plain.argmax())
    assert float(before) == pytest.approx(plain[top].item(), abs=6e-5)
    assert float(after) == pytest.approx(edited[top].item(), abs=6e-5)
    assert float(change) == pytest.approx((edited - plain)[top].item(), abs=6e-5)
    largest = float(re.search(r"largest logit change: ([+-]\d+\.\d+)", text).group(1))
    differences = edited - plain
    assert largest == pytest.approx(differences[differences.abs().argmax()].item(), abs=6e-5)
    assert abs(largest) > 1e-3  # the edit moves the logits (the check above can fail)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert f"top token after: {tokenizer.decode([int(edited.argmax())])!r}" in text


def test_attention_is_the_load_instrument_gets(screens, path):
    printed = re.search(r"attention (\w+)$", screens["short"], re.M).group(1)
    assert printed == AutoModelForCausalLM.from_pretrained(path).config._attn_implementation == "sdpa"
    for argv in (["demo"], ["support"], ["render", "--out", "x.svg"], ["serve"]):  # no default of the CLI's own
        assert cli.build_parser().parse_args(argv).attn_implementation is None, argv
    assert cli.build_parser().parse_args(["serve", "--attn-implementation", "eager"]).attn_implementation == "eager"


def test_table_and_tree_print_the_long_forms(screens, reference):
    model, _ = reference
    short, long = screens["short"], screens["long"]
    assert long.startswith(short.split("qgraph.instrument(")[0])  # the same screen first
    table = long.split("== support table ==\n", 1)[1].split("\n== annotated module tree", 1)[0]
    assert plain_text(qgraph.support(model).to_rich()) in table
    tree = long.split("== annotated module tree (* = captured) ==\n", 1)[1]
    ig = qgraph.instrument(model, values=default_values(block_mixers(model)))
    assert tree.rstrip("\n") == ig.tree()
    assert len(long.splitlines()) > 200  # the long forms are long

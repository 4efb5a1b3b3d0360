"""The ``qgraph`` command line: subcommands, --version, --help, one-line errors, the support table,
the demo's statistics of masked scores (tests/test_demo.py: the demo's screen), image-text checkpoints, and the progress helper."""
from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from qgraph import cli
from qgraph.cli import main
from qgraph.demo import value_statistics, value_table
from qgraph.progress import enabled, progress
from qgraph.testing import tiny_qwen3_5_vl


@pytest.fixture(scope="module", autouse=True)
def _program_disk_cache():
    """Each command loads a fresh model: let the disk cache (in the session's tmp QGRAPH_CACHE) keep
    the tiny model's program, so the module exports it once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QGRAPH_PROGRAM_CACHE", "1")
        yield


def run(capsys, *argv):
    """(exit status, stdout, stderr) of ``qgraph argv`` run in-process."""
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(status, err, *words):
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0] and "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, lines[0])


# -- the parser ------------------------------------------------------------------------------------------------
def test_bare_command_lists_subcommands(capsys):
    status, out, err = run(capsys)
    assert status == 0 and err == ""
    for command in ("demo", "support", "render"):
        assert f"    {command} " in out, command


def test_version(capsys):
    status, out, _ = run(capsys, "--version")
    assert status == 0 and out.strip() == f"qgraph {version('qgraph')}"


ATTENTION = "default: from_pretrained's own, sdpa, the load qgraph.instrument gets in every example"


@pytest.mark.parametrize("command, shown", [
    ("demo", ["--attn-implementation {eager,sdpa}", ATTENTION, "(default: The Eiffel Tower", "--table", "--tree"]),
    ("support", ["--attn-implementation {eager,sdpa}", ATTENTION]),
    ("render", ["--what {block,model,vision_block}", "(default: block)", "--detail {modules,ops}",
                "(default: modules)", ATTENTION]),
    ("serve", ["--attn-implementation {eager,sdpa}", ATTENTION]),
])
def test_help_shows_choices_and_defaults(capsys, command, shown):
    status, out, _ = run(capsys, command, "--help")
    text = " ".join(out.split())  # argparse wraps the help to the terminal
    assert status == 0
    for words in shown:
        assert " ".join(words.split()) in text, words
    assert "(default: None)" not in text


# -- user mistakes: one line on stderr, exit 2 -------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["demo", "--prompt", ""], ["--prompt is empty"]),
    (["demo", "--prompt", "   "], ["--prompt is empty"]),
    (["support", "--model", "/no/such/checkpoint"], ["/no/such/checkpoint", "no such directory"]),
    (["demo", "--attn-implementation", "flash"], ["invalid choice: 'flash'", "eager"]),
    (["render", "--block", "three", "--out", "x.svg"], ["--block", "invalid int value"]),
    (["render", "--block", "3"], ["--out"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'", "support"]),
])
def test_usage_mistakes(capsys, argv, words):
    assert_one_line_error(*run(capsys, *argv)[::2], *words)


def test_model_dir_without_config(capsys, tmp_path):
    status, _, err = run(capsys, "support", "--model", str(tmp_path))
    assert_one_line_error(status, err, "no config.json")


def test_bad_block_number(capsys, tmp_path):
    status, _, err = run(capsys, "render", "--block", "9", "--out", str(tmp_path / "b.dot"))
    assert_one_line_error(status, err, "block 9", "blocks 0 to 3")
    assert not (tmp_path / "b.dot").exists()


def test_vision_block_of_a_text_model(capsys, tmp_path):
    status, _, err = run(capsys, "render", "--what", "vision_block", "--out", str(tmp_path / "v.dot"))
    assert_one_line_error(status, err, "no vision encoder")


def test_unknown_value(capsys):
    status, _, err = run(capsys, "demo", "--values", "layers.0.layer_outptu")
    assert_one_line_error(status, err, "layers.0.layer_outptu", "layers.0.layer_output")


def test_console_script_mistake_has_no_traceback():
    script = shutil.which("qgraph") or str(Path(sys.executable).parent / "qgraph")
    done = subprocess.run([script, "demo", "--model", "/no/such/checkpoint"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"qgraph: error: --model /no/such/checkpoint: no such directory (give a local checkpoint dir, the one "
        f"save_pretrained wrote, or leave --model out for the embedded tiny model)"]


def test_bugs_still_raise(capsys, monkeypatch):
    """Only qgraph's argument checks and named errors become one line: any other error keeps its traceback."""
    def broken(args):
        return [][1]  # an IndexError from a failed operation, not from a `raise` in qgraph

    monkeypatch.setattr(cli, "run_support", broken)
    with pytest.raises(IndexError):
        main(["support"])
    monkeypatch.setattr(cli, "run_support", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["support"])


def test_which_errors_are_the_users():
    from qgraph.compile import compile_options
    with pytest.raises(TypeError) as checked:  # qgraph's own argument check
        compile_options("yes")
    assert cli.is_user_error(checked.value)
    with pytest.raises(TypeError) as inside_torch:
        torch.zeros(2) + "a"
    assert not cli.is_user_error(inside_torch.value)
    with pytest.raises(ValueError) as here:
        raise ValueError("a test's own error")
    assert not cli.is_user_error(here.value)
    assert cli.is_user_error(FileNotFoundError("x"))


# -- support, demo, render ---------------------------------------------------------------------------------------
def test_support_prints_the_value_table(capsys):
    status, out, err = run(capsys, "support")
    assert status == 0 and "Traceback" not in err
    lines = out.splitlines()
    assert "tiny-qwen3_5" in lines[0] and "Qwen3_5ForCausalLM" in lines[0]
    header = next(line for line in lines if line.startswith("value"))
    assert header.split() == ["value", "layout", "shape", "available"]
    gate = next(line for line in lines if line.startswith("layers.{i}.self_attn.attention_gate "))
    assert "[batch seq 4 32]" in gate and "blocks 3; not 0,1,2" in gate
    # the longest name does not push its row's columns out of line with the header
    long = next(line for line in lines if line.startswith("layers.{i}.linear_attn.attention_head_outputs "))
    assert long.index("LinearV [batch seq") == header.index("layout")
    assert "module ports" in lines[-1]


def test_demo_counts_masked_scores(capsys):
    prompt = "The Eiffel Tower"
    status, out, _ = run(capsys, "demo", "--prompt", prompt, "--values", "layers.3.self_attn.attention_scores",
                         "layers.3.self_attn.attention_probabilities", "layers.0.layer_output")
    assert status == 0
    values = out[out.index("\ncaptured for"):]
    assert "inf" not in values.lower() and "nan" not in values.lower()
    header = next(line for line in values.splitlines() if line.startswith("value"))
    assert header.split() == ["value", "shape", "masked", "mean", "std", "max", "|x|"]
    tokens = int(values.split("(")[1].split(" tokens")[0])
    heads = 4  # the tiny model's attention heads
    scores = next(line for line in values.splitlines() if line.startswith("layers.3.self_attn.attention_scores"))
    shape, rest = scores.split("(")[1].split(")")
    assert tuple(int(x) for x in shape.split(",")) == (1, heads, tokens, tokens)
    masked, mean, std, largest = rest.split()
    assert int(masked) == heads * tokens * (tokens - 1) // 2  # causal: every key after the query
    assert abs(float(largest)) < 100 and float(std) > 0
    probabilities = next(line for line in values.splitlines()
                         if line.startswith("layers.3.self_attn.attention_probabilities"))
    masked, mean = probabilities.split()[-4:-2]
    assert masked == "0"  # nothing masked: the masked keys have probability 0
    assert float(mean) == pytest.approx(1 / tokens, abs=5e-5)  # each row of `tokens` entries sums to 1
    # from the logits: next_token_probs not asked for
    next_tokens = values.split("\nnext token: ")[1].splitlines()[0].split(", ")
    assert len(next_tokens) == 5 and 0 < float(next_tokens[0].rsplit(" ", 1)[1]) <= 1


def test_demo_shows_a_plain_value_as_it_is(capsys):
    """``input_size`` (a torch.Size, as ``--values '**'`` captures it) is a row with its value, not a traceback."""
    status, out, err = run(capsys, "demo", "--prompt", "Hi there", "--values", "input_size", "layers.0.layer_output")
    assert status == 0 and "Traceback" not in err
    values = out[out.index("\ncaptured for"):]
    tokens = int(values.split("(")[1].split(" tokens")[0])
    assert tokens == len("Hi there")  # the tiny tokenizer: one token per byte
    row = next(line for line in values.splitlines() if line.startswith("input_size "))
    assert row.split()[1:] == ["value", "(1,", f"{tokens})"]
    stream = next(line for line in values.splitlines() if line.startswith("layers.0.layer_output "))
    assert f"(1, {tokens}, 64)" in stream
    table = value_table({"input_size": torch.Size([2, 7]), "x": torch.ones(2, 3)})
    assert [cell.plain for cell in table.columns[1].cells] == ["value (2, 7)", "(2, 3)"]


def test_hook_post_on_a_moe_checkpoint_is_one_line_with_the_way_out(capsys, sparse_model):
    status, _, err = run(capsys, "demo", "--model", sparse_model("qwen3_5_moe").name_or_path, "--values",
                         "blocks.1.mlp.hook_post")
    assert_one_line_error(status, err, "blocks.1.mlp.hook_post", "do not have", "layers.1.mlp.experts_neurons",
                          "layers.1.mlp.shared_expert.mlp_neurons")


def test_value_statistics_skip_masked_entries():
    low = torch.finfo(torch.float32).min
    x = torch.tensor([1.0, 3.0, -float("inf"), low, float("nan"), -2.0])
    assert value_statistics(x) == ("3", f"{2 / 3:.4f}", f"{torch.tensor([1.0, 3, -2]).std().item():.4f}",
                                       "3.0000")
    assert value_statistics(torch.full((2,), -float("inf"))) == ("2", "-", "-", "-")
    assert value_statistics(torch.tensor([5, 7])) == ("0", "6.0000", f"{math.sqrt(2):.4f}", "7.0000")


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return tiny_qwen3_5_vl(tmp_path_factory.mktemp("cli-vl"))


def test_image_text_checkpoint_loads_the_image_text_model(vl_checkpoint, checkpoint):
    assert type(cli.load_model(vl_checkpoint, "sdpa")).__name__ == "Qwen3_5ForConditionalGeneration"
    assert type(cli.load_model(checkpoint, "eager")).__name__ == "Qwen3_5ForCausalLM"


def test_render_vision_block(capsys, vl_checkpoint, tmp_path):
    out_path = tmp_path / "vision0.dot"
    status, out, err = run(capsys, "render", "--what", "vision_block", "--model", str(vl_checkpoint),
                           "--out", str(out_path))
    assert status == 0, err
    assert out.strip() == f"wrote {out_path}"
    source = out_path.read_text()
    assert "vision.layers.0" in source and "vision encoder block" in source


# -- progress ----------------------------------------------------------------------------------------------------
def test_progress_switch(monkeypatch):
    monkeypatch.setenv("QGRAPH_PROGRESS", "0")
    assert not enabled()
    monkeypatch.setenv("QGRAPH_PROGRESS", "1")
    assert enabled()
    monkeypatch.delenv("QGRAPH_PROGRESS")
    assert not enabled(open(__file__))  # not a terminal


def test_progress_shows_only_slow_steps(capsys, monkeypatch):
    monkeypatch.setenv("QGRAPH_PROGRESS", "1")
    with progress("quick step", delay=5):
        pass
    assert capsys.readouterr().err == ""
    with progress("slow step", delay=0.05):
        time.sleep(0.5)  # the helper thread redraws the timer while the step blocks
    assert "slow step: 00:00" in capsys.readouterr().err
    with progress("looping", total=3, unit="token", delay=0) as bar:
        for _ in range(3):
            time.sleep(0.15)  # tqdm redraws at most every 0.1 s
            bar.update()
    assert "3/3" in capsys.readouterr().err
    monkeypatch.setenv("QGRAPH_PROGRESS", "0")
    with progress("silent", delay=0) as bar:
        bar.update()
        time.sleep(0.3)
    assert capsys.readouterr().err == ""

"""Every code block of README.md and of the docs site's pages (docs/*.md) runs as written, on the tiny
checkpoints (issue 12, part 8; issue 40). A ```text block is shown, not run.

Each ```python block is exec'd unchanged in a namespace of the free names it mentions (``path``,
``model``, ``ids``, ``v``, ``processor``, ...), built from the session's tiny checkpoints, in a tmp
cwd (the diagram block writes files). Where the README states what a block gives, ``CLAIMS`` checks
it afterwards. Each ```bash block's ``qgraph ...`` commands run as a subprocess with
``QGRAPH_CACHE`` in a tmp dir.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import qgraph
from conftest import hf_logits, random_ids

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # the site's hand-written pages (hooks write the rest)


def readme_blocks(text: str) -> list[tuple[str, str, str]]:
    """Every fenced block as (language, section heading, source), in README order."""
    blocks, heading = [], ""
    for match in re.finditer(r"^(#+ [^\n]*)$|^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if match.group(1):
            heading = match.group(1).lstrip("# ").strip()
        else:
            blocks.append((match.group(2), heading, match.group(3)))
    return blocks


def block_id(page: Path, index: int, heading: str, source: str) -> str:
    """The block's page, position, section and first line: a failure names the block."""
    first = source.strip().splitlines()[0].strip()
    where = "" if page == README else f"{page.name}:"
    return f"{where}{index}:{heading}:{first[:60]}"


PAGE_BLOCKS = [(page, i, block) for page in PAGES for i, block in enumerate(readme_blocks(page.read_text()))]
BLOCKS = [block for _, _, block in PAGE_BLOCKS]
PYTHON = [pytest.param(heading, source, id=block_id(page, i, heading, source))
          for page, i, (language, heading, source) in PAGE_BLOCKS if language == "python"]
BASH = [pytest.param(heading, source, id=block_id(page, i, heading, source))
        for page, i, (language, heading, source) in PAGE_BLOCKS if language == "bash"]


def test_the_readme_has_the_blocks_we_run():
    headings = {heading for _, heading, _ in BLOCKS}
    assert {"Reading values", "Editing values", "DeltaNet states", "Images", "Diagrams", "Generation",
            "Capturing a dataset", "Sparse autoencoders", "Mixtures of experts",
            "Saved programs", "Stages", "Activation patching", "Serving a lab"} <= headings
    assert len(PYTHON) >= 8 and len(BASH) >= 2
    assert all(language in ("python", "bash", "text") for language, _, _ in BLOCKS), "a block in an unchecked language"


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """One ``QGRAPH_CACHE`` for this file, with the disk cache of programs on: a block that loads
    the tiny checkpoint afresh, and the command lines, load the program an earlier block exported
    instead of exporting it again (as a user's second process would)."""
    path = tmp_path_factory.mktemp("readme-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QGRAPH_CACHE", str(path))
        patch.setenv("QGRAPH_PROGRAM_CACHE", "1")
        yield path


# -- the free names the blocks use ---------------------------------------------------------------------------
def image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    from qgraph.testing import tiny_qwen3_5_vl
    return str(tiny_qwen3_5_vl(tmp_path_factory.mktemp("readme-vl")))


def text_objects(request) -> dict:
    """Providers of the text blocks' free names (built only when a block mentions the name)."""
    model = lambda: request.getfixturevalue("sdpa_model")  # noqa: E731
    return {
        "qgraph": lambda: qgraph,
        "torch": lambda: torch,
        "path": lambda: str(request.getfixturevalue("checkpoint")),
        "model": model,
        "tokenizer": lambda: request.getfixturevalue("tokenizer"),
        "ids": lambda: random_ids(2, 12, seed=7),
        "t": lambda: 5,
        "v": lambda: torch.randn(model().config.hidden_size, generator=torch.Generator().manual_seed(3)),
        "ig": lambda: qgraph.instrument(model(), values=["layers.0.layer_output"], edits=["layers.0.mlp.mlp_output"]),
        "key": lambda: (request.getfixturevalue("server"), __import__("tests.serving").serving.KEY)[1],
    }


def image_text_objects(request) -> dict:
    """Providers of the image-text block's free names: the tiny image-text checkpoint and two images."""
    from qgraph.testing import load_processor

    def prompt():
        content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what is in these?"}]
        return load_processor(request.getfixturevalue("vl_path")).apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True, enable_thinking=False)

    return {
        "qgraph": lambda: qgraph,
        "torch": lambda: torch,
        "path": lambda: request.getfixturevalue("vl_path"),
        "processor": lambda: load_processor(request.getfixturevalue("vl_path")),
        "prompt": prompt,
        "image_a": lambda: image(64, 64, 0),
        "image_b": lambda: image(40, 100, 1),
    }


def namespace(request, source: str) -> dict:
    """The ready objects for the free names ``source`` mentions (and does not assign itself), nothing more."""
    image_text = "AutoModelForImageTextToText" in source
    providers = image_text_objects(request) if image_text else text_objects(request)
    return {name: make() for name, make in providers.items()
            if re.search(rf"\b{name}\b", source) and not re.search(rf"^{name} *=(?!=)", source, re.M)}


# -- what the README says the blocks give ---------------------------------------------------------------------
def reading_values(ns):
    # "out.logits  # as the model returns them"
    inputs = ns["tokenizer"](["The Eiffel Tower is in", "Hi"], return_tensors="pt", padding=True)
    torch.testing.assert_close(ns["out"].logits, hf_logits(ns["model"], **inputs), rtol=0, atol=1e-5)
    assert ns["out"]["layers.3.layer_output"] is ns["out"].values["layers.3.layer_output"]
    # "attention_scores and attention_probabilities are there under both loads"
    assert ns["model"].config._attn_implementation == "sdpa"
    table = qgraph.support(ns["model"])
    assert table["layers.3.self_attn.attention_scores"].available
    assert table["layers.3.self_attn.attention_probabilities"].available


def main_job(ns):
    # "out.logits: the model's own"; the zeroed last token moves the logits
    model, batch, out = ns["model"], ns["batch"], ns["out"]
    torch.testing.assert_close(out.logits, hf_logits(model, **batch), rtol=0, atol=1e-5)
    assert isinstance(out.plot("layers.0.linear_attn.effective_attention"), qgraph.Figure)
    assert not torch.allclose(ns["ablated"].logits, out.logits)


def getting_started(ns):
    # "the model's own logits"; the zeroed last token moves block 2's output there, and only there
    model, batch, out, ablated = ns["model"], ns["batch"], ns["out"], ns["ablated"]
    torch.testing.assert_close(out.logits, hf_logits(model, **batch), rtol=0, atol=1e-5)
    probs = out["layers.3.self_attn.attention_probabilities"]
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), rtol=0, atol=1e-5)
    moved = (ablated["layers.2.layer_output"] != out["layers.2.layer_output"]).any(-1)
    assert moved[:, -1].all() and not moved[:, :-1].any()


def editing_values(ns):
    # the value at an edit point is captured as edited; a head's zero edit moves what follows
    ig, ids, v = ns["ig"], ns["ids"], ns["v"]
    plain = ig(input_ids=ids)
    torch.testing.assert_close(ns["out"]["layers.2.layer_output"], plain["layers.2.layer_output"] + v, rtol=0, atol=0)
    assert torch.equal(ns["out"]["layers.1.layer_output"], plain["layers.1.layer_output"])
    assert not torch.allclose(ns["out"].logits, plain.logits)


def gradients(ns):
    # "model parameters get .grad, as with the HF model"
    model = ns["model"]
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model(input_ids=ns["ids"]).logits[:, -1].logsumexp(-1).sum().backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(expected) and len(expected) > 40
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def continued_prompt(ns):
    # the DeltaNet blocks give the same values for ids[:, t:] as one run over ids
    whole = ns["ig"](ns["ids"])
    for block in ns["blocks"]:
        for value in ("state_output", "conv_state_output"):
            torch.testing.assert_close(ns["second"][f"{block}.{value}"], whole[f"{block}.{value}"], rtol=0, atol=1e-5)


def states(ns):
    out = ns["ig"](random_ids(1, 6))
    assert out["layers.0.linear_attn.states"].shape[:2] == (1, 6) and out["layers.0.linear_attn.states"].dtype == torch.float32
    assert out["layers.1.linear_attn.state"].shape[1] == 3
    assert out["layers.2.linear_attn.states"].dtype == torch.bfloat16 and out["layers.2.linear_attn.states"].shape[2] == 2


def delta_attention(ns):
    # "rebuilt equals attention_head_outputs to float32 precision"; "Zero at write_values = Zero at betas"
    b, out = ns["b"], ns["out"]
    torch.testing.assert_close(ns["rebuilt"], out[f"{b}.attention_head_outputs"], rtol=1e-5, atol=1e-7)
    by_beta = ns["ig"](ns["ids"], edits={f"{b}.betas": qgraph.Zero(positions=[3], heads=[1])})
    torch.testing.assert_close(ns["zeroed"].logits, by_beta.logits, rtol=0, atol=1e-6)
    assert not torch.allclose(ns["zeroed"].logits, out.logits)


def images(ns):
    # "a list: [heads, patches_j, patches_j] per image"; the logits are the model's
    patterns = ns["out"]["vision.layers.1.self_attn.attention_probabilities"]
    inputs = ns["processor"](text=ns["prompt"], images=[ns["image_a"], ns["image_b"]], return_tensors="pt")
    patches = (inputs["image_grid_thw"].prod(-1)).tolist()
    assert [p.shape[-1] for p in patterns] == patches
    for p in patterns:
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]), rtol=0, atol=1e-5)
    with torch.no_grad():
        expected = ns["model"](**inputs).logits
    torch.testing.assert_close(ns["out"].logits, expected, rtol=0, atol=1e-5)


def videos(ns):
    # "one [heads, h*w, h*w] per image, then per temporal patch"; the logits are the model's
    inputs, out = ns["inputs"], ns["out"]
    patterns = out["vision.layers.1.self_attn.attention_probabilities"]
    image, frames = inputs["image_grid_thw"][0], inputs["video_grid_thw"][0]
    assert [p.shape[-1] for p in patterns] == [int(image.prod())] + [int(frames[1] * frames[2])] * int(frames[0])
    with torch.no_grad():
        expected = ns["model"](**inputs).logits
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-5)


def diagrams(ns):
    for name in ("block3.svg", "block0-ops.png", "model.svg"):
        assert Path(name).stat().st_size > 1000, name
    assert Path("block0-ops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in Path("block3.svg").read_text()


def generation(ns):
    out, enc = ns["out"], ns["enc"]
    prompt = enc["input_ids"].shape[1]
    assert out.sequences.shape[1] > prompt and torch.equal(out.sequences[:, :prompt], enc["input_ids"])
    assert out.steps[0]["layers.3.layer_output"].shape[1] == prompt
    assert out.steps[5]["layers.3.layer_output"].shape[1] == 1


def capturing(ns):
    run, cap, model, tokenizer = ns["run"], ns["cap"], ns["model"], ns["tokenizer"]
    # "which document each token comes from": the texts' tokens, each ended by eos, in order
    stream = [token for text in ns["texts"] for token in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    mask = cap.values("attention_mask").bool()
    assert run.tokens == len(stream) and torch.equal(cap.values("input_ids")[mask], torch.tensor(stream))
    assert cap.values("doc_id")[mask].unique().tolist() == list(range(len(ns["texts"])))
    # row 0's [context, hidden_size]: the instrumented call's value, cast to bfloat16
    ig = qgraph.instrument(model, values=["layers.3.layer_output"], logits=False)
    rows = ig(input_ids=cap.values("input_ids")[:2], attention_mask=cap.values("attention_mask")[:2])
    assert torch.equal(cap[0]["layers.3.layer_output"], rows["layers.3.layer_output"][0].to(torch.bfloat16))


def mixtures_of_experts(ns):
    moe, out, ids = ns["moe"], ns["out"], ns["ids"]
    torch.testing.assert_close(out.logits, hf_logits(moe, ids), rtol=0, atol=1e-5)
    ablated = ns["ablated"]
    # "expert 3's contribution, gone": nothing rerouted, its weight zero, the experts' sum changed where it was routed
    assert torch.equal(ablated["layers.1.mlp.router_indices"], out["layers.1.mlp.router_indices"])
    routed = (out["layers.1.mlp.router_indices"] == 3).any(-1)
    assert routed.any() and (ablated["layers.1.mlp.expert_weights"][..., 3] == 0).all()
    changed = (ablated["layers.1.mlp.experts_output"] != out["layers.1.mlp.experts_output"]).any(-1)
    assert torch.equal(changed, routed)


def saes(ns):
    ig, sae, out, model, ids = ns["ig"], ns["sae"], ns["out"], ns["model"], ns["ids"]
    # "the model's own": the error term is added back
    torch.testing.assert_close(out.logits, hf_logits(model, ids), rtol=0, atol=0)
    x = out["layers.1.sae.error"] + out["layers.1.sae.reconstruction"]
    torch.testing.assert_close(out["layers.1.sae.features"], sae.encode(x), rtol=0, atol=1e-5)
    top = out["layers.1.sae.features"].topk(sae.k, dim=-1)
    assert torch.equal(out["layers.1.sae.indices"], top.indices.int())
    assert torch.equal(ns["activations"], top.values[..., :5]) and torch.equal(ns["features"], top.indices[..., :5])
    assert not torch.allclose(ns["steered"].logits, out.logits)
    # Zero(neurons=[4]) moves the stream by the decoded change (feature 4 is active here)
    assert (out["layers.1.sae.features"][..., 4] > 0).all()
    zeroed = out["layers.1.sae.features"].clone()
    zeroed[..., 4] = 0
    moved = sae.decode(zeroed) - sae.decode(out["layers.1.sae.features"])
    torch.testing.assert_close(ns["ablated"]["layers.1.sae.reconstruction"] - out["layers.1.sae.reconstruction"],
                               moved, rtol=0, atol=1e-5)


def saved_programs(ns):
    ig, out, ids = ns["ig"], ns["out"], ns["ids"]
    # "edits at its saved slots": the instrumented model's edited call, exactly
    expected = ig(ids, edits={"layers.1.layer_output": qgraph.Zero(positions=[-1])})
    assert torch.equal(out.logits, expected.logits) and not torch.equal(out.logits, ig(ids).logits)
    assert all(torch.equal(out[name], expected[name]) for name in expected.values)


def stages_cut(ns):
    # "cut at block boundaries": the unsplit program's values; "exported on meta": the checkpoint's weights
    ids = random_ids(2, 12, seed=7)
    plain, cut = qgraph.instrument(ns["model"], values=["layers.*.layer_output"])(ids), ns["staged"](ids)
    assert torch.equal(plain.logits, cut.logits) and all(torch.equal(plain[n], cut[n]) for n in plain.values)
    assert "model.layers.3.mlp.down_proj.weight" in ns["names"]
    low = ns["low"](ids)
    assert torch.equal(low.logits, plain.logits) and all(p.is_meta for p in ns["big"].parameters())


def patching(ns):
    # patching the last block's output at the last position gives the clean run's metric exactly
    ig, clean, metric = ns["ig"], ns["clean"], ns["metric"]
    last = f"layers.{len(ns['model'].model.layers) - 1}.layer_output"
    assert ns["sweep"][last].shape == (clean.shape[1],)
    torch.testing.assert_close(ns["sweep"][last][-1], metric(ig(clean).logits).detach(), rtol=0, atol=1e-5)
    heads = ns["model"].config.num_attention_heads
    assert ns["heads"]["layers.3.self_attn.attention_head_outputs"].shape == (clean.shape[1], heads)
    assert ns["scores"]["layers.2.layer_output"].shape == ns["sweep"]["layers.2.layer_output"].shape


def stages_with_loss(ns):
    # "forward and backward through the stages: parameters get .grad", and the placed stages give the values
    model, ids = ns["model"], ns["ids"]
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss = ns["fn"](model(input_ids=ids).logits)
    loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(expected) and abs(ns["out"].loss - loss) <= 1e-5
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    plain, placed = qgraph.instrument(model, values=["layers.*.layer_output"])(ids), ns["placed"](ids)
    assert torch.equal(plain.logits, placed.logits) and all(torch.equal(plain[n], placed[n]) for n in plain.values)


def serving(ns):
    # "as a local Output", "per-step values, as local generate", the function edit
    local = qgraph.instrument(ns["model"], values=["layers.*.layer_output"])
    ref = local(ns["ids"], edits={"layers.1.layer_output": qgraph.Zero(positions=[-1])})
    torch.testing.assert_close(ns["out"].logits, ref.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(ns["out"]["layers.3.layer_output"], ref["layers.3.layer_output"], rtol=0, atol=1e-5)
    assert torch.equal(ns["gen"].sequences, local.generate(ns["ids"], max_new_tokens=8).sequences)
    steered = local(ns["ids"], edits={"layers.2.layer_output": lambda x: x + 4.0 * ns["v"]})
    torch.testing.assert_close(ns["steered"].logits, steered.logits, rtol=0, atol=1e-5)
    assert not torch.allclose(ns["steered"].logits, local(ns["ids"]).logits)


CLAIMS = {  # the section and a line of its block -> the check of what the README says it gives
    ("Reading values", "out.logits"): reading_values,
    ("The main job", "effective_attention"): main_job,
    ("Editing values", "Zero(heads=[2])"): editing_values,
    ("The tiny model, its first values and a first edit", "cached_tiny_qwen3_5()"): getting_started,
    ("Gradients", ".backward("): gradients,
    ("DeltaNet states", "states\": {}"): states,
    ("DeltaNet states", "second = ig("): continued_prompt,
    ("The DeltaNet read as attention", "rebuilt = "): delta_attention,
    ("Images", "AutoModelForImageTextToText"): images,
    ("Videos", "video_prompt("): videos,
    ("Diagrams", "qgraph.render("): diagrams,
    ("Generation", "ig.generate("): generation,
    ("Capturing a dataset", "qgraph.capture("): capturing,
    ("Sparse autoencoders", "qgraph.SAE.load("): saes,
    ("Mixtures of experts", "tiny_qwen3_5_moe("): mixtures_of_experts,
    ("Activation patching", "positions=\"each\""): patching,
    ("Saved programs", "ig.save("): saved_programs,
    ("Stages", "stages=2)"): stages_cut,
    ("Gradients through the stages", "loss=fn"): stages_with_loss,
    ("Serving a lab", "qgraph.remote("): serving,
}


def claim_for(heading: str, source: str):
    checks = [check for (section, line), check in CLAIMS.items() if section == heading and line in source]
    return checks[0] if checks else None


@pytest.mark.parametrize("heading, source", PYTHON)
def test_python_block_runs(request, tmp_path, monkeypatch, heading, source):
    monkeypatch.chdir(tmp_path)  # the diagram block writes its files here
    if "qgraph.remote(" in source:  # the serving block calls the session's server (tests/serving.py)
        source = source.replace("http://127.0.0.1:8808", request.getfixturevalue("url"))
    ns = namespace(request, source)
    try:
        exec(compile(source, f"README.md ({heading})", "exec"), ns)  # noqa: S102 - the README's own code, as a user runs it
        check = claim_for(heading, source)
        if check is not None:
            check(ns)
    finally:
        if "model" in ns:  # a block that backpropagates leaves .grad on the session model: drop it
            ns["model"].zero_grad(set_to_none=True)


# -- the command lines ---------------------------------------------------------------------------------------
def qgraph_commands(source: str) -> list[list[str]]:
    """The ``qgraph ...`` commands of a bash block (a line may chain several with ``&&``). The
    ``python -m pip install`` setup and ``python -m pytest`` parts are not run: the package is
    installed already, and the test run is the one running this."""
    commands = []
    for line in source.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words and words[0] == "qgraph":
                commands.append(words)
    return commands


def qgraph_executable() -> str:
    """The ``qgraph`` script installed beside this Python (the console entry point the README runs)."""
    script = Path(sys.executable).parent / "qgraph"
    return str(script) if script.exists() else "qgraph"


PRINTS = {  # a command's first word after qgraph -> what its output must show
    None: ["demo", "render", "support"],  # qgraph alone lists the subcommands
    "--version": ["qgraph 0."],
    "support": ["layers.{i}.layer_output", "layers.{i}.self_attn.attention_scores"],
    "demo": ["checkpoint:", "layers.3.layer_output"],  # a captured value's row
    "render": ["wrote"],
    "serve": ["qgraph serve: listening on http://127.0.0.1:"],
}
RESULTS: dict[tuple, tuple[int, str]] = {}  # a command already run (by an earlier block) -> (exit status, output)


def run_once(words: list[str], cwd: Path) -> tuple[int, str]:
    """Run a command as a new process; a command that an earlier block ran is not run again."""
    if tuple(words) not in RESULTS and words[1:2] == ["serve"]:  # a server: up, ready, then SIGTERM
        RESULTS[tuple(words)] = _serve_once(words, cwd)
    if tuple(words) not in RESULTS:
        result = subprocess.run([qgraph_executable(), *words[1:]], cwd=cwd, capture_output=True, text=True,
                                timeout=300)
        RESULTS[tuple(words)] = (result.returncode, result.stdout + result.stderr)
        for word, after in zip(words, words[1:]):
            if word == "--out" and result.returncode == 0:
                assert (cwd / after).stat().st_size > 1000, f"{shlex.join(words)}: {after} is (nearly) empty"
    return RESULTS[tuple(words)]


def _serve_once(words: list[str], cwd: Path) -> tuple[int, str]:
    """``qgraph serve ...`` on a free port (``--port 0``): its first line once ready, then its end on SIGTERM."""
    import signal
    words = [*words[1:], "--port", "0"]
    process = subprocess.Popen([qgraph_executable(), *words], cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        line = process.stdout.readline()
    finally:
        process.send_signal(signal.SIGTERM)
    rest = process.communicate(timeout=120)[0]
    return (0 if process.returncode in (0, -signal.SIGTERM) else process.returncode), line + rest


@pytest.mark.parametrize("heading, source", BASH)
def test_bash_block_runs(tmp_path, cache_dir, heading, source):
    if "mkdocs build" in source:  # the docs site's build: tests/test_docs.py runs it (and opens the site)
        assert "mkdocs build --strict" in source and '".[docs]"' in source
        return
    commands = qgraph_commands(source)
    assert commands, "a bash block with no qgraph command"
    for words in commands:
        status, output = run_once(words, tmp_path)
        assert status == 0, f"{shlex.join(words)} exited {status}:\n{output[-3000:]}"
        for text in PRINTS.get(words[1] if len(words) > 1 else None, []):
            assert text in output, f"{shlex.join(words)} did not print {text!r}:\n{output[-3000:]}"

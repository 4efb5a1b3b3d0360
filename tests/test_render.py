"""qgraph.render: block and model diagrams drawn from the exported graph, with every value on them."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

import qgraph
from qgraph.families import family_for
from qgraph.render import GraphvizNotFound, NoVisionEncoder, diagram, render
from qgraph.render import dot as dot_module
from qgraph.render.dot import EDIT_FILL, TAP_FILL, VALUE_FILL
from qgraph.render.engine import available

needs_dot = pytest.mark.skipif(available() is None, reason="neither Graphviz's dot nor pygraphviz is installed")


def _standard(model, block: int, mixer: str) -> list[str]:
    """The standard values of one text block: the block's, its mixer's and its MLP's."""
    family = family_for(model)
    return [f"{family.hosts[spec.host].format(i=block)}.{spec.name}"
            for spec in family.values if spec.host in ("layer", "mlp", mixer)]


def _nodes(source: str) -> dict[str, dict[str, str]]:
    """DOT node statements that carry an ``id``: {id: attributes}."""
    found = {}
    for line in source.splitlines():
        match = re.search(r'\bid="([^"]+)"', line)
        if match and "->" not in line:
            found[match.group(1)] = dict(re.findall(r'(\w+)="([^"]*)"', line))
    return found


def _named(source: str) -> list[str]:
    """Every value name the DOT's taps carry (a tap holding two values names both)."""
    return [name for node_id in _nodes(source) for name in node_id.split("+")]


@pytest.mark.parametrize("block, mixer, other", [(3, "self_attn", "linear_attn"), (0, "linear_attn", "self_attn")])
def test_block_names_every_value_of_its_kind_once(sdpa_model, block, mixer, other):
    source = render(sdpa_model, layer=block).source
    named = _named(source)
    for name in _standard(sdpa_model, block, mixer):
        assert named.count(name) == 1, name
        short = name.rsplit(".", 1)[-1]
        assert len(re.findall(rf"<B>{short}</B>", source)) == 1, short
    assert not [n for n in named if f".{other}." in n]
    assert other not in source
    assert not [n for n in named if not n.startswith(f"layers.{block}.")]


def test_block_modules_are_readable_at_a_glance(sdpa_model):
    drawn = diagram(sdpa_model, "block", 3)
    labels = " ".join(box.label for box in drawn.boxes.values())
    for part in ("q_proj", "q_norm", "k_proj", "k_norm", "v_proj", "o_proj", "rotary", "attention", "sigmoid",
                 "split in 2 per head", "query", "gate", "input_layernorm", "post_attention_layernorm",
                 "gate_proj", "up_proj", "act_fn", "down_proj"):
        assert part in labels, part
    assert len(drawn.boxes) < 60  # modules and values, not a soup of aten nodes
    spine = [w for w in drawn.wires if w.kind == "spine"]
    assert len(spine) >= 6  # residual in -> layer_input -> + -> layer_mid -> + -> layer_output -> out

    delta = diagram(sdpa_model, "block", 0)
    labels = " ".join(box.label for box in delta.boxes.values())
    for part in ("in_proj_qkv", "conv1d", "split [32, 32, 64]", "gated delta rule", "in_proj_a", "in_proj_b",
                 "in_proj_z", "softplus", "sigmoid", "RMSNormGated", "out_proj", "initial_state", "beta"):
        assert part in labels, part
    core = next(box for box in delta.boxes.values() if box.kind == "core")
    into_core = {w.attrs.get("headport") for w in delta.wires if w.dst == core.id}
    assert into_core == {f"i{i}:n" for i in range(6)}  # query, key, value, g, beta, initial_state


def test_eager_block_has_its_pattern_as_nodes(eager_model, sdpa_model):
    eager = diagram(eager_model, "block", 3).taps()
    sdpa = diagram(sdpa_model, "block", 3).taps()
    for part in ("attention_scores", "attention_probabilities"):
        assert not eager[f"layers.3.self_attn.{part}"].attrs.get("ghost")
        assert sdpa[f"layers.3.self_attn.{part}"].attrs.get("ghost")  # made on request under sdpa


def test_ops_detail_draws_every_node_of_the_block(sdpa_model):
    from qgraph.kernels.ops import MARK_OP
    ig = qgraph.instrument(sdpa_model)
    drawn = diagram(ig, "block", 0, detail="ops")
    inside = [n for n in ig.exported.graph.nodes if n.target is not MARK_OP and any(
        ig.family.module_name(path) == "layers.0" for path, _ in (n.meta.get("nn_module_stack") or {}).values())]
    ops = [box for box in drawn.boxes.values() if box.kind in ("op", "op_hidden", "core")]
    assert len(ops) == len(inside)
    assert set(_standard(sdpa_model, 0, "linear_attn")) <= set(drawn.taps())


@needs_dot
def test_svg_and_png(sdpa_model, tmp_path):
    svg = render(sdpa_model, layer=3, path=tmp_path / "block3.svg")
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for name in _standard(sdpa_model, 3, "self_attn"):
        assert f'id="{name}"' in text or f"{name}+" in text or f"+{name}" in text, name
        assert f">{name.rsplit('.', 1)[-1]}<" in text
    png = render(sdpa_model, layer=0, path=tmp_path / "block0.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = render(sdpa_model, what="model", path=tmp_path / "model.svg").read_text()
    for part in ("embed_tokens", "layers.0", "layers.3", "gated DeltaNet", "gated attention", "lm_head", "logits"):
        assert part in model, part


def test_instrumented_and_edited_values_have_their_own_colour(sdpa_model):
    captured = ["layers.3.self_attn.attention_gate", "layers.3.layer_mid", "layers.3.mlp.up_proj.output"]
    edited = ["layers.3.mlp.mlp_activation"]
    ig = qgraph.instrument(sdpa_model, values=captured, edits=edited)
    nodes = _nodes(render(ig, layer=3).source)
    fills = {name: attrs.get("fillcolor", "none") for node_id, attrs in nodes.items() for name in node_id.split("+")}
    assert {n for n, f in fills.items() if f == VALUE_FILL} == set(captured)
    assert {n for n, f in fills.items() if f == EDIT_FILL} == set(edited)
    assert {f for n, f in fills.items() if n not in captured + edited} <= {TAP_FILL, "none"}
    model = render(ig, what="model").source
    assert "3 captured" in model and "1 edited" in model


def test_without_dot_pygraphviz_draws_the_same_diagram(sdpa_model, tmp_path, monkeypatch):
    """With no ``dot`` on PATH, pygraphviz's bundled Graphviz draws svg and png: the same nodes, texts
    (HTML labels) and clusters as the system's ``dot`` gives for that DOT."""
    pytest.importorskip("pygraphviz", reason="pygraphviz is not installed on this platform")
    source = render(sdpa_model, layer=3).source
    with_dot = None
    if shutil.which("dot") is not None:
        with_dot = subprocess.run(["dot", "-Tsvg"], input=source.encode(), capture_output=True, check=True).stdout
    monkeypatch.setenv("PATH", str(tmp_path))
    svg = render(sdpa_model, layer=3, path=tmp_path / "block3.svg").read_text()
    png = render(sdpa_model, layer=3, path=tmp_path / "block3.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 'id="layers.3.layer_mid"' in svg
    texts = sorted(re.findall(r"<text[^>]*>(.*?)</text>", svg))
    assert any("Linear" in text for text in texts)  # the HTML labels are drawn
    if with_dot is not None:
        reference = with_dot.decode()
        assert texts == sorted(re.findall(r"<text[^>]*>(.*?)</text>", reference))
        assert set(re.findall(r"<title>(.*?)</title>", svg)) == set(re.findall(r"<title>(.*?)</title>", reference))
        assert svg.count('class="cluster"') == reference.count('class="cluster"')


def test_without_dot_the_source_is_written_and_the_error_says_how_to_install(sdpa_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot on it: graphviz raises ExecutableNotFound
    monkeypatch.setitem(sys.modules, "pygraphviz", None)  # and no pygraphviz: import fails
    with pytest.raises(GraphvizNotFound, match="pip install pygraphviz") as error:
        render(sdpa_model, layer=3, path=tmp_path / "block3.svg")
    written = tmp_path / "block3.dot"
    assert written.exists() and written.read_text().startswith("digraph")
    assert str(written) in str(error.value)
    assert render(sdpa_model, layer=3, path=tmp_path / "plain.dot").read_text().startswith("digraph")


def test_errors_say_what_to_do(sdpa_model, tmp_path):
    with pytest.raises(NoVisionEncoder, match="no vision encoder"):
        render(sdpa_model, what="vision_block")
    with pytest.raises(IndexError, match="blocks 0 to 3"):
        render(sdpa_model, layer=7)
    with pytest.raises(ValueError, match=r"\.svg, \.png"):
        render(sdpa_model, layer=3, path=tmp_path / "block.jpg")
    with pytest.raises(ValueError, match="modules"):
        render(sdpa_model, layer=3, detail="everything")
    assert render(sdpa_model, layer=-1).source == render(sdpa_model, layer=3).source


@needs_dot
def test_cli(sdpa_model, tmp_path, monkeypatch, capsys):
    import transformers

    from qgraph.cli import main
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: sdpa_model)
    out = tmp_path / "block0.svg"
    assert main(["render", "--block", "0", "--out", str(out), "--values", "layers.0.linear_attn.decays"]) == 0
    assert 'id="layers.0.linear_attn.decays"' in out.read_text()
    assert main(["render", "--what", "vision_block", "--out", str(tmp_path / "v.svg")]) == 2
    assert "no vision encoder" in capsys.readouterr().err


def test_a_diagram_shows_itself_in_a_notebook(sdpa_model, tmp_path, monkeypatch):
    import graphviz

    drawn = diagram(sdpa_model, "block", 3)
    if available() is not None:
        svg = drawn._repr_svg_()
        assert "<svg" in svg and 'id="layers.3.layer_mid"' in svg
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "pygraphviz", None)
    assert drawn._repr_svg_() is None  # without any Graphviz the notebook falls back to the repr
    assert issubclass(GraphvizNotFound, graphviz.ExecutableNotFound) and issubclass(GraphvizNotFound, RuntimeError)

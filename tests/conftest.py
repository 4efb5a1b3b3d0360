"""Session fixtures: one tiny checkpoint, its sdpa and eager loads, and one instrumented program each.

Export is the slow part (seconds per model), so every model and every program here is built once
per session. The programs tap every value the catalogue has (``"**"``: standard values and module
ports); tests read what they need from one call.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import re
import resource

import pytest
import torch

import qgraph
from qgraph.testing import tiny_qwen3_5, tiny_qwen4_exp

ALL = ["**"]  # every available value: standard values and module ports

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: a core each, not two threads each on two cores
    torch.set_num_threads(1)


def random_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Byte-token ids (no specials), reproducible."""
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, input_ids, attention_mask=None):
    """The plain Hugging Face forward (not instrumented)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask).logits


def hooked_blocks(model, ids, hooks: dict, grad: bool = False):
    """The HF forward with forward hooks ``{block: function(output) -> output}`` on its decoder blocks
    (an independent reference for edits): ``(logits, {block: its output as the hook returned it})``."""
    seen = {}
    handles = [model.model.layers[i].register_forward_hook(lambda m, a, out, i=i, f=f: seen.setdefault(i, f(out)))
               for i, f in hooks.items()]
    try:
        with torch.set_grad_enabled(grad):
            return model(input_ids=ids).logits, seen
    finally:
        for handle in handles:
            handle.remove()


def graph_structure(program):
    """An exported program's nodes, each as (op, target (a placeholder's name), args and kwargs with nodes
    as their positions, module scopes): two programs with equal structures compute the same."""
    nodes = list(program.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}

    def plain(value):
        if isinstance(value, torch.fx.Node):
            return position[value]
        if isinstance(value, (list, tuple)):
            return type(value)(plain(v) for v in value)
        if isinstance(value, str):  # runtime assertions' messages name a node: drop the name
            return re.sub(r"on node '\w+'", "on node", value)
        return value

    return [(node.op, node.name if node.op == "placeholder" else str(node.target), plain(node.args),
             plain(tuple(sorted(node.kwargs.items()))),
             tuple((key, path) for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items()))
            for node in nodes]


def _described(value):
    """A node's fake value as text: each tensor's sizes and strides (expressions), dtype and requires_grad."""
    if isinstance(value, torch.Tensor):
        return [str(s) for s in value.shape], [str(s) for s in value.stride()], value.dtype, value.requires_grad
    if isinstance(value, (list, tuple)):
        return [_described(item) for item in value]
    return str(value)


def stored_round_trip(program) -> None:
    """``program`` written in the disk cache's format and read back (``qgraph.export.stored``) has the same
    nodes, module scopes, signature, ranges and node values (sizes as expressions)."""
    import json
    from qgraph.export import stored
    data, held = stored.program_data(program)
    back = stored.program_from_data(json.loads(json.dumps(data)), held)
    assert graph_structure(back) == graph_structure(program)
    assert [_described(n.meta.get("val")) for n in back.graph.nodes] == \
        [_described(n.meta.get("val")) for n in program.graph.nodes]
    assert [n.meta.get("nn_module_stack") for n in back.graph.nodes] == \
        [{k: (path, kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}")
          for k, (path, kind) in (n.meta.get("nn_module_stack") or {}).items()} or None
         for n in program.graph.nodes]
    assert back.graph_signature == program.graph_signature
    assert str(back.range_constraints) == str(program.range_constraints)
    assert back.constants.keys() == program.constants.keys()
    assert all(torch.equal(back.constants[k], program.constants[k]) for k in program.constants)


@pytest.fixture(scope="session", autouse=True)
def _program_cache(tmp_path_factory):
    """Keep qgraph's caches out of the home dir, and the disk cache of exported programs off:
    each session exports afresh (tests/test_cache.py turns the disk cache on where it tests it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QGRAPH_CACHE", str(tmp_path_factory.mktemp("qgraph-cache")))
        patch.setenv("QGRAPH_PROGRAM_CACHE", "0")
        yield


@contextlib.contextmanager
def program_cache_on(tmp_path_factory, name: str):
    """qgraph's disk cache of exported programs on, in a dir of its own: child processes (torchrun
    ranks, a killed capture) load the program this process exported."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QGRAPH_CACHE", str(tmp_path_factory.mktemp(name)))
        patch.setenv("QGRAPH_PROGRAM_CACHE", "1")
        yield


def _kernel_module_functions():
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    return module, {name: value for name, value in vars(module).items() if callable(value)}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return tiny_qwen3_5(tmp_path_factory.mktemp("tiny-qwen3_5"))


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="session")
def _sdpa_load(checkpoint):
    """The sdpa load, and what it looks like before anything instruments it (see before_instrument)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    assert model.config._attn_implementation == "sdpa"
    return model, _snapshot(model)


@pytest.fixture(scope="session")
def sdpa_model(_sdpa_load):
    return _sdpa_load[0]


@pytest.fixture(scope="session")
def hooks_model(checkpoint):
    """A load of the tiny checkpoint that is never instrumented: the reference that forward hooks go on."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="session")
def eager_model(checkpoint):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    assert model.config._attn_implementation == "eager"
    return model


@pytest.fixture(scope="session")
def qwen4_checkpoint(tmp_path_factory):
    """The tiny ``qwen4_exp`` text checkpoint (``qgraph.testing.tiny_qwen4_exp``), built once per worker; skipped
    under a transformers without the model or whose indexer qgraph refuses (before 5.25: the compat venvs')."""
    import transformers

    from qgraph.families.qwen4_exp import QWEN4_EXP
    if not hasattr(transformers, "Qwen4ExpConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no qwen4_exp (5.23 and later have)")
    path = tiny_qwen4_exp(tmp_path_factory.mktemp("tiny-qwen4_exp"))
    problem = QWEN4_EXP.check(transformers.AutoConfig.from_pretrained(path))
    if problem:
        pytest.skip(problem)
    return path


@pytest.fixture(scope="session")
def qwen4_models(qwen4_checkpoint):
    """``models(implementation)``: the tiny qwen4_exp model under ``"eager"`` or ``"sdpa"``, each loaded once per
    worker and shared by the qwen4 test files: the instruments of one model object share its export (a fresh
    export of this model is most of each file's time). Nothing changes these models (qgraph never does); a test
    that hooks one removes its hooks."""
    from transformers import AutoModelForCausalLM
    made: dict = {}

    def models(implementation: str = "sdpa"):
        if implementation not in made:
            made[implementation] = AutoModelForCausalLM.from_pretrained(
                qwen4_checkpoint, attn_implementation=implementation).eval()
        return made[implementation]
    return models


def _snapshot(model):
    module, functions = _kernel_module_functions()
    ids = random_ids(2, 11, seed=123)
    return {
        "state_dict": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
        "data_ptrs": {name: tensor.data_ptr() for name, tensor in model.state_dict().items()},
        "hooks": {path: (len(m._forward_hooks), len(m._forward_pre_hooks)) for path, m in model.named_modules()},
        "forwards": {path: m.forward for path, m in model.named_modules()},
        "kernel_module": module,
        "functions": functions,
        "probe_ids": ids,
        "logits": hf_logits(model, ids),
    }


@pytest.fixture(scope="session")
def before_instrument(_sdpa_load):
    """The sdpa model before anything instrumented it: a state_dict copy (and the tensors'
    addresses), its hooks and forwards, the kernel module's functions and a plain forward's logits."""
    return _sdpa_load[1]


@pytest.fixture(scope="session")
def ig(sdpa_model):
    """The sdpa load instrumented once for every value it has."""
    return qgraph.instrument(sdpa_model, values=ALL)


@pytest.fixture(scope="session")
def ig_eager(eager_model):
    """The eager load instrumented once for every value it has."""
    return qgraph.instrument(eager_model, values=ALL)


@pytest.fixture(scope="session")
def ids():
    """The standard prompt batch: 2 prompts of 70 tokens (past the delta rule's 64-token chunk)."""
    return random_ids(2, 70, seed=1)


@pytest.fixture(scope="session")
def out(ig, ids):
    return ig(input_ids=ids, attention_mask=torch.ones_like(ids))


@pytest.fixture(scope="session")
def out_eager(ig_eager, ids):
    return ig_eager(input_ids=ids, attention_mask=torch.ones_like(ids))


@pytest.fixture(scope="session")
def ig_fused(sdpa_model, ig):
    """The sdpa load with every value but the attention pattern, so its attention stays one fused
    sdpa node (asking for the pattern makes qgraph decompose it)."""
    pattern = {"layers.3.self_attn.attention_scores", "layers.3.self_attn.attention_probabilities"}
    return qgraph.instrument(sdpa_model, values=[name for name in ig.values if name not in pattern])


@pytest.fixture(scope="session")
def out_fused(ig_fused, ids):
    return ig_fused(input_ids=ids, attention_mask=torch.ones_like(ids))


@pytest.fixture(scope="session")
def sparse_model(tmp_path_factory):
    """``sparse_model(name)``: the tiny mixture-of-experts model of a family ("qwen3_5_moe",
    "qwen3_next"), built and loaded once for the session (the MoE, transcoder and circuit tests share it)."""
    from transformers import AutoModelForCausalLM

    from qgraph.testing import tiny_qwen3_5_moe, tiny_qwen3_next
    built = {}

    def get(name: str):
        if name not in built:
            build = {"qwen3_5_moe": tiny_qwen3_5_moe, "qwen3_next": tiny_qwen3_next}[name]
            built[name] = AutoModelForCausalLM.from_pretrained(build(tmp_path_factory.mktemp(name))).eval()
        return built[name]
    return get


# -- qgraph serve: one server for the session's serving tests (tests/serving.py) ------------------------------
@pytest.fixture(scope="session")
def server(checkpoint, tmp_path_factory):
    from tests.serving import start_server
    process, url = start_server(checkpoint, tmp_path_factory.mktemp("serve"))
    yield process, url
    if process.poll() is None:
        process.kill()
    process.wait(30)


@pytest.fixture(scope="session")
def url(server):
    return server[1]


@pytest.fixture(scope="session")
def remote(url):
    import qgraph
    from tests.serving import KEY
    return qgraph.remote(url, api_key=KEY)


@pytest.fixture
def canary(tmp_path):
    """A file an attacker would read or write, and a snapshot of what must not change."""
    (tmp_path / "canary").mkdir()
    secret = tmp_path / "canary" / "secret.bin"
    secret.write_bytes(b"the canary's bytes: nothing reads or writes me")
    before = {name: value for name, value in vars(torch.nn.Module).items()}, dict(vars(torch.fx.GraphModule))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield secret
    assert secret.read_bytes() == b"the canary's bytes: nothing reads or writes me"
    assert [p.name for p in secret.parent.iterdir()] == ["secret.bin"]
    assert dict(vars(torch.nn.Module)) == before[0] and dict(vars(torch.fx.GraphModule)) == before[1]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 * 1024  # KiB: no large allocation


@pytest.fixture(scope="session")
def saved_probe(sdpa_model, tmp_path_factory):
    """A small saved program of the tiny model (one value, one edit slot), its weights beside it: what the
    hostile-file tests rewrite."""
    folder = tmp_path_factory.mktemp("probe")
    return qgraph.instrument(sdpa_model, values=["layers.1.layer_output"],
                             edits={"layers.2.layer_output": None}).save(folder / "probe.qgraph", weights=True)

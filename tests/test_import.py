"""Import in a blink (issue 25): ``import qgraph`` and the ``qgraph`` command's fast paths (--version,
--help, a mistake on the command line) import nothing heavy; each public name loads its module at
first use, and the custom ops register with ``qgraph.kernels``. Each check runs in a fresh process
and asserts which modules were imported (timings vary with the machine; the issue's report has them)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "transformers", "datasets", "rich", "graphviz", "networkx", "safetensors", "numpy")


def fresh(script: str) -> dict:
    """Run ``script`` in a new interpreter; it prints one JSON line last, returned here."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


LOADED = f"sorted(m for m in {HEAVY!r} if m in sys.modules)"


def test_import_qgraph_imports_nothing_heavy():
    result = fresh(f"""
        import json, sys
        import qgraph
        before = {LOADED}
        qgraph.__version__, dir(qgraph), qgraph.__all__
        print(json.dumps({{"import": before, "version": qgraph.__version__, "after_dir": {LOADED}}}))
    """)
    assert result["import"] == [] and result["after_dir"] == []
    assert result["version"].count(".") >= 1


@pytest.mark.slow  # fresh Python processes of its own: the slow tier
def test_every_public_name_resolves():
    result = fresh("""
        import json, sys, types
        import qgraph
        listed = set(dir(qgraph))
        kinds = {name: type(getattr(qgraph, name)).__name__ for name in qgraph.__all__}
        modeling = [name for name in sys.modules if ".modeling_" in name]
        print(json.dumps({"missing": sorted(set(qgraph.__all__) - listed), "kinds": kinds, "modeling": modeling}))
    """)
    assert result["missing"] == []
    assert "module" not in result["kinds"].values(), result["kinds"]
    assert result["kinds"]["instrument"] == "function" and result["kinds"]["SAE"] == "type"
    assert result["modeling"] == []  # qgraph's own modules never import transformers' modeling code


@pytest.mark.slow  # fresh Python processes of its own: the slow tier
def test_submodules_do_not_shadow_the_functions_of_their_name():
    """``qgraph.instrument``, ``qgraph.capture`` and ``qgraph.render`` are the functions, whichever of
    their modules was imported first (importing a submodule binds it on its package)."""
    result = fresh("""
        import json
        import qgraph.capture.cli, qgraph.render.block, qgraph.instrument
        import qgraph
        from qgraph.capture import run
        from qgraph.instrument import instrument
        from qgraph.render import render
        print(json.dumps([qgraph.capture is run.capture, qgraph.instrument is instrument, qgraph.render is render,
                          qgraph.edits.Zero is qgraph.Zero, hasattr(qgraph, "no_such_name")]))
    """)
    assert result == [True, True, True, True, False]


@pytest.mark.slow  # fresh Python processes of its own: the slow tier
def test_first_use_checks_the_versions_once():
    result = fresh("""
        import json
        import qgraph
        import qgraph.compat
        calls = []
        qgraph.compat.check_versions = lambda: calls.append(1)
        qgraph.Zero, qgraph.instrument, qgraph.load
        print(json.dumps(calls))
    """)
    assert result == [1]


@pytest.mark.slow  # fresh Python processes of its own: the slow tier
@pytest.mark.parametrize("module", ["qgraph.kernels.ops", "qgraph.kernels.buffers", "qgraph.program", "qgraph.saved"])
def test_the_custom_ops_register_with_the_kernels(module):
    result = fresh(f"""
        import importlib, json
        import torch
        importlib.import_module({module!r})
        print(json.dumps([hasattr(torch.ops.qgraph, op) for op in
                          ("chunk_gated_delta_rule", "delta_rule_backward", "moe_experts", "edit_slot", "mark")]))
    """)
    assert result == [True] * 5


@pytest.mark.parametrize("argv", [
    ["--version"], ["--help"], [], ["demo", "--help"], ["render", "--help"], ["capture", "--help"],
    ["frobnicate"], ["demo", "--no-such-option"], ["render", "--block", "three", "--out", "x.svg"],
    ["support", "--model", "/no/such/checkpoint"], ["demo", "--prompt", " "],
    ["capture", "--model", "/no/such/checkpoint", "--data", "x.jsonl", "--out", "acts"],
])
def test_command_line_fast_paths_import_no_torch(argv):
    result = fresh(f"""
        import contextlib, io, json, sys
        from qgraph.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
            status = main({argv!r})
        print(json.dumps({{"status": status, "loaded": {LOADED}, "out": out.getvalue(), "err": err.getvalue()}}))
    """)
    assert result["loaded"] == [], result
    assert result["status"] == (0 if argv in (["--version"], ["--help"], []) or "--help" in argv else 2), result
    assert (result["out"] if result["status"] == 0 else result["err"]).strip()


def test_python_m_qgraph_version_imports_no_torch():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "qgraph", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("qgraph ")
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "qgraph.cli" in imported
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))

"""One error family: every error qgraph raises on purpose is a ``qgraph.QgraphError`` (qgraph/errors.py),
each keeping its builtin parent (``except ValueError`` still catches an ``EditError``), every one
exported from ``qgraph``, and ``InternalError`` (a broken invariant of qgraph's own) kept apart from
the caller's mistakes. Checked on the classes, on the source (no bare builtin ``raise`` left outside an
allow-list with its reasons) and on real mistakes."""
from __future__ import annotations

import ast
import builtins
import json
import pickle
import subprocess
import sys
import textwrap
from importlib import import_module
from pathlib import Path

import pytest
import torch

import qgraph
import qgraph.cli
import qgraph.errors
from qgraph.edits import Target, apply_edit
from qgraph.output import Output
from qgraph.weights import check_fit

PACKAGE = Path(qgraph.__file__).resolve().parent

# bare builtin raises kept on purpose: (file, enclosing function, builtin) -> why
_ON_PURPOSE = {
    ("qgraph/edits.py", "Region.change", "NotImplementedError"):
        "the abstract method of Region, which each tensor edit overrides (Python's own idiom)",
    ("qgraph/rewrites/on_request.py", "Rewrite.apply", "NotImplementedError"):
        "the abstract method of Rewrite, which each typed rewrite overrides (Python's own idiom)",
    ("qgraph/capture/read.py", "Capture.find", "KeyError"):
        "a lookup by key (a global row id; a capture's rows may have gaps), as dict's own: a KeyError",
    ("qgraph/capture/writer.py", "ShardWriter._raise", "RuntimeError"):
        "hands on the writer thread's own failure (its __cause__, an OSError or a bug alike): no judgment of "
        "qgraph's to classify",
}

# the builtins a qgraph raise must not be bare (AssertionError and Exception too: use InternalError)
_BUILTINS = {"ValueError", "TypeError", "IndexError", "NotImplementedError", "FileNotFoundError", "RuntimeError",
             "KeyError", "AssertionError", "Exception"}

# each error's builtin parent, kept from before the family
PARENTS = {
    "InternalError": RuntimeError, "InvalidArgument": ValueError, "InvalidType": TypeError,
    "OutOfRange": IndexError, "NotSupported": NotImplementedError, "MissingFile": FileNotFoundError,
    "InvalidState": RuntimeError, "EditError": ValueError, "NotCaptured": KeyError, "UnknownValue": KeyError,
    "UnavailableValue": ValueError, "NoVisionEncoder": NotImplementedError, "CaptureCorrupt": ValueError,
    "CaptureMismatch": ValueError, "WeightsMismatch": ValueError, "SavedProgramError": ValueError,
    "UnsupportedModel": TypeError, "UsageError": Exception,
}


def error_classes() -> dict[str, type]:
    return {name: value for name, value in vars(qgraph.errors).items()
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == "qgraph.errors"}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = f"qgraph/{path.relative_to(PACKAGE).as_posix()}"
        yield relative, ast.parse(path.read_text(), filename=str(path))


def _bare_raises(tree: ast.Module):
    """(enclosing function as Class.method, builtin name, line) for each ``raise Builtin(...)`` or
    ``raise Builtin``."""
    def walk(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from walk(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                called = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(called, ast.Name) and called.id in _BUILTINS:
                    yield ".".join(scope), called.id, child.lineno
            yield from walk(child, scope)
    yield from walk(tree, [])


# -- the classes ------------------------------------------------------------------------------------------------
def test_the_family_has_every_kind():
    assert set(error_classes()) == set(PARENTS) | {"QgraphError"}


@pytest.mark.parametrize("name", sorted(PARENTS))
def test_each_error_is_a_qgraph_error_and_keeps_its_builtin_parent(name):
    cls = getattr(qgraph.errors, name)
    assert issubclass(cls, qgraph.errors.QgraphError) and issubclass(cls, PARENTS[name])
    assert cls.__doc__ and cls.__doc__.strip()


def test_every_error_is_exported_from_qgraph():
    for name, cls in error_classes().items():
        assert name in qgraph.__all__, name
        assert name in dir(qgraph), name
        assert getattr(qgraph, name) is cls, name
    assert qgraph.EditError is qgraph.edits.EditError and issubclass(qgraph.EditError, qgraph.InvalidArgument)
    assert qgraph.NotCaptured is qgraph.output.NotCaptured and issubclass(qgraph.NotCaptured, KeyError)
    assert qgraph.UnknownValue is qgraph.values.names.UnknownValue
    assert qgraph.WeightsMismatch is qgraph.weights.WeightsMismatch
    # qgraph.capture and qgraph.render are the functions: their modules by name
    assert qgraph.CaptureCorrupt is import_module("qgraph.capture.integrity").CaptureCorrupt
    assert qgraph.CaptureMismatch is import_module("qgraph.capture.manifest").CaptureMismatch
    assert qgraph.NoVisionEncoder is import_module("qgraph.render").NoVisionEncoder
    assert qgraph.cli.UsageError is qgraph.UsageError
    assert qgraph.UnsupportedModel is qgraph.families.UnsupportedModel
    assert qgraph.SavedProgramError is qgraph.saved.SavedProgramError


def test_graphviz_not_found_is_a_qgraph_error_and_graphviz_s():
    import graphviz
    from qgraph.render import GraphvizNotFound
    assert qgraph.GraphvizNotFound is GraphvizNotFound and "GraphvizNotFound" in qgraph.__all__
    assert issubclass(GraphvizNotFound, qgraph.QgraphError) and issubclass(GraphvizNotFound, graphviz.ExecutableNotFound)
    assert str(GraphvizNotFound("install graphviz")) == "install graphviz"


def test_no_exception_class_outside_the_family():
    """An exception class defined anywhere in qgraph is one of qgraph.errors', or names QgraphError
    among its bases (GraphvizNotFound), or is private and caught inside qgraph (export/repeat.py's
    _Unrepeatable)."""
    builtin_errors = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}
    outside = []
    for relative, tree in _sources():
        if relative == "qgraph/errors.py":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in node.bases}
            if bases & builtin_errors or any(base.endswith(("Error", "NotFound")) for base in bases):
                if "QgraphError" not in bases and not node.name.startswith("_"):
                    outside.append(f"{relative}: class {node.name}")
    assert outside == []


def test_internal_error_says_it_is_a_bug_to_report():
    error = qgraph.InternalError("the tap of layers.3.layer_output has no node")
    message = str(error)
    assert message.startswith("the tap of layers.3.layer_output has no node. ")
    assert "bug in qgraph" in message and "report it" in message and "config" in message
    assert error.args == ("the tap of layers.3.layer_output has no node",)
    assert str(pickle.loads(pickle.dumps(error))) == message  # the suffix is added once
    assert "bug in qgraph" in str(qgraph.InternalError())
    assert isinstance(error, RuntimeError) and not isinstance(error, (ValueError, TypeError))


def test_key_errors_show_their_message_as_written():
    assert str(qgraph.NotCaptured("'x' was not captured")) == "'x' was not captured"
    assert str(qgraph.UnknownValue("'x' is not a value")) == "'x' is not a value"


# -- the source ------------------------------------------------------------------------------------------------
def test_no_bare_builtin_raise_left():
    """``raise ValueError(...)`` and its kin are qgraph's classes now (InvalidArgument, ...), but in
    the raises kept on purpose (``_ON_PURPOSE``, each with its reason)."""
    bare, seen = [], set()
    for relative, tree in _sources():
        for scope, name, line in _bare_raises(tree):
            if (relative, scope, name) in _ON_PURPOSE:
                seen.add((relative, scope, name))
            else:
                bare.append(f"{relative}:{line} in {scope or 'the module'}: raise {name}")
    assert bare == []
    assert seen == set(_ON_PURPOSE), f"stale allow-list entries: {set(_ON_PURPOSE) - seen}"


def test_the_scan_finds_a_bare_raise():
    tree = ast.parse(textwrap.dedent("""
        class A:
            def f(self):
                raise ValueError("x")
        def g():
            raise NotImplementedError
        def h():
            raise qgraph.InvalidArgument("x")
    """))
    assert [(scope, name) for scope, name, _ in _bare_raises(tree)] == [("A.f", "ValueError"),
                                                                        ("g", "NotImplementedError")]


# -- real mistakes ----------------------------------------------------------------------------------------------
def _sparsify_transcoder(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"transcode": True}))
    (tmp_path / "sae.safetensors").write_bytes(b"")
    return qgraph.SAE.load(tmp_path)


def _corrupt_capture(tmp_path):
    (tmp_path / "manifest.json").write_text("{")
    return qgraph.load_capture(tmp_path)


def _tiny_sae():
    d_in, d_sae = 3, 4
    return qgraph.SAE(torch.zeros(d_in, d_sae), torch.zeros(d_sae), torch.zeros(d_sae, d_in), torch.zeros(d_in),
                      activation="relu")


MISTAKES = {
    "InvalidType": lambda tmp_path: qgraph.Zero(positions="x"),
    "InvalidArgument": lambda tmp_path: qgraph.Zero(positions=[]),
    "OutOfRange": lambda tmp_path: _tiny_sae().direction(4),
    "NotSupported": _sparsify_transcoder,
    "MissingFile": lambda tmp_path: qgraph.load_capture(tmp_path / "no-such-capture"),
    "InvalidState": lambda tmp_path: Output(logits=None, watched={"x": (torch.zeros(1), ())}).grad("x"),
    "EditError": lambda tmp_path: apply_edit(42, torch.zeros(2), Target("x", "", ())),
    "NotCaptured": lambda tmp_path: Output(logits=None)["layers.0.layer_output"],
    "CaptureCorrupt": _corrupt_capture,
    "WeightsMismatch": lambda tmp_path: check_fit("probe.pt2", {"w": ((2,), torch.float32)}, {}, "w.safetensors"),
    "UsageError": lambda tmp_path: qgraph.cli.checkpoint_path(str(tmp_path / "no-such-checkpoint")),
}


@pytest.mark.parametrize("kind", sorted(MISTAKES))
def test_a_mistake_of_each_kind_is_a_qgraph_error(kind, tmp_path):
    with pytest.raises(qgraph.QgraphError) as caught:
        MISTAKES[kind](tmp_path)
    assert type(caught.value) is getattr(qgraph, kind), caught.value
    assert isinstance(caught.value, PARENTS[kind])  # `except <its builtin>` still catches it
    assert qgraph.cli.is_user_error(caught.value)  # the qgraph command prints it as one line


def test_the_command_prints_qgraph_errors_as_one_line_but_internal_errors_with_their_traceback():
    assert qgraph.cli.is_user_error(qgraph.InvalidState("weights on meta"))
    assert qgraph.cli.is_user_error(qgraph.UsageError("--model x: no such directory"))
    assert not qgraph.cli.is_user_error(qgraph.InternalError("a pass found no node"))
    assert not qgraph.cli.is_user_error(RuntimeError("a bug"))


def test_the_errors_import_nothing_heavy():
    """``except qgraph.QgraphError`` (any error's first use) imports no torch and checks no versions."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json, sys
        import qgraph
        classes = [qgraph.QgraphError, qgraph.InternalError, qgraph.EditError, qgraph.NotCaptured]
        print(json.dumps(sorted(m for m in ("torch", "transformers", "graphviz") if m in sys.modules)))
    """)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []

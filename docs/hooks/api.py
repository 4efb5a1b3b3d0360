"""The API reference (api/*.md), generated from qgraph's public names, and the check that each has a docstring.

One page per group below, one mkdocstrings entry (``::: <the module defining it>.<name>``, its own anchor) per
public name of ``qgraph.__all__``; the command line's page is ``qgraph <command> --help`` for every
command, from the parser itself. The build fails (a ``PluginError``) when a public name, or a public
method of a public class, has no docstring, or when a public name is in no group.
"""
from __future__ import annotations

import inspect

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

GROUPS = {  # page -> (title, what it covers, public names)
    "instrument": ("Instrumenting a model", "Exporting a model once and reading its values.",
                   ["instrument", "Instrument", "InstrumentedModel", "Output", "support", "SupportTable", "register_family"]),
    "edits": ("Edits", "What an edit does at a value, and the recipes built on edits.",
              ["Edit", "Read", "Add", "Replace", "Scale", "Zero", "steer", "skip_layers", "expert_neurons"]),
    "generation": ("Generation", "Generating with values and edits at every step.", ["GenerateOutput", "chat_prompt"]),
    "capture": ("Capture", "Writing a dataset's values to disk and reading them back.", ["capture", "load_capture"]),
    "saes": ("SAEs and transcoders", "Dictionaries spliced into the program.", ["SAE", "Transcoder", "CrossLayerTranscoder"]),
    "circuits": ("Circuits and patching", "Attribution graphs, patching sweeps and attribution patching.",
                 ["attribution_graph", "AttributionGraph", "patch", "attribution_patch"]),
    "pictures": ("Pictures", "Diagrams of the graph, plots of values, the explorer.", ["render", "Figure", "explore"]),
    "saved": ("Saved programs and stages", "Programs saved as data, and stages across processes.",
              ["load", "LoadedProgram", "Stages"]),
    "serving": ("Serving", "The client of `qgraph serve`.", ["remote", "RemoteError"]),
    "errors": ("Errors", "Every error qgraph raises is a `QgraphError`; each names the problem and the way out.",
               ["QgraphError", "InvalidArgument", "InvalidType", "OutOfRange", "NotSupported", "MissingFile",
                "InvalidState", "UsageError", "UnknownValue", "UnavailableValue", "UnsupportedModel", "EditError",
                "NotCaptured", "NoVisionEncoder", "WeightsMismatch", "CaptureCorrupt", "CaptureMismatch",
                "SavedProgramError", "GraphvizNotFound", "InternalError"]),
}


def undocumented() -> list[str]:
    """Public names, and public methods of public classes, whose docstring is missing."""
    import qgraph
    missing = []
    for name in qgraph.__all__:
        value = getattr(qgraph, name)
        if not (inspect.getdoc(value) or "").strip():
            missing.append(name)
        if inspect.isclass(value):
            for attr, member in vars(value).items():
                function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if not attr.startswith("_") and callable(function) and not (function.__doc__ or "").strip():
                    missing.append(f"{name}.{attr}")
    return missing


def _pages() -> dict[str, str]:
    import qgraph
    grouped = [name for _, _, names in GROUPS.values() for name in names]
    stray = sorted(set(qgraph.__all__) - set(grouped))
    if stray or set(grouped) - set(qgraph.__all__):
        raise PluginError(f"docs/hooks/api.py: public names in no API page: {stray}; "
                          f"names in GROUPS that are not public: {sorted(set(grouped) - set(qgraph.__all__))}")
    missing = undocumented()
    if missing:
        raise PluginError(f"public names without a docstring: {', '.join(missing)}; write one (the API reference is built from them)")
    pages, index = {}, ["# API reference", "", "Generated from the docstrings of every public name of `qgraph`.", ""]
    for page, (title, about, names) in GROUPS.items():
        entries = [f"::: {_defined_at(getattr(qgraph, name))}" for name in names]
        pages[f"api/{page}.md"] = f"# {title}\n\n{about}\n\n" + "\n\n".join(entries) + "\n"
        index.append(f"- [{title}]({page}.md): " + ", ".join(f"`{name}`" for name in names))
    pages["api/cli.md"] = _cli()
    index.append("- [Command line](cli.md): `qgraph` and its commands")
    pages["api/index.md"] = "\n".join(index) + "\n"
    return pages


def _defined_at(value) -> str:
    """Where a public name is defined (``qgraph.capture.run.capture``), which mkdocstrings reads statically."""
    return f"{value.__module__}.{value.__qualname__}"


def _cli() -> str:
    from qgraph.cli import build_parser
    parser = build_parser()
    lines = ["# Command line", "", "Every `qgraph` command's `--help`, from the parser itself.", "",
             "## qgraph", "", "```text", parser.format_help().rstrip(), "```", ""]
    commands = next(action for action in parser._actions if action.__class__.__name__ == "_SubParsersAction")
    for name, command in commands.choices.items():
        lines += [f"## qgraph {name}", "", "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def on_files(files, config):
    for src, content in _pages().items():
        files.append(File.generated(config, src, content=content))
    return files

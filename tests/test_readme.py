"""Every page runs as written: README.md and each docs/*.md page (issue 12, part 8; issues 40 and 55).

The rule a page follows: its first ```python block is a visible setup (the imports, the tiny random
checkpoint from ``qgraph.testing`` with a comment that a real checkpoint's folder works the same, the
model, tokenizer, ids and any vector its examples use), and every block uses only names that it or an
earlier block of the same page defines, so the page copied into a notebook runs top to bottom. A page
that starts a server (``qgraph serve`` as a subprocess) stops it in its last block. ```text is shown,
not run.

Each page's ```python blocks run here in page order, in one fresh namespace per page with nothing
put in it, in a tmp cwd (blocks write files) with ``QGRAPH_CACHE`` in a tmp dir and the disk cache
of exported programs on (one export per kind of model for the whole file). Where a page states what
a block gives, ``CLAIMS`` (tests/readme_claims.py) checks it on the page's namespace right after that
block. Each ```bash block's ``qgraph ...`` commands run as subprocesses.
"""
from __future__ import annotations

import builtins
import re
import shlex
import signal
import subprocess
import symtable
import sys
from pathlib import Path

import pytest

from tests.readme_claims import CLAIMS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # the site's hand-written pages (hooks write the rest)


def readme_blocks(text: str) -> list[tuple[str, str, str]]:
    """Every fenced block as (language, section heading, source), in page order."""
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
    return f"{page.name}:{index}:{heading}:{first[:60]}"


PAGE_BLOCKS = {page: readme_blocks(page.read_text()) for page in PAGES}
BLOCKS = [block for blocks in PAGE_BLOCKS.values() for block in blocks]
PYTHON_PAGES = [pytest.param(page, id=page.name) for page, blocks in PAGE_BLOCKS.items()
                if any(language == "python" for language, _, _ in blocks)]
BASH = [pytest.param(heading, source, id=block_id(page, i, heading, source))
        for page, blocks in PAGE_BLOCKS.items() for i, (language, heading, source) in enumerate(blocks)
        if language == "bash"]


def test_the_pages_have_the_blocks_we_run():
    headings = {heading for _, heading, _ in BLOCKS}
    assert {"Reading values", "Editing values", "DeltaNet states", "Images", "Diagrams", "Generation",
            "Capturing a dataset", "Sparse autoencoders", "Mixtures of experts",
            "Saved programs", "Stages", "Activation patching", "Serving a lab"} <= headings
    assert len(PYTHON_PAGES) >= 15 and len(BASH) >= 2
    assert all(language in ("python", "bash", "text") for language, _, _ in BLOCKS), "a block in an unchecked language"


def test_every_claim_checks_one_block():
    """A claim whose block was renamed or rewritten would check nothing: each matches exactly one block."""
    for (section, line), check in CLAIMS.items():
        matches = [source for language, heading, source in BLOCKS
                   if language == "python" and heading == section and line in source]
        assert len(matches) == 1, f"{check.__name__}: {len(matches)} python blocks under {section!r} hold {line!r}"


# -- the pages' python blocks, in page order, one namespace a page -------------------------------------------
class PageError(AssertionError):
    """A block of a page failed, or its claim did not hold: the message names the block."""


def fresh_namespace() -> dict:
    """A page's namespace before its first block: empty (``exec`` adds ``__builtins__``, as Python does)."""
    return {}


def run_blocks(page: Path, blocks: list[tuple[str, str, str]], ns: dict) -> None:
    """Exec each python block of ``blocks`` unchanged in ``ns``, in order, then the claim on it, if any."""
    for index, (language, heading, source) in enumerate(blocks):
        if language != "python":
            continue
        where = block_id(page, index, heading, source)
        try:
            exec(compile(source, f"{page.name} block {index}", "exec"), ns)  # noqa: S102 - the page's own code, as a reader runs it
            for (section, line), check in CLAIMS.items():
                if section == heading and line in source:
                    check(ns)
        except Exception as error:
            raise PageError(f"{where}: {type(error).__name__}: {error}") from error


def running_servers(ns: dict) -> list[subprocess.Popen]:
    """The processes a page started (``qgraph serve``) that still run."""
    return [value for value in ns.values() if isinstance(value, subprocess.Popen) and value.poll() is None]


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_page_runs_as_written(tmp_path, monkeypatch, page):
    monkeypatch.chdir(tmp_path)  # the blocks write files (diagrams, captures, saved programs, checkpoints) here
    ns = fresh_namespace()
    try:
        run_blocks(page, PAGE_BLOCKS[page], ns)
        assert not running_servers(ns), f"{page.name} leaves its server running: stop it in the page's last block"
    finally:
        for process in running_servers(ns):  # a page that failed before its last block: its server goes too
            process.kill()
            process.wait(60)


def test_a_page_starts_from_an_empty_namespace():
    ns = fresh_namespace()
    assert ns == {}
    run_blocks(Path("page.md"), [("python", "Setup", "seen = sorted(globals())")], ns)
    assert ns["seen"] == ["__builtins__"]


def test_a_name_no_earlier_block_defines_fails_its_page():
    blocks = [("python", "Setup", "x = 1"), ("text", "Setup", "model = 2"), ("python", "Use", "y = x + model")]
    with pytest.raises(PageError, match=r"page\.md:2:Use:y = x \+ model: NameError: name 'model' is not defined"):
        run_blocks(Path("page.md"), blocks, fresh_namespace())
    assert undefined_names(blocks) == [(2, {"model"})]


def undefined_names(blocks: list[tuple[str, str, str]]) -> list[tuple[int, set[str]]]:
    """Each python block's global names that neither it nor an earlier python block binds (builtins
    aside), read from the code without running it: ``(index, names)`` for each block with any."""
    bound, missing = set(dir(builtins)), []
    for index, (language, _, source) in enumerate(blocks):
        if language != "python":
            continue
        top = symtable.symtable(source, "block", "exec")
        tables, read = [top], set()
        while tables:
            table = tables.pop()
            read |= {symbol.get_name() for symbol in table.get_symbols()
                     if symbol.is_referenced() and (table is top or symbol.is_global())}
            tables += table.get_children()
        bound |= {symbol.get_name() for symbol in top.get_symbols() if symbol.is_assigned() or symbol.is_imported()}
        if read - bound:
            missing.append((index, read - bound))
    return missing


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_page_uses_only_names_it_defines(page):
    """The static side of running the page: no block reads a name the page has not bound by then."""
    blocks = PAGE_BLOCKS[page]
    assert not [(block_id(page, i, blocks[i][1], blocks[i][2]), names) for i, names in undefined_names(blocks)]


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """One ``QGRAPH_CACHE`` for this file, with the disk cache of programs on: a page that loads the
    tiny checkpoint afresh, a server it starts, and the command lines load the program an earlier
    page exported instead of exporting it again (as a user's second process would)."""
    path = tmp_path_factory.mktemp("readme-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QGRAPH_CACHE", str(path))
        patch.setenv("QGRAPH_PROGRAM_CACHE", "1")
        yield path


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
    words = [*words[1:], "--port", "0"]
    process = subprocess.Popen([qgraph_executable(), *words], cwd=cwd, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        line = process.stdout.readline()
    finally:
        process.send_signal(signal.SIGTERM)
    rest = process.communicate(timeout=120)[0]
    return (0 if process.returncode in (0, -signal.SIGTERM) else process.returncode), line + rest


@pytest.mark.slow  # each command in a fresh process (python -m pytest -m slow)
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

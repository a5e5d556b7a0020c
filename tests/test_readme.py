"""Every ``bash`` and ``python`` block of README.md and of the documentation site (``docs/``,
with the files its pages include, such as DESIGN.md) runs, as a user would run it.

Each block runs in a fresh folder holding the small corpus ``python tools/make_tour.py`` makes
(the README says so): ``photos/`` (class folders mixing ``.jpg``, ``.jpeg`` and ``.png`` files
in grey, RGB, RGBA and palette modes, of varying sizes), ``corpus/docs.jsonl`` (documents with a
``text`` key), ``tokenizer.json`` (a tiny word-level ``tokenizers`` file for that corpus) and
``tools/`` (this repository's).  Python blocks also find ``packed/``, ``packed-text/`` and
``packed-tokens/`` (token shards) already packed from those (bash blocks pack their own, as
they say).  Python blocks run as scripts with this interpreter; bash blocks under ``bash -euo
pipefail`` with this environment's ``shardloader`` and ``python`` first on PATH.

A block that cannot run here (installs, CI, a real S3 endpoint, signatures) carries a visible
opt-out on the line before its fence: ``<!-- readme-test: skip (reason) -->`` (in the site's
pages, ``<!-- docs-test: skip (reason) -->``: the comment does not show there either); it is
reported as skipped with that reason.  A block that is neither runnable nor marked fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

from make_tour import make_tour  # noqa: E402

README = os.path.join(ROOT, "README.md")
SITE = os.path.join(ROOT, "docs")
RUN = {"python", "bash"}
NOT_CODE = {"", "text"}  # diagrams and sample output
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*(?:readme|docs)-test:\s*skip\s*\((.+)\)\s*-->\s*$")
_ANY_MARKER = re.compile(r"(?:readme|docs)-test")
_SNIPPET = re.compile(r'^--8<-- "([^"]+)"\s*$')  # pymdownx.snippets, as mkdocs.yml sets it up
TIMEOUT = 240  # under pytest-timeout's 300 s, so the block's own output is shown


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the reason, when marked
    section: str
    doc: str = "README.md"  # relative to the repository

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")[:40]
        page = os.path.splitext(self.doc)[0].replace("/", "-")
        return f"{page}-L{self.line}-{self.lang}-{slug}"


def documents() -> list[str]:
    """README.md and every page of the site, relative to the repository."""
    pages = [
        os.path.relpath(os.path.join(folder, name), ROOT)
        for folder, _, names in os.walk(SITE)
        for name in names
        if name.endswith(".md")
    ]
    return ["README.md", *sorted(pages)]


def expand(text: str) -> str:
    """The text with each ``--8<-- "FILE"`` line replaced by FILE, as the site build does."""
    out = []
    for line in text.splitlines():
        match = _SNIPPET.match(line)
        if match is None:
            out.append(line)
            continue
        with open(os.path.join(ROOT, match.group(1)), encoding="utf-8") as f:
            out.extend(f.read().splitlines())
    return "\n".join(out) + "\n"


def parse(text: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a markdown text, and any problems with the skip markers."""
    blocks: list[Block] = []
    problems: list[str] = []
    lines = text.splitlines()
    section = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        if (
            line.lstrip().startswith("<!--")
            and _ANY_MARKER.search(line)
            and not _MARKER.match(line)
        ):
            problems.append(f"line {i + 1}: malformed marker {line!r}")
        fence = _FENCE.match(line)
        if fence is None:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if j == len(lines):
            problems.append(f"line {start + 1}: unclosed fence")
            break
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = _MARKER.match(lines[before]) if before >= 0 else None
        blocks.append(
            Block(
                start + 1,
                fence.group(1),
                "\n".join(lines[start + 1 : j]) + "\n",
                marker.group(1) if marker else None,
                section,
            )
        )
        if marker and fence.group(1) not in RUN:
            problems.append(f"line {before + 1}: skip marker on a block that never runs")
        i = j + 1
    for n, line in enumerate(lines):
        if _MARKER.match(line):
            after = n + 1
            while after < len(lines) and not lines[after].strip():
                after += 1
            if after >= len(lines) or not _FENCE.match(lines[after]):
                problems.append(f"line {n + 1}: skip marker not followed by a code block")
    return blocks, problems


def _all_blocks() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    problems: list[str] = []
    for doc in documents():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            found, trouble = parse(expand(f.read()))
        blocks += [dataclasses.replace(b, doc=doc) for b in found]
        problems += [f"{doc}: {p}" for p in trouble]
    return blocks, problems


BLOCKS, PROBLEMS = _all_blocks()


def test_the_parser_and_the_markers():
    assert PROBLEMS == []
    langs = {b.lang for b in BLOCKS}
    assert langs <= RUN | NOT_CODE, f"blocks in {langs - RUN - NOT_CODE}: run them or use text"
    runnable = [b for b in BLOCKS if b.lang in RUN and b.skip is None]
    assert len(runnable) >= 20  # the docs did not lose their snippets
    assert sum(b.doc == "README.md" for b in runnable) >= 3  # the README's tour runs
    assert {b.doc for b in runnable} >= {"README.md", "docs/llm.md", "docs/recipes.md"}
    got, problems = parse(
        "intro\n\n<!-- readme-test: skip (no endpoint) -->\n```python\nx\n```\n\n```bash\ny\n```\n"
    )
    assert [(b.line, b.lang, b.code, b.skip) for b in got] == [
        (4, "python", "x\n", "no endpoint"),
        (8, "bash", "y\n", None),
    ]
    assert problems == []
    _, problems = parse("<!-- readme-test: skip (stray) -->\ntext\n")
    assert problems == ["line 1: skip marker not followed by a code block"]
    got, problems = parse("<!-- docs-test: skip (a site page) -->\n```bash\nz\n```\n")
    assert [(b.skip, problems) for b in got] == [("a site page", [])]


def test_included_files_are_read_as_the_site_shows_them(tmp_path):
    """A page that includes DESIGN.md (pymdownx.snippets) is checked with DESIGN.md's blocks."""
    text = expand('intro\n--8<-- "DESIGN.md"\nafter\n')
    with open(os.path.join(ROOT, "DESIGN.md"), encoding="utf-8") as f:
        design = f.read()
    assert text == "intro\n" + design.rstrip("\n") + "\nafter\n"
    assert "docs/design.md" in documents() and "docs/reference/api.md" in documents()


# -- the corpus ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """(raw: inputs only, packed: inputs + packed/ + packed-text/ + packed-tokens/)."""
    pytest.importorskip("tokenizers")
    from shardloader.pack import PackOptions, pack

    raw = str(tmp_path_factory.mktemp("raw"))
    make_tour(raw)  # the README's one command: python tools/make_tour.py
    packed = str(tmp_path_factory.mktemp("packed"))
    shutil.copytree(raw, packed, dirs_exist_ok=True)
    pack(os.path.join(packed, "photos"), os.path.join(packed, "packed"), PackOptions())
    pack(
        os.path.join(packed, "corpus"),
        os.path.join(packed, "packed-text"),
        PackOptions(tokenizer=os.path.join(packed, "tokenizer.json")),
    )
    pack(
        os.path.join(packed, "corpus"),
        os.path.join(packed, "packed-tokens"),
        PackOptions(format="tokens", tokenizer=os.path.join(packed, "tokenizer.json")),
    )
    return raw, packed


def _env(work: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["SHARDLOADER_CACHE_DIR"] = os.path.join(work, ".cache")  # cache commands see their own
    env["MPLBACKEND"] = "Agg"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in RUN], ids=lambda b: b.id)
def test_block_runs(block: Block, corpus: tuple[str, str], tmp_path):
    if block.skip is not None:
        pytest.skip(f"{block.doc} line {block.line}: {block.skip}")
    work = str(tmp_path / "work")
    shutil.copytree(corpus[1] if block.lang == "python" else corpus[0], work)
    os.symlink(os.path.join(ROOT, "tools"), os.path.join(work, "tools"))
    if block.lang == "python":
        script = os.path.join(work, "readme_block.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(block.code)
        argv = [sys.executable, script]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    # its own session: a block that runs over is killed with everything it started (torchrun's
    # ranks, their DataLoader workers), not just the shell
    proc = subprocess.Popen(
        argv,
        cwd=work,
        env=_env(work),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"{block.doc} line {block.line} ({block.section}) ran over {TIMEOUT} s:\n"
            f"{block.code}\n--- stdout\n{stdout[-2000:]}\n--- stderr\n{stderr[-4000:]}"
        )
    assert proc.returncode == 0, (
        f"{block.doc} line {block.line} ({block.section}) exited {proc.returncode}:\n"
        f"{block.code}\n--- stdout\n{stdout[-2000:]}\n--- stderr\n{stderr[-4000:]}"
    )


def test_the_layout_names_real_files():
    """The Layout block (Design page) names modules and folders that exist (it once named
    monitor.py)."""
    layout = [b for b in BLOCKS if b.section == "Layout"]
    assert len(layout) == 1
    names = re.findall(r"(?<![\w./])([a-z_]+(?:\.py|/))(?!\w)", layout[0].code)
    assert len(names) >= 20
    package = os.path.join(ROOT, "shardloader")
    missing = [
        n for n in names if n != "shardloader/" and not os.path.exists(os.path.join(package, n))
    ]
    assert missing == []


def test_docs_hold_no_merge_conflict_markers():
    """A skipped block would hide a half-resolved merge; look at every Markdown file."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = [os.path.join(root, d) for d in [*documents(), "DESIGN.md"]]
    for path in docs:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                assert not line.startswith(("<<<<<<< ", ">>>>>>> ", "=======\n")), (
                    f"{path}:{number}: merge-conflict marker"
                )


@pytest.mark.slow
@pytest.mark.subprocess
def test_one_command_makes_the_tour_inputs(tmp_path):
    """The README names the command that makes photos/, corpus/ and tokenizer.json."""
    pytest.importorskip("tokenizers")
    with open(README, encoding="utf-8") as f:
        assert "python tools/make_tour.py" in f.read()
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "make_tour.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert len(os.listdir(tmp_path / "photos")) == 3
    assert (tmp_path / "corpus" / "docs.jsonl").stat().st_size > 0
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"

"""The documentation a user reads: the README, the site under docs/, and what they show.

The site is built for real (``mkdocs build --strict``, as CI builds it) and opened in headless
Chromium, served from 127.0.0.1: the home page, an API page and the benchmark page must render,
with every picture they show fetched.  The benchmark pictures must be what
``tools/plot_benchmarks.py`` draws from the committed JSON, and that script must read what the
benchmark tools write with ``--json``.  (Every code block of the pages runs in test_readme.py.)
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import plot_benchmarks  # noqa: E402
from http_server import QuietFiles, serving, static_files  # noqa: E402

CHROMIUM = shutil.which("chromium")
# the flags a sandboxed CI machine needs, and none that reach the network
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ISSUE_NUMBER = re.compile(r"issues? [0-9]+")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's notice about its successor, not a warning
    return env


# -- what the README and the site say ----------------------------------------------------------


def _user_facing() -> list[Path]:
    """README, the site's pages and config, the package (its --help and messages) and tools."""
    files = [ROOT / "README.md", ROOT / "mkdocs.yml"]
    for folder, pattern in (("docs", "*.md"), ("shardloader", "*.py"), ("tools", "*.py")):
        files += sorted((ROOT / folder).rglob(pattern))
    return files


@pytest.mark.slow
def test_nothing_user_facing_names_an_internal_issue_number():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
        for path in _user_facing()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if ISSUE_NUMBER.search(line)
    ]
    assert found == []


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    return [p for value in nav.values() for p in _nav_pages(value)]


def _config() -> dict[str, Any]:
    import yaml

    # mkdocs.yml holds no custom tags; the safe loader reads it whole
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def test_every_page_the_issue_lists_is_in_the_nav_and_every_page_is_reachable():
    pages = _nav_pages(_config()["nav"])
    on_disk = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(pages) == on_disk
    titles = " | ".join(_flatten_titles(_config()["nav"]))
    for wanted in (
        "Getting started",
        "Packing",
        "The dataset and its guarantees",
        "LLM batches",
        "Vision",
        "Object storage and the node cache",
        "At scale",
        "Service mode",
        "Recipes",
        "Benchmarks",
        "Troubleshooting",
        "Security",
        "Design",
        "Command line",
        "Python API",
    ):
        assert wanted in titles, wanted


def _flatten_titles(nav: Any) -> list[str]:
    if isinstance(nav, list):
        return [t for item in nav for t in _flatten_titles(item)]
    if isinstance(nav, dict):
        return [t for k, v in nav.items() for t in (k, *_flatten_titles(v))]
    return []


def test_the_design_page_includes_design_md_rather_than_copying_it():
    page = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    design = (ROOT / "DESIGN.md").read_text(encoding="utf-8")
    assert '--8<-- "DESIGN.md"' in page.splitlines()
    first_heading = next(line for line in design.splitlines() if line.startswith("## "))
    assert first_heading not in page


def _documented_names() -> set[str]:
    names = set()
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        names |= set(re.findall(r"^::: (shardloader(?:\.\w+)+)\s*$", page.read_text(), re.M))
    return names


@pytest.mark.slow
def test_the_api_reference_covers_every_public_name_through_the_public_packages():
    import shardloader

    documented = _documented_names()
    by_name = {path.rsplit(".", 1)[1] for path in documented}
    assert set(shardloader.__all__) - by_name == set()
    # each reference goes through a public package or a module the tree makes the API (the
    # modules of plan/, read/ and deliver/ are theirs), never a private defining module
    public = {"shardloader", "shardloader.batching", "shardloader.vision", "shardloader.service"}
    public |= {
        f"shardloader.{m}"
        for m in (
            "pack",
            "presets",
            "bench",
            "mixture",
            "read.verify",
            "plan.ledger",
            "read.skips",
            "deliver.monitor",
        )
    }
    assert {p.rsplit(".", 1)[0] for p in documented} <= public
    missing = []
    for path in sorted(documented):
        try:
            functools.reduce(getattr, path.split(".")[1:], shardloader)
        except AttributeError as err:
            missing.append(f"{path}: {err}")
    assert missing == []


# -- --version and python -m ---------------------------------------------------------------


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, check=False, env=_env(), cwd=ROOT
    )


def _console_script() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "shardloader")
    if not os.path.exists(script):
        pytest.skip("no shardloader console script beside this interpreter (not pip-installed)")
    return [script]


@pytest.mark.subprocess
def test_version_is_the_same_answer_from_the_command_and_python_m():
    import shardloader

    with open(ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["version"] == shardloader.__version__
    want = f"shardloader {shardloader.__version__}\n"
    for argv in (_console_script(), [sys.executable, "-m", "shardloader"]):
        done = _run([*argv, "--version"])
        assert (done.returncode, done.stdout, done.stderr) == (0, want, ""), argv


@pytest.mark.slow
@pytest.mark.subprocess
def test_python_m_shardloader_works_like_the_console_script():
    for args in (["--help"], ["pack", "--help"], ["no-such-command"], ["pack"]):
        script, module = (
            _run([*_console_script(), *args]),
            _run([sys.executable, "-m", "shardloader", *args]),
        )
        assert (module.returncode, module.stdout, module.stderr) == (
            script.returncode,
            script.stdout,
            script.stderr,
        ), args


# -- the pictures ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_committed_pictures_are_what_the_committed_data_draws():
    pytest.importorskip("matplotlib")
    pictures = plot_benchmarks.render(str(ROOT / "docs" / "benchmarks"))
    assert set(pictures) == {
        "bench-read-workers.svg",
        "bench-s3.svg",
        "bench-tokens.svg",
        "bench-pack.svg",
        "bench-balance.svg",
    }
    stale = [
        name for name, svg in pictures.items() if (ROOT / "docs" / "img" / name).read_bytes() != svg
    ]
    assert stale == [], "run: python tools/plot_benchmarks.py"
    for name in ("read", "s3", "tokens", "pack", "balance"):  # each says where it comes from
        data = json.loads((ROOT / "docs" / "benchmarks" / f"{name}.json").read_text())
        assert data["tool"] == f"tools/bench_{name}.py" and data["command"] and data["machine"]


def _load_tool(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_plot_script_reads_what_the_benchmark_tools_write(tmp_path, monkeypatch):
    """Each tool's --json writer, fed runs shaped as its children return them, then the plots."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(os, "environ", dict(os.environ))  # bench_s3 sets loopback variables
    s3 = _load_tool("bench_s3")
    rows = s3.Rows()
    for rep in range(3):
        rows.add("bare boto3 get_object x2", "-", {"seconds": 0.3 + rep / 100})
        rows.add("bare boto3 get_object x4", "-", {"seconds": 0.25})
        for name, secs in (("local disk", 0.5), ("S3 (moto)", 1.0), ("HTTP (http.server)", 0.8)):
            reqs = {} if name == "local disk" else {"GET shard": 13, "GET manifest": 1}
            rows.add(name, "now", {"seconds": secs, "first": 0.1, "requests": reqs})
    s3.write_json(str(tmp_path / "s3.json"), rows, 202 * 10**6, 13)
    written = json.loads((tmp_path / "s3.json").read_text())
    s3_rows = {(r["source"], r["reader"]): r for r in written["rows"]}
    assert s3_rows[("S3 (moto)", "now")]["mb_s"] == pytest.approx(202.0)
    assert s3_rows[("S3 (moto)", "now")]["vs_local"] == pytest.approx(0.5)
    assert s3_rows[("S3 (moto)", "now")]["requests_per_shard"] == pytest.approx(1.0)
    assert len(written["runs"]) == 15
    assert written["tool"] == "tools/bench_s3.py" and "cores" in written["machine"]
    assert written["command"].startswith("python tools/bench_s3.py")

    tokens = _load_tool("bench_tokens")
    runs = {
        (system, w): [
            {
                "rest": 8 * 2048 * 100,
                "seconds": s,
                "cpu": 0.01,
                "ttfb": 0.05,
                "anon_mb": 300.0,
                "pss_anon_mb": 290.0,
            }
            for s in (0.1, 0.2, 0.3)
        ]
        for system in ("shardloader", "litdata")
        for w in (0, 2)
    }
    tokens.write_json(str(tmp_path / "tokens.json"), runs, {"shardloader": 0.4})
    written = json.loads((tmp_path / "tokens.json").read_text())
    assert written["rows"][0]["mtok_s"] == pytest.approx(8 * 2048 * 100 / 0.2 / 1e6)
    assert written["tool"] == "tools/bench_tokens.py" and "load" in written["machine"]

    # the plot script also reads a bare list of records (older files, hand-made ones)
    read_run = {"system": "shardloader", "corpus": "images", "workers": 0, "samples_s": 1000.0}
    (tmp_path / "read.json").write_text(json.dumps([read_run, {**read_run, "samples_s": 3000.0}]))
    pack_row = {"workload": "images", "writer": "shardloader", "config": "CLI", "mb_s": 50.0}
    (tmp_path / "pack.json").write_text(json.dumps([pack_row]))
    steps = {"per_step_balanced": [1.0, 1.01], "per_step_unbalanced": [1.5, 1.7]}
    balance_row = {"seq_len": 8192, "ranks": 8, "rows_per_rank": 2, "balanced": 1.0}
    (tmp_path / "balance.json").write_text(
        json.dumps({"rows": [{**balance_row, "unbalanced": 1.6, **steps}]})
    )
    pictures = plot_benchmarks.render(str(tmp_path))
    assert set(pictures) == set(plot_benchmarks.FIGURES[n][1] for n in plot_benchmarks.FIGURES)
    assert all(svg.startswith(b"<?xml") and b"shardloader" in svg for svg in pictures.values())
    assert plot_benchmarks.medians(
        [read_run, {**read_run, "samples_s": 3000.0}], ("corpus", "workers", "system")
    ) == [{**read_run, "samples_s": 2000.0}]


# -- the site, built and opened --------------------------------------------------------------


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=_env(),
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as CI builds it."""
    pytest.importorskip(
        "mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'"
    )
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_site_builds_strict_with_generated_references(site: Path):
    for page in _nav_pages(_config()["nav"]):
        html = page[: -len(".md")] + "/index.html" if page != "index.md" else "index.html"
        assert (site / html).exists(), html
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="shardloader.ShardedDataset"' in api and "batch_size" in api
    assert ":class:" not in api and ":meth:" not in api  # Sphinx roles shown as code
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    for command in ("pack", "merge", "index", "inspect", "verify", "plan", "bench", "serve"):
        assert f'id="shardloader-{command}"' in cli, command
    assert "--shard-size" in cli  # options come from the click command itself
    design = (site / "design" / "index.html").read_text(encoding="utf-8")
    assert "On-disk contract" in design  # DESIGN.md, included


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_strict_build_fails_on_a_broken_link_and_a_missing_api_name(tmp_path):
    """The site's own settings (mkdocs.yml) on a one-page site: each mistake fails the build."""
    pytest.importorskip(
        "mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'"
    )
    import yaml

    config = _config()
    config.update(
        docs_dir=str(tmp_path / "docs"),
        nav=["index.md"],
        hooks=[str(ROOT / "tools" / "docs_hooks.py")],
    )
    python = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    python["paths"] = [str(ROOT)]
    (tmp_path / "docs").mkdir()
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    for text, says in (
        ("# A\n\nSee [the guide](no-such-page.md).\n", "no-such-page.md"),
        ("# A\n\n::: shardloader.NoSuchName\n", "NoSuchName"),
    ):  # (the whole site builds with these settings: the test above)
        (tmp_path / "docs" / "index.md").write_text(text)
        done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
        assert done.returncode != 0 and says in done.stderr, done.stderr[-3000:]


class _Recorder(QuietFiles):
    """Serves the built site and records each request's path and status."""

    served: list[tuple[str, int]]

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        self.served.append((self.path, int(code) if str(code).isdigit() else 0))


@pytest.fixture
def served(site: Path) -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """(base URL on 127.0.0.1, the requests it answered)."""
    log: list[tuple[str, int]] = []
    handler = type("Handler", (_Recorder,), {"served": log})
    with serving(static_files(site, handler)) as url:
        yield url, log


def _open(url: str, shot: Path, profile: Path) -> str:
    """The page's DOM after load, and its screenshot at ``shot``."""
    profile.mkdir()
    done = subprocess.run(
        [
            CHROMIUM or "chromium",
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--window-size=1280,1600",
            "--hide-scrollbars",
            f"--screenshot={shot}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)"
)
def test_the_site_renders_in_chromium_with_its_pictures(served, tmp_path):
    from PIL import Image

    base, log = served
    pages = {
        "/": ("Who it is for", {"img/data-flow.svg"}),
        "/reference/api/": ("shardloader.ShardedDataset", set()),
        "/benchmarks/": (
            "Reading",
            {f"img/bench-{n}.svg" for n in ("read-workers", "s3", "tokens", "pack", "balance")},
        ),
    }
    shots = Path(os.environ.get("SHARDLOADER_DOCS_SHOTS", tmp_path))
    for path, (says, pictures) in pages.items():
        name = path.strip("/").replace("/", "-") or "home"
        shot = shots / f"{name}.png"
        log.clear()
        dom = _open(base + path, shot, tmp_path / f"profile-{name}")
        assert says in dom, path
        # nothing from the network: every script, stylesheet and picture is the site's own
        assert re.findall(r'<(?:script|img)[^>]+src="(https?:[^"]*)"', dom) == [], path
        assert re.findall(r'<link[^>]+rel="stylesheet"[^>]+href="(https?:[^"]*)"', dom) == []
        shown = re.findall(r'<img[^>]+src="([^"]+)"', dom)
        for picture in pictures:
            assert any(src.endswith(picture) for src in shown), (path, picture, shown)
        ok = {p for p, status in log if status == 200}
        for picture in pictures:  # each was fetched, and answered
            assert any(p.endswith("/" + picture) for p in ok), (path, picture, log)
        assert any(re.search(r"/assets/stylesheets/main\.[^/]*\.css$", p) for p in ok), log
        with Image.open(shot) as image:
            assert image.size == (1280, 1600)
            colors = image.convert("RGB").getcolors(maxcolors=1 << 16)
            assert colors is None or len(colors) > 50, f"{path}: a blank page"

"""The command answers help and usage errors without importing torch, numpy or pyarrow.

Checked by what a fresh process imported (``sys.modules``), not by timing it:
``python tools/bench_cli.py`` prints the times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "pyarrow", "fsspec", "PIL")

_PROBE = r"""
import json, sys
argv, out = json.loads(sys.argv[1]), sys.argv[2]
code = None
if argv is None:
    import shardloader
    import shardloader.cli
else:
    from shardloader.cli import main
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
with open(out, "w") as f:
    json.dump({"code": code, "modules": sorted(sys.modules)}, f)
"""


def _probe(tmp_path, argv: list[str] | None) -> tuple[int | None, set[str], str]:
    out = tmp_path / "probe.json"
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.exists(), done.stderr
    got = json.loads(out.read_text())
    return got["code"], set(got["modules"]), done.stdout + done.stderr


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.mark.subprocess
def test_import_shardloader_and_its_cli_is_light(tmp_path):
    code, modules, _ = _probe(tmp_path, None)
    assert code is None
    assert "shardloader.cli" in modules
    assert _heavy(modules) == []


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["--help"], 0, "Commands:"),
        (["pack", "--help"], 0, "--shard-size"),
        (["merge", "--help"], 0, "--reference"),
        (["inspect", "--help"], 0, "--json"),
        (["bench", "--help"], 0, "--tolerance"),
        (["serve", "--help"], 0, "--token-file"),
        (["cache", "--help"], 0, "clear"),
        (["cache", "clear", "--help"], 0, "FINGERPRINT"),
        (["pack"], 2, "Missing argument 'SRC'"),
        (["pack", "a", "b", "--format", "zip"], 2, "'zip' is not one of"),
        (["bench", "x", "--tolerance", "2"], 2, "--tolerance"),
        (["bench", "--help"], 0, "--storage-option"),
        (["serve", "--help"], 0, "--retry-seconds"),
        (["verify", "--help"], 0, "--retries"),
        (["pack", "--help"], 0, "--retry-seconds"),
        (["serve", "x", "--transform", "flip"], 2, "'flip' is not one of"),
        (["bench", "x", "--retries", "-1"], 2, "--retries"),
        (["no-such-command"], 2, "No such command"),
    ],
)
def test_help_and_usage_errors_import_no_heavy_module(tmp_path, argv, code, says):
    got, modules, output = _probe(tmp_path, argv)
    assert got == code, output
    assert says in output
    assert _heavy(modules) == [], f"shardloader {' '.join(argv)} imported {_heavy(modules)}"


@pytest.mark.subprocess
def test_the_installed_command_answers_help(tmp_path):
    """The console script itself (what a user types), in a fresh process."""
    script = os.path.join(os.path.dirname(sys.executable), "shardloader")
    argv = [script] if os.path.exists(script) else [sys.executable, "-m", "shardloader"]
    done = subprocess.run(
        [*argv, "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    for command in ("pack", "merge", "index", "inspect", "verify", "bench", "serve", "cache"):
        assert f"  {command} " in done.stdout, command


def test_option_defaults_copied_into_the_cli_agree_with_the_library():
    """The CLI declares these without importing the library; they must not drift."""
    from shardloader import bench, pack
    from shardloader.cli import bench as bench_cli
    from shardloader.cli import cache as cache_cli
    from shardloader.cli import options as options_cli
    from shardloader.cli import pack as pack_cli
    from shardloader.pack.layouts import registry
    from shardloader.storage import cachedir
    from shardloader.storage.retry import RetryPolicy

    assert pack_cli.DEFAULT_SHARD_SIZE == pack.DEFAULT_SHARD_SIZE
    assert pack_cli.LAYOUTS == (registry.AUTO, *registry.BUILTIN_LAYOUTS)
    assert bench_cli.DEFAULT_TOLERANCE == bench.DEFAULT_TOLERANCE
    assert cache_cli.DIR_ENV == cachedir.DIR_ENV
    assert options_cli.DEFAULT_RETRIES == RetryPolicy().max_attempts - 1
    assert options_cli.DEFAULT_RETRY_SECONDS == RetryPolicy().max_total_seconds


def test_no_library_module_imports_the_cli():
    """Commands import the library, never the reverse (issue 12): an AST walk of every module
    outside ``shardloader/cli/`` (and ``__main__``, the command's entry point), lazy imports
    inside functions included."""
    import ast
    from pathlib import Path

    import shardloader

    root = Path(shardloader.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "cli" or rel == Path("__main__.py"):
            continue
        package = ["shardloader", *rel.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            else:
                continue
            if any(n == "shardloader.cli" or n.startswith("shardloader.cli.") for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == [], f"library modules import shardloader.cli: {offenders}"

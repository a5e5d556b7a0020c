""".ci/run builds a fresh virtual environment, even where a .venv already exists.

The script runs for real (bash) in a copy of the repository layout, with stand-ins for the
programs it calls (python3, pip, ruff, mypy, python, zstd) that record how they were called: a
real install would take minutes and the network.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RECORD = """#!/bin/bash
echo "$(basename "$0") $*" >> "$CALLS"
"""

# python3 -m venv .venv: note whether the old environment is still there, then make a new one
_PYTHON3 = (
    _RECORD
    + """
if [ -e .venv/stale ]; then echo "python3 saw the old .venv" >> "$CALLS"; fi
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  echo "export PATH=\\"$STUBS:\\$PATH\\"" > "$3/bin/activate"
fi
"""
)


def _stub(folder: str, name: str, body: str) -> None:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


@pytest.mark.subprocess
def test_ci_run_removes_an_existing_venv_and_installs_from_scratch(tmp_path):
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, ".ci", "run"), repo / ".ci" / "run")
    (repo / ".venv" / "lib").mkdir(parents=True)
    (repo / ".venv" / "stale").write_text("installed by an earlier run")
    stubs = str(tmp_path / "stubs")
    os.mkdir(stubs)
    _stub(stubs, "python3", _PYTHON3)
    for name in ("pip", "ruff", "mypy", "python", "zstd", "apt-get", "mkdocs"):
        _stub(stubs, name, _RECORD)
    calls = tmp_path / "calls.log"
    env = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "CALLS": str(calls),
        "STUBS": stubs,
        "HOME": str(tmp_path),
    }
    done = subprocess.run(
        ["bash", str(repo / ".ci" / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = calls.read_text().splitlines()
    assert "python3 saw the old .venv" not in lines
    assert not (repo / ".venv" / "stale").exists()
    # what this machine lacks of the native JPEG decoder's build is installed first, one by one
    missing = (
        ([] if shutil.which("cc", path="/usr/bin:/bin") else ["gcc", "libc6-dev"])
        + ([] if os.path.exists("/usr/include/jpeglib.h") else ["libjpeg62-turbo-dev"])
        + ([] if shutil.which("chromium", path="/usr/bin:/bin") else ["chromium"])
    )
    apt = ["apt-get update -qq"] + [f"apt-get install -y -qq {p}" for p in missing]
    assert lines == [
        *(apt if missing else []),
        "python3 -m venv .venv",
        "pip install -q torch==2.13.0",
        "pip install -q -c constraints.txt -e .[dev,docs]",
        "python -c from shardloader.vision import jpeg; "
        'print(jpeg.native_reason() or "native JPEG decoder built")',
        "ruff check shardloader tests tools",
        "ruff format --check shardloader tests tools",
        "mypy shardloader",
        "mkdocs build --strict --quiet --site-dir " + lines[-2].rsplit(" ", 1)[-1],
        "python -m pytest -q",
    ]

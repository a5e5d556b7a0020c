"""Packing into a full disk: one line naming the path, exit 1, and ``--resume`` keeps what was
finished once there is room.

The disk is real: a 1 MiB tmpfs mounted in a private mount namespace (``unshare -Urm``, which
needs no root outside it), so writes end in ENOSPC exactly as on a full volume.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from corpus import write

import shardloader

# Runs inside the namespace: mount, pack until the disk is full, make room, resume, verify.
_CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys
    mnt, src, cache = sys.argv[1:4]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", mnt], check=True)
    env = {**os.environ, "SHARDLOADER_CACHE_DIR": cache}
    cli = [sys.executable, "-m", "shardloader"]
    out = os.path.join(mnt, "out")
    common = ["pack", src, out, "--shard-size", "300KB", "--compression", "none", "-q"]

    def run(*args):
        p = subprocess.run(cli + list(args), capture_output=True, text=True, env=env)
        return {"rc": p.returncode, "out": p.stdout, "err": p.stderr}

    full = run(*common, "--workers", "2")
    left = sorted(os.listdir(out))
    subprocess.run(["mount", "-o", "remount,size=64m", mnt], check=True)
    resumed = run(*common[:-1], "--resume")
    verified = run("verify", out)
    print("RESULT " + json.dumps({"full": full, "left": left, "resumed": resumed,
                                   "verified": verified}))
    """
)


def _namespaces_work() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run(
        [unshare, "-Urm", "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(not _namespaces_work(), reason="needs unshare -Urm to mount a small tmpfs")
def test_a_full_disk_is_one_line_and_resume_keeps_the_finished_shards(tmp_path):
    src = str(tmp_path / "src")
    for i in range(40):  # 4 MB of incompressible samples: about four times the disk
        write(src, f"{'ab'[i % 2]}/{i:04d}.bin", os.urandom(100_000))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(shardloader.__file__))
    proc = subprocess.run(
        ["unshare", "-Urm", sys.executable, "-c", _CHILD, str(mnt), src, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(tmp_path),
        timeout=240,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout + proc.stderr
    got = json.loads(line[len("RESULT ") :])
    full = got["full"]
    assert full["rc"] == 1, full
    (message,) = full["err"].strip().splitlines()  # one line, no traceback
    assert "No space left on device" in message and f"{mnt}/out/shard-" in message
    assert "--resume" in message
    assert "index.json" not in got["left"]  # no manifest over a partial pack
    assert not [n for n in got["left"] if ".tmp-" in n]  # no temporary file left behind
    # A shard is finished once its sidecar is placed too: the disk can fill between the shard's
    # rename and its sidecar's write, and --resume packs such a shard again (it cannot prove it).
    left = got["left"]
    finished = [n for n in left if n.endswith(".tar") and n[:-4] + ".idx.arrow" in left]
    assert finished, got["left"]  # some shards were whole before the disk filled
    resumed = got["resumed"]
    assert resumed["rc"] == 0, resumed
    assert f"({len(finished)} kept from an earlier run)" in resumed["out"]
    assert got["verified"]["rc"] == 0, got["verified"]

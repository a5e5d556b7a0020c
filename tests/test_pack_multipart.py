"""``kill -9`` of a real ``pack … s3://`` mid multipart upload, then ``--resume``: the killed
run's incomplete uploads are aborted, another writer's are kept (NOTE [multipart journal] in
shardloader/storage/uploads.py), and ``cache info --uploads`` tells them apart beforehand.

The upload is held mid-way deterministically: pack talks to the real S3 server through the
fault proxy, which never answers the PUT of any upload's second part.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from fault_proxy import FaultProxy

from shardloader.read.verify import verify_dataset
from shardloader.storage.uploads import JOURNAL

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

PART = 5 * 2**20  # S3's smallest part: with this block size a 11 MiB shard goes in 3 parts


@pytest.fixture
def proxy(s3_server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server, stall_seconds=300.0, lifetime=300.0) as p:
        p.inject("stall", method="PUT", path="partNumber=2", times=None)
        yield p


def _uploads(s3_client, bucket: str) -> list[str]:
    return sorted(
        u["Key"] for u in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    )


def _pack(src, out: str, endpoint: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shardloader",
        "pack",
        str(src),
        out,
        "-o",
        f"endpoint_url={endpoint}",
        "-o",
        f"default_block_size={PART}",
        "--max-samples",
        "1",
        "--workers",
        "1",
        *extra,
    ]


def test_resume_after_kill_9_aborts_its_own_multipart_uploads_and_keeps_foreign_ones(
    tmp_path, s3_server, s3_client, s3_bucket, proxy
):
    rng = np.random.default_rng(0)
    (tmp_path / "src").mkdir()
    for i in range(2):  # incompressible: each shard is a multipart upload
        (tmp_path / "src" / f"{i:04d}.bin").write_bytes(rng.bytes(11 * 2**20))
    out = f"s3://{s3_bucket}/out"
    proc = subprocess.Popen(
        _pack(tmp_path / "src", out, proxy.endpoint, "--retries", "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # killed with its workers, as a lost node would be
    )
    try:
        deadline = time.monotonic() + 120
        while not any(r.fault == "stall" for r in list(proxy.requests)):
            if proc.poll() is not None:
                pytest.fail(f"pack ended early ({proc.returncode}): {proc.stderr.read().decode()}")
            assert time.monotonic() < deadline, "pack never reached a second part"
            time.sleep(0.05)
        assert _uploads(s3_client, s3_bucket)  # a multipart upload is under way
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    ours = _uploads(s3_client, s3_bucket)
    assert ours and all(k.startswith("out/shard-") for k in ours), ours

    # another writer's uploads: one under OUT, one beside it
    foreign = []
    for key in ("out/foreign.bin", "elsewhere/big.bin"):
        up = s3_client.create_multipart_upload(Bucket=s3_bucket, Key=key)
        s3_client.upload_part(
            Bucket=s3_bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * PART
        )
        foreign.append(key)

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardloader",
            "cache",
            "info",
            "--uploads",
            out,
            "--json",
            "-o",
            f"endpoint_url={s3_server}",
        ],
        capture_output=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    listed = {u["key"]: u["run"] for u in json.loads(r.stdout)["uploads"]}
    assert listed["foreign.bin"] is None
    assert {k for k, run in listed.items() if run} == {k[len("out/") :] for k in ours}

    r = subprocess.run(
        _pack(tmp_path / "src", out, s3_server, "--resume"), capture_output=True, timeout=300
    )
    assert r.returncode == 0, r.stderr.decode()
    assert _uploads(s3_client, s3_bucket) == sorted(foreign)  # none of its own, both foreign
    keys = [
        o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="out/")["Contents"]
    ]
    assert not [k for k in keys if k.startswith(f"out/{JOURNAL}/") or ".shardloader-lock" in k]
    report = verify_dataset(out, {"endpoint_url": s3_server})
    assert report.ok and report.samples == 2

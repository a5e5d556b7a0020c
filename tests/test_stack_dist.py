"""Real gloo jobs laid out as large-model training lays them out: data-parallel replicas of
tensor-parallel ranks (a DeviceMesh), checkpoints through torch.distributed.checkpoint.

Two torchrun agents on 127.0.0.1 are two nodes of 2 ranks (tests/stack_job.py); a third,
standalone run of 2 ranks loads their DCP checkpoint at another world size
(tests/dcp_job.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest
from helpers import torchrun, write_dataset

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

HERE = os.path.dirname(__file__)
SAMPLES = 62


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(tmp, node):
    return {
        **os.environ,
        "TMPDIR": str(tmp),
        "OMP_NUM_THREADS": "1",
        "NODE_CACHE": str(tmp / f"cache{node}"),
        "PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p),
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Every rank's record of tests/stack_job.py, run as 2 nodes x 2 ranks."""
    tmp = tmp_path_factory.mktemp("stack")
    data = str(tmp / "ds")
    write_dataset(data, [13, 2, 40, 7], compression="zstd")
    out, port = str(tmp / "seen.json"), _free_port()
    procs = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2"),
            *("--master-addr", "127.0.0.1", "--master-port", str(port)),
            os.path.join(HERE, "stack_job.py"),
            data,
            out,
            str(tmp / "ckpt"),
        ]
        procs.append(subprocess.Popen(cmd, env=_env(tmp, node), stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-3000:]
    with open(out) as f:
        ranks = sorted(json.load(f), key=lambda r: r["rank"])
    return {"ranks": ranks, "data": data, "tmp": tmp}


def real(records):
    return [
        i
        for rec in records
        for ids, pads in zip(rec["ids"], rec["pads"], strict=True)
        for i, pad in zip(ids, pads, strict=True)
        if not pad
    ]


def replicas(ranks):
    """Each replica's first tensor-parallel rank (the others must have read the same)."""
    return [r for r in ranks if r["coord"][1] == 0]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_replicas_ranks_read_the_same_batches_and_replicas_split_the_epoch(job, workers):
    ranks = job["ranks"]
    key = f"epoch0_w{workers}"
    for r in ranks:
        dp, _ = r["coord"]
        assert r[key]["place"] == [dp, 2]  # rank and world: the replica's
        assert r[key]["partition"] == [2, 1]  # a replica a node: a partition each
    by_replica = {}
    for r in ranks:
        by_replica.setdefault(r["coord"][0], []).append(r[key])
    for same in by_replica.values():
        assert same[0]["digests"] == same[1]["digests"]  # byte-identical batches
        assert same[0]["ids"] == same[1]["ids"]
    assert len({len(r[key]["ids"]) for r in ranks}) == 1  # equal steps on every rank
    assert all(r[key]["len"] == len(r[key]["ids"]) for r in ranks)
    assert sorted(real([r[key] for r in replicas(ranks)])) == list(range(SAMPLES))
    assert ranks[0][key]["digests"] != ranks[2][key]["digests"]  # the replicas differ
    if workers:  # the same sequence whatever num_workers is
        assert all(r["epoch0_w0"]["digests"] == r[key]["digests"] for r in ranks)


def test_a_dcp_checkpoint_at_2x2_resumes_at_4x1_exactly(job):
    ranks = job["ranks"]
    saved = [r["dcp"]["saved"] for r in ranks]
    assert all(s == saved[0] for s in saved)  # one state for every rank
    assert saved[0]["position"] == 3 * 2 and saved[0]["partitions"] == 2
    assert all(r["dcp"]["loaded"] == saved[0] for r in ranks)  # what DCP gave back
    assert all(r["dcp"]["weight"] == [0, 1, 2, 3, 4, 5] for r in ranks)  # beside the model
    assert all(r["dcp"]["partition"] == [2, 2] for r in ranks)  # 2 replicas a node at 4 x 1
    head = real([r["dcp"]["head"] for r in replicas(ranks)])
    rest = real([r["dcp"]["rest"] for r in ranks])
    assert Counter(head + rest) == Counter(range(SAMPLES))  # nothing lost or repeated
    assert len({len(r["dcp"]["rest"]["ids"]) for r in ranks}) == 1


def test_a_state_saved_at_4x1_resumes_at_2x2_exactly(job):
    ranks = job["ranks"]
    assert all(r["grow"]["state"] == ranks[0]["grow"]["state"] for r in ranks)
    assert ranks[0]["grow"]["state"]["position"] == 2 * 4  # 2 steps of 4 replicas
    head = real([r["grow"]["head"] for r in ranks])
    rest = real([r["grow"]["rest"] for r in replicas(ranks)])
    assert Counter(head + rest) == Counter(range(SAMPLES))
    for dp in range(2):
        same = [r["grow"]["rest"]["digests"] for r in ranks if r["coord"][0] == dp]
        assert same[0] == same[1]


@pytest.fixture(scope="module")
def two_ranks(job):
    """tests/dcp_job.py, standalone, 2 ranks: loads the 4-rank job's checkpoint."""
    tmp = job["tmp"]
    out = str(tmp / "dcp.json")
    torchrun(
        str(tmp),
        "dcp_job.py",
        2,
        job["data"],
        out,
        str(tmp / "ckpt"),
        timeout=400,
        env=_env(tmp, 0),
    )
    with open(out) as f:
        return sorted(json.load(f), key=lambda r: r["rank"])


def test_dcp_loads_a_4_rank_checkpoint_on_2_ranks_and_round_trips_there(job, two_ranks):
    head = real([r["dcp"]["head"] for r in replicas(job["ranks"])])  # the 4-rank job's
    part = real([r["part"] for r in two_ranks])
    rest = real([r["rest"] for r in two_ranks])
    assert Counter(head + part + rest) == Counter(range(SAMPLES))
    # the 2-partition position became an earlier link of one partition on one node
    loaded = two_ranks[0]["loaded"]
    assert loaded["partitions"] == 1 and loaded["reshapes"][0][1:] == [2, 6]
    for r in two_ranks:
        assert r["loaded"] == loaded and r["reloaded"] == r["saved"] == two_ranks[0]["saved"]

"""A real multi-process torch.distributed run (gloo on CPU, started with torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import torchrun, write_dataset


@pytest.mark.slow
@pytest.mark.subprocess
def test_ranks_disjoint_complete_equal(tmp_path):
    data = str(tmp_path / "ds")
    write_dataset(data, [13, 2, 40, 7], compression="zstd")  # 62 samples
    out = str(tmp_path / "seen.json")
    torchrun(str(tmp_path), "dist_job.py", 3, data, out, "2")
    with open(out) as f:
        ranks = sorted(json.load(f), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for epoch in ("0", "1"):
        lengths = {len(r["seen"][epoch]["ids"]) for r in ranks}
        assert len(lengths) == 1  # equal steps on every rank
        assert lengths == {r["seen"][epoch]["len"] for r in ranks}  # len(loader) told the truth
        real = [
            i
            for r in ranks
            for b, p in zip(r["seen"][epoch]["ids"], r["seen"][epoch]["pads"], strict=False)
            for i, pad in zip(b, p, strict=False)
            if not pad
        ]
        assert sorted(real) == list(range(62))  # disjoint and complete
        total = sum(len(b) for r in ranks for b in r["seen"][epoch]["ids"])
        assert total - 62 == ranks[0]["padded"]  # padding is exactly what the report says
    order0 = [r["seen"]["0"]["ids"] for r in ranks]
    order1 = [r["seen"]["1"]["ids"] for r in ranks]
    assert order0 != order1  # each epoch reshuffles


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("partition", ["node", "global"])
def test_two_torchrun_nodes_each_read_their_own_shards(tmp_path, partition):
    """Two torchrun agents on 127.0.0.1 as two nodes of 2 ranks (GROUP_RANK and
    LOCAL_WORLD_SIZE as on real machines), each with its own node cache."""
    data = str(tmp_path / "ds")
    write_dataset(data, [30, 18, 25, 40, 11, 27, 33, 16], compression="zstd")  # 200 samples
    out = str(tmp_path / "seen.json")
    port = _free_port()
    procs = []
    for node in range(2):
        env = {
            **os.environ,
            "TMPDIR": str(tmp_path),
            "OMP_NUM_THREADS": "1",
            "NODE_CACHE": str(tmp_path / f"cache{node}"),
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            os.path.join(os.path.dirname(__file__), "node_job.py"),
            data,
            out,
            partition,
        ]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
    with open(out) as f:
        ranks = sorted(json.load(f), key=lambda r: r["rank"])
    assert [r["node"] for r in ranks] == [0, 0, 1, 1]
    want = [2, 2] if partition == "node" else [1, 4]
    assert all(r["partition"] == want for r in ranks)  # detected from torchrun's variables
    assert len({len(r["ids"]) for r in ranks}) == 1  # equal steps on every rank
    real = [
        i
        for r in ranks
        for b, p in zip(r["ids"], r["pads"], strict=True)
        for i, pad in zip(b, p, strict=True)
        if not pad
    ]
    assert sorted(real) == list(range(200))  # every sample once across the two nodes
    node0, node1 = set(ranks[0]["staged"]), set(ranks[2]["staged"])
    assert len(node0 | node1) == 8
    if partition == "node":
        assert len(node0 & node1) <= 1  # each node staged its own span: one shard shared
    else:
        assert len(node0) + len(node1) >= 14  # the global order: each node nearly everything

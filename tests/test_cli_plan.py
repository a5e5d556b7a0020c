"""``shardloader plan``: the cost of an epoch on a cluster, from the manifest alone."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner
from helpers import write_dataset

from shardloader.cli import main


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_plan_prints_per_node_costs_and_mixing(tmp_path):
    data = str(tmp_path / "ds")
    write_dataset(data, [50] * 40, compression="zstd")  # 2,000 samples in 40 shards
    for name in os.listdir(data):  # the plan reads the manifest only: shards may be absent
        if name.startswith("shard-") and name.endswith(".zst"):
            os.remove(os.path.join(data, name))
    args = ["plan", data, "--nodes", "4", "--ranks-per-node", "2", "--batch-size", "5"]
    got = cli(*args, "--epochs", "2", "--json")
    assert got.exit_code == 0, got.output
    out = json.loads(got.output)
    first, second = out["epochs"]
    assert out["partitions"] == 4
    assert first["shards_per_node"]["min"] >= 10 and first["shards_per_node"]["max"] <= 11
    assert 1.0 <= first["cluster_multiple"] <= 1 + 3 / 40  # at most one shared shard a border
    assert first["gets"] == sum(n["shards"] for n in first["per_node"])
    assert second["gets_with_share_cache"] < second["gets"]  # some shards stay on their node
    assert abs(first["quality"]["kendall_tau"]) < 0.3
    glob = json.loads(cli(*args, "--partition", "global", "--json").output)["epochs"][0]
    assert glob["cluster_multiple"] > 3  # every node reads nearly every shard
    text = cli(*args)
    assert text.exit_code == 0 and "GETs" in text.output and "x the dataset" in text.output


def test_plan_refuses_what_it_cannot_answer(tmp_path):
    data = str(tmp_path / "ds")
    write_dataset(data, [10, 10])
    got = cli("plan", data, "--classes")
    assert got.exit_code == 2 and "needs a class-folder dataset" in got.output
    assert cli("plan", data, "--nodes", "0").exit_code == 2
    missing = cli("plan", str(tmp_path / "nothing"))
    assert missing.exit_code == 1

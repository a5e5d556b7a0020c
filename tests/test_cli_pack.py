"""The pack/merge/index/inspect/verify commands through click's runner: output and exit codes."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from click.testing import CliRunner
from corpus import class_folders, docs, jsonl, key_groups, write

from shardloader.cli import main


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_pack_prints_a_summary(tmp_path):
    class_folders(str(tmp_path / "src"))
    r = run("pack", tmp_path / "src", tmp_path / "out", "--max-samples", "5")
    assert r.exit_code == 0, r.output
    for word in (
        "samples   12",
        "shards    3",
        "bytes in",
        "bytes out",
        "ratio",
        "MB/s",
        "classes   3",
    ):
        assert word in r.stdout
    assert os.path.exists(tmp_path / "out" / "index.json")
    q = run("pack", tmp_path / "src", tmp_path / "q", "--quiet", "--shard-size", "4KB")
    assert q.exit_code == 0 and q.stdout == ""


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, [], "empty source"),
        ({"x/y/z/README": b"?"}, [], "unknown layout"),
        ({"a.jsonl": b"{}\n", "b/c.jpg": b"?"}, [], "mixed layouts"),
        ({"a.jsonl": b"{}\n"}, ["--format", "arrow", "--compression", "gzip"], "gzip"),
        ({"a.jsonl": b"{}\n"}, ["--shard-size", "lots"], "size 'lots'"),
        ({"a.jsonl": b"{}\n"}, ["--num-parts", "2", "--part", "5"], "part"),
        ({"a.jsonl": b"{}\n"}, ["--resume", "--overwrite"], "pick one"),
        ({"a.jsonl": b"{}\n"}, ["--compression", "brotli"], "brotli"),
    ],
)
def test_usage_errors_exit_2(tmp_path, setup, args, message):
    (tmp_path / "src").mkdir()
    for rel, data in (setup or {}).items():
        write(str(tmp_path / "src"), rel, data)
    r = run("pack", tmp_path / "src", tmp_path / "out", *args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr
    assert not os.path.exists(tmp_path / "out" / "index.json")


def test_bad_record_exits_1_naming_file_and_line(tmp_path):
    jsonl(str(tmp_path / "src/d.jsonl"), docs(5), extra_lines={3: b"{nope"})
    r = run("pack", tmp_path / "src", tmp_path / "out")
    assert r.exit_code == 1
    assert "d.jsonl line 4" in r.stderr and "invalid JSON" in r.stderr
    skip = run("pack", tmp_path / "src", tmp_path / "skip", "--on-error", "skip")
    assert skip.exit_code == 0
    assert "skipped 1" in skip.stdout and "skipped.jsonl" in skip.stdout


def test_not_empty_output_exits_1_until_overwrite(tmp_path):
    key_groups(str(tmp_path / "src"), n=3)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "junk.txt").write_text("x")
    r = run("pack", tmp_path / "src", tmp_path / "out")
    assert r.exit_code == 1 and "not empty" in r.stderr and "--overwrite" in r.stderr
    assert run("pack", tmp_path / "src", tmp_path / "out", "--overwrite").exit_code == 0
    assert (tmp_path / "out" / "junk.txt").exists()


def test_pack_and_inspect_report_the_same_labelled_ratio(tmp_path):
    jsonl(str(tmp_path / "src/d.jsonl"), docs(200))
    p = run("pack", tmp_path / "src", tmp_path / "out")
    assert p.exit_code == 0, p.output
    i = run("inspect", tmp_path / "out")
    packed = re.search(r"ratio +([0-9.]+)x compression \(uncompressed / stored", p.stdout)
    inspected = re.search(r"ratio ([0-9.]+)x compression \(uncompressed / stored\)", i.stdout)
    assert packed and inspected and packed.group(1) == inspected.group(1)
    assert re.search(r"[0-9.]+x input / stored", p.stdout)


def test_inspect_and_verify(tmp_path):
    class_folders(str(tmp_path / "src"), classes=("cat", "dog"), per_class=3)
    assert run("pack", tmp_path / "src", tmp_path / "out", "--max-samples", "2").exit_code == 0
    r = run("inspect", tmp_path / "out")
    assert r.exit_code == 0
    assert "shards     3" in r.stdout and "samples 6" in r.stdout
    assert "cat: 3" in r.stdout and "dog: 3" in r.stdout
    j = json.loads(run("inspect", tmp_path / "out", "--json").stdout)
    assert j["num_samples"] == 6 and j["classes"] == [
        {"name": "cat", "samples": 3},
        {"name": "dog", "samples": 3},
    ]
    ok = run("verify", tmp_path / "out")
    assert ok.exit_code == 0 and "3 of 3 shards ok" in ok.stdout
    shard = tmp_path / "out" / "shard-00001.tar.zst"
    shard.write_bytes(shard.read_bytes()[:-3])
    bad = run("verify", tmp_path / "out")
    assert bad.exit_code == 1
    assert "BAD shard-00001.tar.zst" in bad.stdout and "1 of 3 shards" in bad.stderr
    j = json.loads(run("verify", tmp_path / "out", "--json").stdout)
    assert j["ok"] is False and j["bad"][0]["path"] == "shard-00001.tar.zst"
    missing = run("inspect", tmp_path / "nothing")
    assert missing.exit_code == 1 and "no manifest" in missing.stderr


def test_parts_merge_and_index_commands(tmp_path):
    key_groups(str(tmp_path / "src"), n=10)
    for i in range(2):
        r = run(
            "pack",
            tmp_path / "src",
            tmp_path / f"p{i}",
            "--num-parts",
            "2",
            "--part",
            i,
            "--max-samples",
            "3",
        )
        assert r.exit_code == 0, r.output
    r = run("merge", tmp_path / "p0", tmp_path / "p1", tmp_path / "merged")
    assert r.exit_code == 0, r.output
    assert "merged 2 parts" in r.stdout and "(copy)" in r.stdout and "10 samples" in r.stdout
    assert run("verify", tmp_path / "merged", "--no-images").exit_code == 0
    again = run("merge", tmp_path / "p0", tmp_path / "p1", tmp_path / "merged")
    assert again.exit_code == 1 and "not empty" in again.stderr
    r = run("pack", tmp_path / "src", tmp_path / "plain", "--compression", "none")
    assert r.exit_code == 0
    outside = run("index", tmp_path / "plain" / "shard-00000.tar", tmp_path / "idx")
    assert outside.exit_code == 2 and "not below" in outside.stderr
    (tmp_path / "idx").mkdir()
    shutil.copy(tmp_path / "plain" / "shard-00000.tar", tmp_path / "idx")
    small = run(
        "index", tmp_path / "idx" / "shard-00000.tar", tmp_path / "idx", "--max-member-size", "10"
    )
    assert small.exit_code == 1 and "more than the 10 allowed" in small.stderr
    r = run("index", tmp_path / "idx" / "shard-00000.tar", tmp_path / "idx")
    assert r.exit_code == 0 and "indexed 1 shards, 10 samples" in r.stdout
    bad = run("index", tmp_path / "src" / "a" / "0000.json", tmp_path / "idx2")
    assert bad.exit_code == 2 and "not a tar shard" in bad.stderr


def test_part_comes_from_job_completion_index_unless_given(tmp_path, monkeypatch):
    """A Kubernetes Indexed Job sets JOB_COMPLETION_INDEX per pod (docker/k8s/pack-parts.yaml);
    an explicit --part wins; a value that is no number is a usage error."""
    class_folders(str(tmp_path / "src"), per_class=4)

    def part_of(out: str) -> int:
        with open(os.path.join(out, "index.json")) as f:
            return json.load(f)["extra"]["part"]["index"]

    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    base = ["pack", tmp_path / "src"]
    assert run(*base, tmp_path / "a", "--num-parts", "3", "--max-samples", "2", "-q").exit_code == 0
    assert part_of(str(tmp_path / "a")) == 2
    r = run(*base, tmp_path / "b", "--num-parts", "3", "--part", "1", "--max-samples", "2", "-q")
    assert r.exit_code == 0 and part_of(str(tmp_path / "b")) == 1
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "x")
    r = run(*base, tmp_path / "c", "--num-parts", "3")
    assert r.exit_code == 2 and "JOB_COMPLETION_INDEX='x'" in r.output
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")  # past --num-parts: PackOptions refuses it
    r = run(*base, tmp_path / "d", "--num-parts", "3")
    assert r.exit_code == 2 and "--part 3 --num-parts 3" in r.output

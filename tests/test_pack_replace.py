"""Packing over a dataset: --overwrite keeps the old one readable until the new one is whole
(pack and index), and --resume refuses a finished pack of another source."""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner
from corpus import docs, jsonl, key_groups

import shardloader as sl
from shardloader.cli import main
from shardloader.errors import InputError, OutputExistsError
from shardloader.pack import PackOptions, pack
from shardloader.read.verify import verify_dataset


def _keys(out) -> list[str]:
    return sorted(s["__key__"] for s in sl.ShardedDataset(str(out), decoder=None))


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_failed_overwrite_leaves_the_old_dataset_whole(tmp_path):
    jsonl(str(tmp_path / "old/a.jsonl"), docs(12, seed=1))
    out = tmp_path / "ow"
    pack(str(tmp_path / "old"), str(out), PackOptions(max_samples=4))
    before = _keys(out)
    # The new input breaks in its third shard: the first two are written by then.
    jsonl(str(tmp_path / "new/a.jsonl"), docs(12, seed=2), extra_lines={9: b"{broken"})
    r = _run("pack", tmp_path / "new", out, "--overwrite", "--max-samples", "4")
    assert r.exit_code == 1 and "invalid JSON" in r.stderr
    assert _keys(out) == before
    assert verify_dataset(str(out)).ok  # no old shard was replaced under its manifest
    assert not [n for n in os.listdir(out) if ".tmp-" in n]  # and no temporary file is left


def test_an_overwrite_replaces_the_dataset_once_the_new_one_is_whole(tmp_path):
    jsonl(str(tmp_path / "old/a.jsonl"), docs(12, seed=1))
    out = tmp_path / "ow"
    pack(str(tmp_path / "old"), str(out), PackOptions(max_samples=4))
    jsonl(str(tmp_path / "new/b.jsonl"), docs(5, seed=2))
    report = pack(str(tmp_path / "new"), str(out), PackOptions(max_samples=4, overwrite=True))
    assert report.shards == 2
    assert _keys(out) == [f"b/{i:09d}" for i in range(1, 6)]
    assert verify_dataset(str(out)).ok
    assert sorted(os.listdir(out)) == sorted(
        ["index.json"] + [p for s in report.manifest.shards for p in (s.path, s.index_path)]
    )


def test_a_failed_index_overwrite_leaves_the_old_manifest(tmp_path):
    key_groups(str(tmp_path / "src"), n=6)
    out = tmp_path / "shards"
    pack(str(tmp_path / "src"), str(out), PackOptions(max_samples=3, compression="none"))
    before = _keys(out)
    bad = out / "zz-broken.tar"
    bad.write_bytes(b"not a tar file at all" * 40)
    r = _run("index", out, out, "--overwrite")
    assert r.exit_code == 1, r.output
    assert _keys(out) == before
    os.remove(bad)
    done = _run("index", out, out, "--overwrite")
    assert done.exit_code == 0, done.output
    assert _keys(out) == before


def test_resume_refuses_a_finished_pack_of_another_source(tmp_path):
    key_groups(str(tmp_path / "images"), n=6)
    jsonl(str(tmp_path / "text/d.jsonl"), docs(6))
    out = tmp_path / "out"
    pack(str(tmp_path / "images"), str(out), PackOptions(max_samples=3))
    before = _keys(out)
    with pytest.raises(OutputExistsError, match="holds a finished pack of another source") as e:
        pack(str(tmp_path / "text"), str(out), PackOptions(resume=True))
    assert "layout 'key-groups'" in str(e.value) and "layout 'records'" in str(e.value)
    assert "first sample 'a/0000'" in str(e.value) and "'d/000000001'" in str(e.value)
    assert _keys(out) == before and verify_dataset(str(out)).ok
    r = _run("pack", tmp_path / "text", out, "--resume")
    assert r.exit_code == 1 and "pass --overwrite to replace that dataset" in r.stderr
    # The same source resumes as before: every shard kept.
    again = pack(str(tmp_path / "images"), str(out), PackOptions(max_samples=3, resume=True))
    assert again.kept_shards == again.shards == 2


def test_resume_of_a_changed_source_with_the_same_names_still_resumes(tmp_path):
    jsonl(str(tmp_path / "src/d.jsonl"), docs(8))
    out = tmp_path / "out"
    pack(str(tmp_path / "src"), str(out), PackOptions(max_samples=4))
    shutil.rmtree(tmp_path / "src")
    jsonl(str(tmp_path / "src/d.jsonl"), docs(10))  # more lines: the same source, grown
    report = pack(str(tmp_path / "src"), str(out), PackOptions(max_samples=4, resume=True))
    assert report.samples == 10


def test_overwrite_with_bad_input_raises_before_touching_anything(tmp_path):
    jsonl(str(tmp_path / "old/a.jsonl"), docs(4))
    out = tmp_path / "ow"
    pack(str(tmp_path / "old"), str(out))
    names = sorted(os.listdir(out))
    jsonl(str(tmp_path / "new/a.jsonl"), docs(2), extra_lines={0: b"{"})
    with pytest.raises(InputError):
        pack(str(tmp_path / "new"), str(out), PackOptions(overwrite=True))
    assert sorted(os.listdir(out)) == names

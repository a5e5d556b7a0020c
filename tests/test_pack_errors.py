"""Bad input: a clear error naming file and line/key, or a skip that is reported; nothing lost."""

from __future__ import annotations

import gzip
import json
import os

import pytest
from corpus import (
    class_folders,
    docs,
    jsonl,
    key_groups,
    read_back,
    tree,
    undecodable_png,
    write,
)

from shardloader.errors import InputError, OutputExistsError, StorageError, UsageError
from shardloader.pack import PackOptions, pack


def _no_manifest(out) -> bool:
    return not os.path.exists(os.path.join(out, "index.json"))


def _skips(out) -> list[dict]:
    with open(os.path.join(out, "skipped.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_invalid_json_line_fails_naming_file_line_and_key(tmp_path):
    jsonl(str(tmp_path / "src/d.jsonl"), docs(10), extra_lines={6: b'{"text": "cut'})
    out = str(tmp_path / "out")
    with pytest.raises(InputError) as err:
        pack(str(tmp_path / "src"), out, PackOptions(max_samples=3))
    message = str(err.value)
    assert f"{tmp_path}/src/d.jsonl line 7" in message and "d/000000007" in message
    assert "invalid JSON" in message and "--on-error skip" in message
    assert _no_manifest(out)
    assert not [p for p in os.listdir(out) if ".tmp-" in p]


def test_invalid_utf8_text_line_fails(tmp_path):
    write(str(tmp_path / "src"), "t.txt", b"fine\nbad \xff\xfe here\n")
    with pytest.raises(InputError, match=r"t\.txt line 2 \(key 't/000000002'\).*invalid UTF-8"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"))


def test_undecodable_image_fails_only_with_validate(tmp_path):
    class_folders(str(tmp_path / "src"), per_class=2)
    write(str(tmp_path / "src"), "dog/broken.png", undecodable_png())  # passes the cheap check
    pack(str(tmp_path / "src"), str(tmp_path / "plain"))  # not decoded: packed as bytes
    with pytest.raises(InputError, match=r"dog/broken\.png \(key 'dog/broken'\): field 'png'"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(validate=True))
    report = pack(
        str(tmp_path / "src"), str(tmp_path / "skip"), PackOptions(validate=True, on_error="skip")
    )
    assert report.skipped == 1 and report.samples == 6
    [skip] = _skips(tmp_path / "skip")
    assert skip["key"] == "dog/broken" and skip["file"] == "dog/broken.png"
    assert "0x" not in skip["reason"]  # no object addresses: reports are reproducible


def test_unreadable_file_fails_or_is_skipped(tmp_path, monkeypatch):
    from shardloader.storage import Store

    key_groups(str(tmp_path / "src"), n=4)
    real = Store.read_bytes

    def flaky(self):
        if self.url.endswith("b/0001.json"):
            raise StorageError(f"cannot read {self.url!r}: Input/output error")
        return real(self)

    monkeypatch.setattr(Store, "read_bytes", flaky)
    with pytest.raises(InputError, match=r"b/0001\.json \(key 'b/0001'\): unreadable"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"))
    report = pack(str(tmp_path / "src"), str(tmp_path / "skip"), PackOptions(on_error="skip"))
    assert report.skipped == 1 and report.samples == 3
    assert _skips(tmp_path / "skip")[0]["file"] == "b/0001.json"


def test_file_changed_during_pack_is_an_error(tmp_path, monkeypatch):
    from shardloader.storage import Store

    key_groups(str(tmp_path / "src"), n=2)
    real = Store.read_bytes
    monkeypatch.setattr(Store, "read_bytes", lambda self: real(self) + b"!")
    with pytest.raises(InputError, match="when the pack started"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"))


def test_skip_mode_reports_every_skip_and_keeps_the_rest(tmp_path):
    texts = docs(12)
    lines = jsonl(
        str(tmp_path / "src/a.jsonl"), texts, extra_lines={2: b"not json", 5: b'{"text": "\xff"}'}
    )
    valid = [x for x in lines if x.startswith(b'{"id"') and b"\xff" not in x]
    good = gzip.compress(b"".join(x + b"\n" for x in valid[:3]), mtime=0)
    (tmp_path / "src/b.jsonl.gz").write_bytes(good[: len(good) - 6])  # truncated stream
    report = pack(
        str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(on_error="skip", max_samples=4)
    )
    skips = _skips(tmp_path / "out")
    assert [(s["file"], s["where"]) for s in skips] == [
        ("a.jsonl", "line 3"),
        ("a.jsonl", "line 6"),
        ("b.jsonl.gz", "line 3"),
    ]
    assert "invalid JSON" in skips[0]["reason"] and "invalid UTF-8" in skips[1]["reason"]
    assert "cannot read after line 3" in skips[2]["reason"]
    manifest, samples = read_back(str(tmp_path / "out"))
    assert [f["json"] for _, f in samples] == valid + valid[:3]
    assert report.skipped == 3 and manifest.extra["skipped"] == 3
    assert manifest.extra["skip_report"] == "skipped.jsonl"


def test_corrupt_record_file_fails_by_default(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src/x.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(InputError, match=r"x\.jsonl\.gz: cannot read"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"))


def test_output_not_empty_is_refused_unless_overwrite(tmp_path):
    src, out = str(tmp_path / "src"), tmp_path / "out"
    key_groups(src, n=10)
    first = pack(src, str(out), PackOptions(max_samples=2))
    (out / "NOTES.md").write_text("mine")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        pack(src, str(out))
    second = pack(src, str(out), PackOptions(max_samples=5, overwrite=True))
    names = set(tree(str(out)))
    listed = {p for s in second.manifest.shards for p in (s.path, s.index_path)}
    assert names == listed | {"index.json", "NOTES.md"}
    assert len(first.manifest.shards) == 5 and len(second.manifest.shards) == 2


def test_bad_options_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="gzip"):
        PackOptions(format="arrow", compression="gzip")
    with pytest.raises(UsageError, match="pick one"):
        PackOptions(resume=True, overwrite=True)
    with pytest.raises(UsageError, match="part"):
        PackOptions(num_parts=2, part=2)
    key_groups(str(tmp_path / "src"), n=1)
    with pytest.raises(UsageError, match="inside the source"):
        pack(str(tmp_path / "src"), str(tmp_path / "src" / "out"))


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_lone_surrogate_in_the_text_is_a_bad_sample_not_a_crash(tmp_path, on_error):
    r"""``"\ud800"`` is valid JSON (``json.loads`` takes it) but no UTF-8 text: measuring it
    used to escape as a bare UnicodeEncodeError."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\\ud800"}\n{"text": "fine"}\n')
    out = str(tmp_path / "out")
    if on_error == "fail":
        with pytest.raises(InputError, match=r"a\.jsonl line 2 \(key 'a/000000002'\).*Unicode"):
            pack(str(src), out)
        assert _no_manifest(out)
        return
    report = pack(str(src), out, PackOptions(on_error="skip"))
    assert report.samples == 2
    assert [(s["key"], s["where"]) for s in _skips(out)] == [("a/000000002", "line 2")]

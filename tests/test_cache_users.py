"""The node cache on a host with several users: a private dataset stays private once staged,
a cache another user made (or can write to) is refused, and a link planted where the cache
keeps its lock files is never followed, by a run or by ``cache clear`` (which root may run).

Making a folder that belongs to someone else takes root (``chown``); as another user the tests
use a folder root owns instead.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import write_dataset

import shardloader as sl
from shardloader.cli import main
from shardloader.storage import cache as sc
from shardloader.storage import cachedir

NOBODY = 65534
ROOT = os.geteuid() == 0


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _read(out: Path, root: Path | None) -> int:
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(root) if root else None), readahead=0)
    ds = sl.ShardedDataset(str(out), batch_size=4, read=read)
    return len({key for b in sl.make_loader(ds) for key in b["__key__"]})  # samples read


def _someone_elses(tmp_path: Path) -> Path:
    """A folder that belongs to another user."""
    if not ROOT:
        return Path("/usr")  # root's; nothing is written there: it is refused first
    other = tmp_path / "theirs"
    other.mkdir(mode=0o755)
    os.chown(other, NOBODY, NOBODY)
    return other


def test_a_private_dataset_stays_private_in_the_cache(tmp_path: Path) -> None:
    out, root = tmp_path / "private", tmp_path / "cache"
    write_dataset(str(out), [5, 5], compression="zstd")
    os.chmod(out, 0o700)
    for name in os.listdir(out):
        os.chmod(out / name, 0o600)
    assert _read(out, root) == 10
    assert _mode(root) == 0o700
    folders = [p for p in root.iterdir() if p.is_dir()]
    assert folders and all(_mode(f) == 0o700 for f in folders)
    files = [p for f in folders for p in f.iterdir()]
    assert any(p.name.endswith(".raw") for p in files)
    assert all(_mode(p) & 0o077 == 0 for p in files), {p.name: oct(_mode(p)) for p in files}


def test_a_cache_root_of_another_user_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    write_dataset(str(out), [5], compression="zstd")
    theirs = _someone_elses(tmp_path)
    with pytest.raises(sl.StorageError) as err:
        _read(out, theirs)
    text = str(err.value)
    assert f"refusing the shard cache at {theirs}: it belongs to" in text
    assert "not to you" in text and "a local folder of your own" in text
    assert not any(p.name.endswith(".raw") for p in theirs.rglob("*"))
    r = CliRunner().invoke(main, ["cache", "clear", "--cache-dir", str(theirs)])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "belongs to" in r.output, r.output


def test_a_root_others_can_write_is_refused_unless_it_is_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "ds"
    write_dataset(str(out), [5], compression="zstd")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(sl.StorageError, match="can be written by other users"):
        _read(out, shared)
    assert _mode(shared) == 0o777  # not ours to change
    # the default root is shardloader's own: one made 0775 under a group umask is tightened
    monkeypatch.delenv("SHARDLOADER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = tmp_path / "xdg" / "shardloader"
    default.mkdir(parents=True)
    os.chmod(default, 0o775)
    older = default / "0123456789abcdef"  # a dataset folder an older version made 0755
    older.mkdir(mode=0o755)
    (older / ".shardloader-cache").write_text("marker")
    assert _read(out, None) == 5
    assert _mode(default) == 0o700
    fingerprint = sl.ShardedDataset(str(out)).manifest.fingerprint
    assert _mode(default / fingerprint) == 0o700


def test_a_planted_link_in_the_cache_is_never_followed(tmp_path: Path) -> None:
    root, victim = tmp_path / "cache", tmp_path / "victim"
    planted = root / "evil"
    planted.mkdir(parents=True)
    (planted / ".shardloader-cache").write_text("marker")
    (planted / "a.raw").write_bytes(b"x")  # staged: cache clear takes its lock, then removes it
    os.symlink(victim, planted / "a.raw.lock")
    os.symlink(victim, planted / "b.raw.lock")  # not staged: cache clear looks at its lock too
    r = CliRunner().invoke(main, ["cache", "clear", "--cache-dir", str(root)])
    assert r.exit_code == 0, r.output
    cache = sc.ShardCache(sc.CacheOptions(dir=str(root)), "evil")  # a run staging "b" there
    with pytest.raises(sl.StorageError, match="b.raw.lock is a symbolic link"):
        cache.get("b", 1, "0" * 64, "b", lambda: open(os.devnull, "rb"), lambda s, d: 0)
    assert not victim.exists()  # never created through a link


def test_a_planted_marker_link_is_never_written_through(tmp_path: Path) -> None:
    root, victim = tmp_path / "cache", tmp_path / "victim"
    (root / "fp").mkdir(parents=True)
    os.symlink(victim, root / "fp" / ".shardloader-cache")
    sc.ShardCache(sc.CacheOptions(dir=str(root)), "fp")
    assert not victim.exists()
    assert cachedir.clear(str(root)).files == 0  # a folder marked by a link is not a cache folder


@pytest.mark.skipif(not ROOT, reason="making another user's folder takes root")
def test_cache_clear_leaves_a_legacy_root_of_another_user_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the legacy root lives
    legacy = Path(cachedir.legacy_root())
    folder = legacy / "fp"
    folder.mkdir(parents=True)
    (folder / ".shardloader-cache").write_text("marker")
    (folder / "s.raw").write_bytes(b"theirs")
    for path in (legacy, folder, folder / ".shardloader-cache", folder / "s.raw"):
        os.chown(path, NOBODY, NOBODY)
    r = CliRunner().invoke(main, ["cache", "clear"])
    assert r.exit_code == 0, r.output
    assert f"left {legacy}" in r.output and "belongs to" in r.output
    assert (folder / "s.raw").read_bytes() == b"theirs"
    # the same folder of the user's own is cleared
    for path in (legacy, folder, folder / ".shardloader-cache", folder / "s.raw"):
        os.chown(path, os.geteuid(), os.getegid())
    r = CliRunner().invoke(main, ["cache", "clear"])
    assert r.exit_code == 0 and f"from {legacy}" in r.output, r.output
    assert not (folder / "s.raw").exists()


def test_cache_clear_leaves_a_legacy_root_that_is_a_link_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    target = tmp_path / "elsewhere" / "fp"
    target.mkdir(parents=True)
    (target / ".shardloader-cache").write_text("marker")
    (target / "s.raw").write_bytes(b"kept")
    os.symlink(target.parent, cachedir.legacy_root())
    r = CliRunner().invoke(main, ["cache", "clear"])
    assert r.exit_code == 0 and "is a symbolic link" in r.output, r.output
    assert (target / "s.raw").read_bytes() == b"kept"

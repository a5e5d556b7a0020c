"""The node cache: where it lives, one size limit over every dataset and run (least recently
used first), never deleting what another process is staging or what the cache did not create,
and ``shardloader cache info | clear`` (safe while a run uses the cache).

Cross-process parts run real processes: lock holders are subprocesses, and ``cache clear``
runs as the real command while a DataLoader with worker processes reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter

import pytest
from click.testing import CliRunner
from helpers import batch_ids, write_dataset

import shardloader as sl
from shardloader.cli import main
from shardloader.storage import cache as sc
from shardloader.storage import cachedir

# A process that takes the exclusive flock on argv[1], says so, and holds it until told to go
# (or, with argv[2] == "remove", removes the lock file first: what an evicting process does).
_HOLDER = r"""
import fcntl, os, sys
f = open(sys.argv[1], "a+b")
fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
if len(sys.argv) > 2 and sys.argv[2] == "remove":
    os.remove(sys.argv[1])
"""

# Exit 0 if the flock on argv[1] is free right now, 1 if another process holds it.
_TRY_LOCK = r"""
import fcntl, sys
f = open(sys.argv[1], "a+b")
try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(1)
"""


class Holder:
    """A real process holding a shard's lock, as a process staging that shard does."""

    def __init__(self, path: str, remove: bool = False) -> None:
        argv = [sys.executable, "-c", _HOLDER, path] + (["remove"] if remove else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "locked\n"

    def release(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")  # not EOF: forked DataLoader workers share the pipe
        self.proc.stdin.close()
        code = self.proc.wait(timeout=30)
        self.proc.stdout.close()
        assert code == 0


def lock_is_free(path: str) -> bool:
    return subprocess.run([sys.executable, "-c", _TRY_LOCK, path], timeout=60).returncode == 0


def dataset(path, root, max_bytes=None, shards=(30,) * 6, **kw) -> sl.ShardedDataset:
    if not os.path.exists(os.path.join(path, "index.json")):
        write_dataset(str(path), list(shards), compression="zstd")  # zstd: always staged
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(root), max_bytes=max_bytes), readahead=0)
    return sl.ShardedDataset(str(path), batch_size=4, read=read, **kw)


def epoch_ids(ds, num_workers=0) -> list[int]:
    return [i for b in sl.make_loader(ds, num_workers=num_workers) for i in batch_ids(b)]


def staged(folder) -> list[str]:
    return (
        sorted(f for f in os.listdir(folder) if f.endswith(".raw")) if os.path.isdir(folder) else []
    )


def bytes_under(root) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith(".raw")
    )


def fake_stage(cache: sc.ShardCache, name: str, data: bytes, **kw) -> str | None:
    """Stage ``data`` as shard ``name`` through the real locking path."""
    import hashlib
    import io

    return cache.get(
        name,
        len(data),
        hashlib.sha256(data).hexdigest(),
        name,
        lambda: io.BytesIO(data),
        lambda src, dst: dst.write(src.read()),
        **kw,
    )


# -- where ---------------------------------------------------------------------------------


def test_root_explicit_then_env_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("SHARDLOADER_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    home = str(tmp_path / "home" / ".cache" / "shardloader")
    assert cachedir.cache_root() == (home, "default")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the spec says absolute only
    assert cachedir.cache_root() == (home, "default")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    xdg = str(tmp_path / "xdg" / "shardloader")
    assert cachedir.cache_root() == (xdg, "$XDG_CACHE_HOME/shardloader")
    monkeypatch.setenv("SHARDLOADER_CACHE_DIR", str(tmp_path / "env"))
    assert cachedir.cache_root() == (str(tmp_path / "env"), "$SHARDLOADER_CACHE_DIR")
    assert cachedir.cache_root(str(tmp_path / "mine")) == (str(tmp_path / "mine"), "dir")


def test_a_dataset_without_options_stages_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("SHARDLOADER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    write_dataset(str(tmp_path / "ds"), [10, 10], compression="zstd")
    ds = sl.ShardedDataset(str(tmp_path / "ds"), batch_size=5)
    assert sorted(epoch_ids(ds, num_workers=1)) == list(range(20))  # the worker inherits it
    folder = tmp_path / "xdg" / "shardloader" / ds.manifest.fingerprint
    assert staged(folder) == ["shard-00000.tar.zst.raw", "shard-00001.tar.zst.raw"]
    assert (folder / ".shardloader-cache").is_file()


def test_an_unwritable_root_names_the_remedy(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("SHARDLOADER_CACHE_DIR", str(tmp_path / "file" / "cache"))
    write_dataset(str(tmp_path / "ds"), [10], compression="zstd")
    with pytest.raises(sl.StorageError, match="SHARDLOADER_CACHE_DIR"):
        epoch_ids(sl.ShardedDataset(str(tmp_path / "ds"), batch_size=5))


# -- how big ---------------------------------------------------------------------------------


def test_default_limit_and_the_environment_variable(monkeypatch, tmp_path):
    root = str(tmp_path / "root")
    limit, source = cachedir.cache_limit(root)
    assert 0 < limit <= cachedir.DEFAULT_MAX_BYTES and source.startswith("default")
    monkeypatch.setenv("SHARDLOADER_CACHE_MAX_BYTES", "3MiB")
    assert cachedir.cache_limit(root) == (3 << 20, "$SHARDLOADER_CACHE_MAX_BYTES")
    assert cachedir.cache_limit(root, explicit=5)[0] == 5  # CacheOptions(max_bytes=...) wins
    monkeypatch.setenv("SHARDLOADER_CACHE_MAX_BYTES", "lots")
    with pytest.raises(sl.UsageError, match="SHARDLOADER_CACHE_MAX_BYTES='lots'"):
        cachedir.cache_limit(root)


def test_an_explicit_limit_below_the_plan_fails_at_start(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDLOADER_CACHE_MAX_BYTES", "1000")
    message = r"cache limit 1,000 bytes is below .* raise \$SHARDLOADER_CACHE_MAX_BYTES"
    with pytest.raises(sl.UsageError, match=message):
        epoch_ids(dataset(tmp_path / "ds", tmp_path / "root"))


def test_one_limit_over_all_datasets_least_recently_used_first(tmp_path):
    root = tmp_path / "root"
    a = dataset(tmp_path / "a", root)
    shard = max(s.raw_bytes for s in a.manifest.shards)
    limit = 3 * shard  # the plan keeps 2 staged at once: room for 3
    a = dataset(tmp_path / "a", root, max_bytes=limit)
    b = dataset(tmp_path / "b", root, max_bytes=limit, shards=(32,) * 6)
    assert a.manifest.fingerprint != b.manifest.fingerprint
    assert sorted(epoch_ids(a)) == list(range(180))
    assert len(staged(root / a.manifest.fingerprint)) == 3
    assert sorted(epoch_ids(b)) == list(range(192))
    # b's shards pushed out a's, which were used longer ago; the total stayed in the limit
    assert staged(root / a.manifest.fingerprint) == []
    assert len(staged(root / b.manifest.fingerprint)) == 2
    assert bytes_under(root) <= limit


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_second_run_with_the_default_limit_shares_it(monkeypatch, tmp_path):
    """Two runs, two datasets, no options: one bound over the root, not one per dataset."""
    monkeypatch.setenv("SHARDLOADER_CACHE_DIR", str(tmp_path / "root"))
    write_dataset(str(tmp_path / "a"), [30] * 6, compression="zstd")
    write_dataset(str(tmp_path / "b"), [31] * 6, compression="zstd")
    shard = max(s.raw_bytes for s in sl.read_manifest(str(tmp_path / "a"))[0].shards)
    monkeypatch.setenv("SHARDLOADER_CACHE_MAX_BYTES", str(4 * shard))
    for name in ("a", "b"):
        code = (
            f"import shardloader as sl; ds = sl.ShardedDataset({str(tmp_path / name)!r}, "
            "batch_size=4, read=sl.ReadOptions(readahead=0)); n = sum(len(b['__index__']) "
            "for b in sl.make_loader(ds, num_workers=1)); assert n >= 180, n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert sorted(cachedir.usage(str(tmp_path / "root")), key=lambda d: d.last_used or 0)[-1].shards
    assert 0 < bytes_under(tmp_path / "root") <= 4 * shard


# -- never deleting what is not ours to delete ----------------------------------------------


@pytest.mark.subprocess
def test_eviction_skips_a_shard_another_process_is_staging(tmp_path):
    root = str(tmp_path / "root")
    cache = sc.ShardCache(sc.CacheOptions(dir=root, max_bytes=3000), "fp")
    for name in ("old", "mid"):
        fake_stage(cache, name, b"x" * 1000)
    os.utime(cache.path_for("old"), (1, 1))  # the least recently used
    os.utime(cache.path_for("mid"), (2, 2))
    holder = Holder(cache.path_for("old") + ".lock")
    try:
        fake_stage(cache, "new", b"y" * 1500)  # needs 500 bytes more: one must go
    finally:
        holder.release()
    assert os.path.exists(cache.path_for("old"))  # locked by the other process: kept
    assert not os.path.exists(cache.path_for("mid"))
    assert os.path.exists(cache.path_for("new"))


def _stage_slowly(root: str, name: str, barrier) -> None:
    """One process staging ``name`` (1,000 bytes) at the moment the others do, slowly."""
    import hashlib
    import io
    import time

    cache = sc.ShardCache(sc.CacheOptions(dir=root, max_bytes=3000), "fp")
    data = name.encode() * (1000 // len(name))

    def slow_copy(src, dst):
        time.sleep(0.3)  # still staging while the other processes make room
        return dst.write(src.read())

    barrier.wait()
    cache.get(
        name, len(data), hashlib.sha256(data).hexdigest(), name, lambda: io.BytesIO(data), slow_copy
    )


@pytest.mark.subprocess
def test_concurrent_stagers_never_overshoot_the_limit_together(tmp_path):
    import multiprocessing

    root = str(tmp_path / "root")
    cache = sc.ShardCache(sc.CacheOptions(dir=root, max_bytes=3000), "fp")
    for name in ("old1", "old2"):
        fake_stage(cache, name, b"x" * 1000)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_stage_slowly, args=(root, n, barrier)) for n in ("aa", "bb", "cc")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    # each stager claims its bytes before the next one counts them: the two old shards go
    assert staged(os.path.join(root, "fp")) == ["aa.raw", "bb.raw", "cc.raw"]
    assert bytes_under(root) <= 3000


def test_nothing_the_cache_did_not_create_is_removed(tmp_path):
    root = tmp_path / "root"
    cache = sc.ShardCache(sc.CacheOptions(dir=str(root), max_bytes=10**9), "fp")
    fake_stage(cache, "a/shard-0.tar.zst", b"z" * 100)
    mine = {
        root / "notes.txt": b"the user's",
        root / "other" / "x.raw": b"no marker: not a cache folder",
        root / "fp" / "README": b"the user's, inside a cache folder",
        root / "fp" / "x.raw.bak": b"not a name the cache writes",
    }
    for path, data in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "fp" / "shard-9.raw.tmp-dead").write_bytes(b"a killed stager's leftover")
    report = cachedir.clear(str(root))
    assert report.files == 2 and report.busy == ()
    for path, data in mine.items():
        assert path.read_bytes() == data, path
    assert sorted(os.listdir(root / "fp")) == [".shardloader-cache", "README", "x.raw.bak"]


@pytest.mark.subprocess
def test_a_waiter_on_a_removed_lock_file_locks_the_new_one(tmp_path):
    """NOTE [eviction and clearing]: whoever removes a lock file holds it; a process that was
    waiting on it must not stage under the removed file while a third process locks the new
    one."""
    cache = sc.ShardCache(sc.CacheOptions(dir=str(tmp_path / "root")), "fp")
    lock = cache.path_for("s") + ".lock"
    evictor = Holder(lock, remove=True)
    staging = threading.Event()
    proceed = threading.Event()
    result: list[object] = []

    def slow_stage(src, dst):
        staging.set()
        proceed.wait(30)
        return dst.write(src.read())

    def stage_s():
        import hashlib
        import io

        data = b"s" * 10
        result.append(
            cache.get(
                "s", 10, hashlib.sha256(data).hexdigest(), "s", lambda: io.BytesIO(data), slow_stage
            )
        )

    t = threading.Thread(target=stage_s)
    t.start()
    try:
        assert wait_until_open(lock)  # the waiter opened the lock file the evictor holds
        evictor.release()  # removes the lock file, then exits: the waiter gets the lock
        assert staging.wait(30)
        assert not lock_is_free(lock)  # the waiter holds the lock file now at that path
    finally:
        proceed.set()
        t.join(30)
    assert result == [cache.path_for("s")]


def wait_until_open(path: str, timeout: float = 30.0) -> bool:
    """Whether this process opens ``path`` within ``timeout`` (Linux: /proc/self/fd)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == path:
                    return True
            except OSError:
                pass
        time.sleep(0.01)
    return False


# -- shardloader cache info | clear ----------------------------------------------------------


def run_cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cache_info_lists_datasets_total_and_limit(tmp_path):
    root = tmp_path / "root"
    a = dataset(tmp_path / "a", root, max_bytes=10**9)
    b = dataset(tmp_path / "b", root, max_bytes=10**9, shards=(7,))
    epoch_ids(a)
    epoch_ids(b)
    r = run_cli("cache", "info", "--cache-dir", root)
    assert r.exit_code == 0, r.output
    assert f"cache root {root}  (--cache-dir)" in r.stdout
    assert "limit" in r.stdout and "total" in r.stdout and "in 2 datasets" in r.stdout
    assert f"{a.manifest.fingerprint}      6 shards" in r.stdout
    assert f"{b.manifest.fingerprint}      1 shards" in r.stdout
    j = json.loads(run_cli("cache", "info", "--cache-dir", root, "--json").stdout)
    assert j["bytes"] == bytes_under(root) > 0
    assert {d["fingerprint"]: d["shards"] for d in j["datasets"]} == {
        a.manifest.fingerprint: 6,
        b.manifest.fingerprint: 1,
    }


def test_cache_info_and_clear_use_the_environment_root(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDLOADER_CACHE_DIR", str(tmp_path / "env"))
    write_dataset(str(tmp_path / "ds"), [10], compression="zstd")
    epoch_ids(sl.ShardedDataset(str(tmp_path / "ds"), batch_size=5))
    r = run_cli("cache", "info")
    assert f"cache root {tmp_path / 'env'}  ($SHARDLOADER_CACHE_DIR)" in r.stdout
    assert "in 1 dataset\n" in r.stdout
    r = run_cli("cache", "clear")
    assert r.exit_code == 0 and "removed 1 staged shard files" in r.stdout
    assert os.listdir(tmp_path / "env") == []


def test_cache_clear_one_dataset_by_fingerprint_prefix(tmp_path):
    root = tmp_path / "root"
    a = dataset(tmp_path / "a", root, max_bytes=10**9)
    b = dataset(tmp_path / "b", root, max_bytes=10**9, shards=(7,))
    epoch_ids(a)
    epoch_ids(b)
    r = run_cli("cache", "clear", a.manifest.fingerprint[:10], "--cache-dir", root)
    assert r.exit_code == 0, r.output
    assert "removed 6 staged shard files" in r.stdout
    assert not (root / a.manifest.fingerprint).exists()
    assert staged(root / b.manifest.fingerprint) == ["shard-00000.tar.zst.raw"]
    bad = run_cli("cache", "clear", "nope", "--cache-dir", root)
    assert bad.exit_code == 2 and "matches no dataset" in bad.stderr


@pytest.mark.subprocess
def test_cache_clear_while_a_loader_reads_and_another_process_stages(tmp_path):
    root = tmp_path / "root"
    ds = dataset(tmp_path / "ds", root, max_bytes=10**9, shuffle=True, seed=3)
    folder = root / ds.manifest.fingerprint
    busy = sc.ShardCache(sc.CacheOptions(dir=str(root)), ds.manifest.fingerprint)
    fake_stage(busy, "being-staged", b"b" * 100)
    holder = Holder(busy.path_for("being-staged") + ".lock")
    try:
        loader = sl.make_loader(ds, num_workers=2)
        seen: list[int] = []
        for step, batch in enumerate(loader):
            seen += batch_ids(batch)
            if step == 10:  # mid-epoch, shards staged and open in both workers
                assert len(staged(folder)) > 1
                done = subprocess.run(
                    [
                        os.path.join(os.path.dirname(sys.executable), "shardloader"),
                        "cache",
                        "clear",
                        "--cache-dir",
                        str(root),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
                assert done.returncode == 0, done.stderr
                # left: the other process's shard, and any a worker is staging this instant
                assert "being staged by another process right now were left" in done.stdout
                assert "being-staged.raw" in staged(folder)
                assert len(staged(folder)) <= 3
        assert Counter(seen) == Counter(range(180))  # cleared shards were staged again
    finally:
        holder.release()
    assert os.path.exists(busy.path_for("being-staged"))

"""The pack orchestrator's process and storage edges: light workers, the caller's retry policy."""

from __future__ import annotations

from typing import Any

import pytest
from corpus import class_folders
from fault_proxy import FaultProxy

from shardloader.errors import StorageError
from shardloader.pack import PackOptions, pack
from shardloader.pack.pool import Pool
from shardloader.storage import RetryPolicy


def test_a_pack_worker_process_imports_only_the_writer():
    """Workers fork from a server that preloaded only the writer (pack/_preload.py): no torch,
    although this test process has imported it, and none of the storage stacks (botocore,
    aiohttp: a second of start-up) or pandas (which ``pa.array`` would pull in)."""
    import botocore.exceptions  # noqa: F401 - the parent has them all
    import torch  # noqa: F401 - a forked or spawned-from-here worker would have them too

    pool = Pool(1)
    try:
        modules = pool.submit(eval, "sorted(__import__('sys').modules)", {}).result(timeout=120)
    finally:
        pool.shutdown()
    assert "shardloader.pack.write" in modules  # a real pack worker: the writer is preloaded
    heavy = {"torch", "pandas", "botocore", "aiohttp", "s3fs", "PIL", "tokenizers"}
    assert [m for m in modules if m.split(".")[0] in heavy] == []


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_pack_uses_the_retry_policy_it_is_given(
    tmp_path, s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy
) -> None:
    class_folders(str(tmp_path / "src"), per_class=2)
    url = f"s3://{s3_bucket}/ds"
    # Every attempt at the first shard gets 503 SlowDown: the store stays down.
    fault_proxy.inject("503", method="PUT", path="/ds/shard-00000", times=None)
    policy = RetryPolicy(
        max_attempts=3,
        initial_backoff=0.01,
        max_backoff=0.02,
        max_total_seconds=20.0,
        connect_timeout=2.0,
        read_timeout=5.0,
    )
    options = PackOptions(
        max_samples=4, storage_options={"endpoint_url": fault_proxy.endpoint}, retry=policy
    )
    with pytest.raises(StorageError, match="shard-00000.*SlowDown"):
        pack(str(tmp_path / "src"), url, options)
    assert fault_proxy.count("PUT", "/ds/shard-00000") == 3  # the policy's attempts, not 6
    assert "Contents" not in s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="ds/index.json")


def test_pack_stages_take_store_handles_not_option_pairs():
    """Inside ``shardloader.pack`` storage travels as one ``Store`` (URL, options, retry): no
    function or option class takes ``storage_options`` or ``policy`` apart, except the public
    entry points that build the Store (``PackOptions``, ``merge``, ``index_shards``)."""
    import ast
    from pathlib import Path

    import shardloader.pack

    allowed = {
        ("options.py", "PackOptions"),
        ("merge.py", "merge"),
        ("index_existing.py", "index_shards"),
    }
    root = Path(shardloader.pack.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            elif isinstance(node, ast.ClassDef):
                names = [
                    s.target.id
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                ]
            else:
                continue
            bad = {"storage_options", "policy", "so"} & set(names)
            if bad and (path.name, node.name) not in allowed:
                found.append(f"{path.relative_to(root)}:{node.name} takes {sorted(bad)}")
    assert found == []


@pytest.mark.subprocess
def test_pack_workers_fork_only_from_a_process_without_torch_or_threads():
    """NOTE [worker start]: the CLI's process (no torch, one thread) forks its workers; a
    thread or torch in the process sends them to the forkserver."""
    import subprocess
    import sys

    code = (
        "import threading, time\n"
        "from shardloader.pack.startmethod import context\n"
        "print(context().get_start_method())\n"
        "t = threading.Thread(target=time.sleep, args=(0.5,)); t.start()\n"
        "print(context().get_start_method()); t.join()\n"
        "import torch\n"
        "print(context().get_start_method())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert out == ["fork", "forkserver", "forkserver"]


def test_the_ray_executor_without_ray_installed_is_a_usage_error(tmp_path, monkeypatch):
    import sys

    from shardloader.errors import UsageError

    class_folders(str(tmp_path / "src"), per_class=1)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(UsageError, match=r"pip install 'shardloader\[ray\]'"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(executor="ray"))
    assert not (tmp_path / "out" / "index.json").exists()

"""``--executor ray``: the planned shard writes run as Ray tasks on a local Ray the test starts;
the output is byte for byte a local pack's, the manifest written last by the driver."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from corpus import class_folders, docs, jsonl

from shardloader.errors import InputError, UsageError
from shardloader.pack import PackOptions, pack

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'shardloader[ray]'")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([root, *sys.path[1:]])}},
    )
    try:
        yield
    finally:
        ray.shutdown()


def _files(folder: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.parametrize("layout", ["records", "class-folders"])
def test_ray_pack_is_byte_identical_to_a_local_pack(tmp_path, local_ray, layout):
    src = str(tmp_path / "src")
    if layout == "records":
        jsonl(os.path.join(src, "a.jsonl"), docs(300))
        jsonl(os.path.join(src, "b.jsonl"), docs(200, seed=1))
    else:
        class_folders(src, per_class=12)
    local = pack(src, str(tmp_path / "local"), PackOptions(max_samples=8, workers=2))
    remote = pack(src, str(tmp_path / "ray"), PackOptions(max_samples=8, workers=3, executor="ray"))
    assert remote.shards == local.shards > 3
    assert _files(str(tmp_path / "ray")) == _files(str(tmp_path / "local"))
    assert ray.is_initialized()  # a Ray the caller started is left running


def test_a_failing_ray_task_fails_the_pack_without_a_manifest(tmp_path, local_ray):
    src = str(tmp_path / "src")
    jsonl(os.path.join(src, "a.jsonl"), docs(50), extra_lines={30: b'{"text": "cut'})
    out = str(tmp_path / "out")
    with pytest.raises(InputError, match=r"a\.jsonl line 31") as err:
        pack(src, out, PackOptions(max_samples=10, executor="ray"))
    assert type(err.value) is InputError  # the task's own error, not Ray's wrapper
    assert str(err.value).startswith(src)
    assert not os.path.exists(os.path.join(out, "index.json"))
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def test_address_without_ray_executor_is_a_usage_error():
    with pytest.raises(UsageError, match="--address"):
        PackOptions(address="ray://head:10001")

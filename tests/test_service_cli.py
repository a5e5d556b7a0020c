"""``shardloader serve`` argument checks through the CLI runner (nothing binds here)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner
from helpers import write_dataset

from shardloader.cli import main
from shardloader.errors import UsageError
from shardloader.presets import DatasetPreset
from shardloader.service.options import ServeOptions, is_loopback
from shardloader.service.pipeline import load_pipeline, read_token

TOKEN = "a-token-that-is-long-enough-123"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("cli"))
    write_dataset(d, [5, 7])
    return d


def run(*args):
    return CliRunner().invoke(main, ["serve", *args])


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "example.org"])
def test_off_loopback_needs_a_token(data, host):
    result = run(data, "--host", host)
    assert result.exit_code == 2
    assert "not a loopback address: pass --token-file" in result.output


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("localhost.evil.org", False),
        ("", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("content", ["", "short", "two words but long enough"])
def test_weak_or_missing_tokens_are_usage_errors(data, tmp_path, content):
    token = tmp_path / "token"
    token.write_text(content)
    token.chmod(0o600)
    result = run(data, "--host", "127.0.0.1", "--token-file", str(token))
    assert result.exit_code == 2 and "--token-file" in result.output
    result = run(data, "--token-file", str(tmp_path / "missing"))
    assert result.exit_code == 2 and "cannot read" in result.output


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o640, 0o620, 0o660, 0o666], ids=oct)
def test_a_token_file_others_may_read_or_change_is_refused(data, tmp_path, mode):
    """As ssh refuses a private key others can read: on a shared host they would hold the
    token that reads every batch."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(mode)
    # a --port-file nobody can write: had the token been taken, the command stops there
    result = run(data, "--token-file", str(token), "--port-file", str(tmp_path / "no" / "port"))
    assert result.exit_code == 2
    assert f"permissions {mode:04o} let other users read or change the token" in result.output
    assert f"chmod 600 {token}" in result.output


@pytest.mark.parametrize("mode", [0o600, 0o400], ids=oct)
def test_a_private_token_file_is_read(tmp_path, mode):
    token = tmp_path / "token"
    token.write_text(f"  {TOKEN}\n")
    token.chmod(mode)
    assert read_token(str(token)) == TOKEN


@pytest.mark.timeout(20)  # a blocking open of the FIFO would wait for good
def test_a_token_path_that_is_no_regular_file_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # nobody writes to it
    with pytest.raises(UsageError, match="not a regular file"):
        read_token(str(fifo))
    with pytest.raises(UsageError, match="not a regular file"):
        read_token(str(tmp_path))


def test_factory_with_dataset_options_is_a_usage_error(data):
    result = run("test_service_support:small_factory", "--batch-size", "4", "--shuffle")
    assert result.exit_code == 2
    assert "--batch-size, --shuffle configure a dataset path" in result.output


@pytest.mark.parametrize(
    ("pipeline", "message"),
    [
        ("no_such_module_xyz:make", "cannot import no_such_module_xyz"),
        ("test_service_support:nothing_here", "has no 'nothing_here'"),
        ("test_service_support:Noise", "must return a shardloader.ShardedDataset"),
        ("test_service_support:digest", "callable without arguments"),
    ],
)
def test_bad_factories_are_usage_errors(pipeline, message):
    result = run(pipeline)
    assert result.exit_code == 2 and message in result.output


def test_missing_dataset_is_an_error(tmp_path):
    result = run(str(tmp_path / "nothing"))
    assert result.exit_code in (1, 2) and "error:" in result.output


def test_path_pipeline_options_reach_the_dataset(data):
    ds = load_pipeline(
        data, DatasetPreset(batch_size=4, shuffle=True, seed=9, uneven="drop", decode="raw")
    )
    assert (ds.batch_size, ds.seed, ds.uneven, ds.shuffle.enabled) == (4, 9, "drop", True)
    assert ds.decoder.image == "raw"
    with pytest.raises(UsageError, match="image field"):
        load_pipeline(data, DatasetPreset(batch_size=4, transform="train"))
    # auto: the training transform where there are images, none here
    assert load_pipeline(data, DatasetPreset(transform="auto")).transform is None
    with pytest.raises(UsageError, match="image field 'img'"):
        load_pipeline(data, DatasetPreset(transform="auto", image_field="img"))
    with pytest.raises(UsageError, match="--image-field applies with --transform"):
        DatasetPreset(transform="none", image_field="image")
    with pytest.raises(UsageError, match="factory that configures its own dataset"):
        load_pipeline("test_service_support:small_factory", DatasetPreset())


@pytest.mark.parametrize(
    "kw",
    [
        {"workers": -1},
        {"max_inflight": 0},
        {"max_clients": 0},
        {"token": ""},
        {"ping_interval": 0},
        {"header_timeout": 0},
        {"idle_timeout": -1},
        {"write_timeout": 0},
    ],
)
def test_serve_options_are_checked(kw):
    with pytest.raises(ValueError):
        ServeOptions(**kw)


def test_transform_train_serves_the_vision_recipe_not_the_quick_tour(tmp_path):
    """README, Service mode: `serve DATASET --transform train` is byte-identical to the Vision
    recipe (raw decoder + train_transform), not to the Quick tour (decoded, then transformed)."""
    import torch
    from corpus import jpeg, write

    import shardloader as sl
    from shardloader import vision
    from shardloader.pack import PackOptions, pack

    for c in ("cat", "dog"):
        for i in range(6):  # big enough that JPEG draft decoding applies at 32 pixels
            write(str(tmp_path / "src"), f"{c}/{i}.jpg", jpeg(10 * len(c) + i, 200, 160))
    data = str(tmp_path / "packed")
    pack(str(tmp_path / "src"), data, PackOptions())
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    common = dict(batch_size=4, shuffle=True, seed=5, read=read)
    served = load_pipeline(
        data,
        DatasetPreset(
            batch_size=4,
            shuffle=True,
            seed=5,
            transform="train",
            image_size=32,
            cache_dir=str(tmp_path / "cache"),
        ),
    )
    recipe = sl.ShardedDataset(
        data,
        decoder=sl.Decoder(image="raw"),
        transform=vision.train_transform(32, field="image"),
        **common,
    )
    tour = sl.ShardedDataset(data, transform=vision.train_transform(32, field="image"), **common)

    def images(ds):
        return [b["image"] for b in sl.make_loader(ds)]

    got = images(served)
    assert len(got) == 3
    assert all(torch.equal(a, b) for a, b in zip(got, images(recipe), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(got, images(tour), strict=True))

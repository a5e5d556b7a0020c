"""The examples in tools/ run end to end for a few steps and print the data-bound share."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import corpus
import pytest

from shardloader.pack import PackOptions, pack

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
SHARE = re.compile(r"data-bound share \d+\.\d% \((data-bound|balanced|compute-bound)\)")


def run(tmp_path, *args, timeout=240):
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    corpus.mixed_class_folders(str(root / "raw"))  # every format and mode, in each class
    pack(str(root / "raw"), str(root / "packed"), PackOptions(shard_size=4000))
    return str(root / "packed")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    texts = corpus.docs(60)
    corpus.jsonl(str(root / "raw" / "docs.jsonl"), texts)
    tok = corpus.train_tokenizer(str(root / "tok.json"), texts)
    pack(str(root / "raw"), str(root / "packed"), PackOptions(tokenizer=tok, shard_size=2000))
    return str(root / "packed")


@pytest.mark.slow
@pytest.mark.subprocess
def test_train_image(images, tmp_path):
    out = run(
        tmp_path,
        os.path.join(TOOLS, "train_image.py"),
        images,
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--workers",
        "1",
        "--log-every",
        "1",
        "--size",
        "16",
    )
    assert "step 3 " in out and SHARE.search(out), out


@pytest.mark.slow
@pytest.mark.subprocess
def test_train_lm_with_sequence_packing(tokens, tmp_path):
    out = run(
        tmp_path,
        os.path.join(TOOLS, "train_lm.py"),
        tokens,
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--rows",
        "2",
        "--workers",
        "1",
        "--dim",
        "32",
        "--log-every",
        "1",
    )
    assert "step 3 " in out and "filled with real tokens" in out and SHARE.search(out), out
    assert "PackedBatches, epoch 0" in out  # tar shards: documents packed whole
    assert re.search(r"tokens \d+ delivered, 0 truncated, 0 dropped", out), out


@pytest.fixture(scope="module")
def token_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("token-shards")
    texts = corpus.docs(80)
    corpus.jsonl(str(root / "raw" / "docs.jsonl"), texts)
    tok = corpus.train_tokenizer(str(root / "tok.json"), texts)
    options = PackOptions(format="tokens", tokenizer=tok, max_samples=20)
    pack(str(root / "raw"), str(root / "packed"), options)
    return str(root / "packed")


@pytest.mark.slow
@pytest.mark.subprocess
def test_train_lm_on_token_shards_under_torchrun(token_shards, tmp_path):
    """The LM example's default on token shards (TokenBlocks) in a real 2-rank gloo group."""
    out = run(
        tmp_path,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(TOOLS, "train_lm.py"),
        token_shards,
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--rows",
        "2",
        "--workers",
        "1",
        "--dim",
        "32",
        "--log-every",
        "1",
    )
    assert "TokenBlocks, epoch 0" in out and "step 3 " in out and SHARE.search(out), out
    assert re.search(r"tokens \d+ delivered, 0 truncated, 0 dropped", out), out


@pytest.mark.slow
@pytest.mark.subprocess
def test_train_image_under_torchrun(images, tmp_path):
    out = run(
        tmp_path,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(TOOLS, "train_image.py"),
        images,
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--workers",
        "1",
        "--size",
        "16",
    )
    assert SHARE.search(out) and "(all 2 ranks)" in out, out


@pytest.mark.slow
@pytest.mark.subprocess
def test_demo(tmp_path):
    out = run(tmp_path, os.path.join(TOOLS, "demo.py"), "--per-class", "6", "--steps", "3")
    for step in ("shardloader pack", "shardloader inspect", "shardloader verify", "== 3. stream"):
        assert step in out, out
    assert SHARE.search(out) and "== done" in out, out


def test_demo_fails_loudly(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("demo", os.path.join(TOOLS, "demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    assert demo.main(["--workdir", str(tmp_path), "--per-class", "0"]) == 1  # nothing to pack
    assert "demo FAILED: shardloader pack" in capsys.readouterr().err

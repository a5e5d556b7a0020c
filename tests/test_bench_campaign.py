"""tools/bench_campaign.py and tools/bench_peers.py: the campaign's commands match what each tool
takes, its summary reads what the tools write, and the second harness runs and counts right."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import bench_campaign
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_scale_sizes_every_corpus_and_each_step_names_a_tool(tmp_path):
    full = bench_campaign.steps(str(tmp_path), 1.0, 3)
    tiny = bench_campaign.steps(str(tmp_path), 0.05, 1)
    assert full.keys() == tiny.keys()
    for name, argv in full.items():
        assert os.path.isfile(os.path.join(ROOT, argv[0])), name

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (flag(full["read"], "--images"), flag(full["read"], "--docs")) == ("20000", "200000")
    assert (flag(tiny["peers"], "--images"), flag(tiny["peers"], "--docs")) == ("1000", "10000")
    assert flag(full["tokens"], "--docs") == "200000" and flag(tiny["tokens"], "--docs") == "64000"
    assert (flag(full["s3"], "--mb"), flag(full["s3"], "--pack-mb")) == ("200", "240")
    # pack reads the corpus read-build made, so the corpus is generated once
    assert flag(full["pack"], "--corpus") == os.path.join(str(tmp_path), "read", "corpus")
    assert (
        flag(full["read-build"], "--repeat") == "0" and flag(full["peers-build"], "--repeat") == "0"
    )


@pytest.mark.slow
@pytest.mark.subprocess
def test_every_flag_the_campaign_passes_is_one_its_tool_takes(tmp_path):
    """Another change renaming a tool's flag must fail here, not 30 minutes into a campaign."""
    by_tool: dict[str, set[str]] = {}
    for argv in bench_campaign.steps(str(tmp_path), 1.0, 3).values():
        by_tool.setdefault(argv[0], set()).update(a for a in argv if a.startswith("--"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    for tool, flags in by_tool.items():
        got = subprocess.run(
            [sys.executable, tool, "--help"], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert got.returncode == 0, f"{tool} --help: {got.stderr[-2000:]}"
        missing = {f for f in flags if f not in got.stdout}
        assert not missing, f"{tool} does not take {sorted(missing)}"


def _rows(system_rates: dict[tuple[str, int, str], tuple[float, float]], cpu: str) -> dict:
    return {
        "rows": [
            {"corpus": c, "workers": w, "system": s, "samples_s": rate, cpu: us, "load": 1.0}
            for (c, w, s), (rate, us) in system_rates.items()
        ]
    }


def test_the_summary_reads_each_tools_json(tmp_path):
    rates = {
        ("images", 0, "litdata"): (1000.0, 20.0),
        ("images", 0, "shardloader"): (1500.0, 10.0),
        ("images", 0, "shardloader-arrow"): (500.0, 40.0),
    }
    (tmp_path / "read.json").write_text(json.dumps(_rows(rates, "tree_cpu_us")))
    peers = {
        (c, w, s.replace("shardloader", "shardloader-tar") if s == "shardloader" else s): v
        for (c, w, s), v in rates.items()
    }
    (tmp_path / "peers.json").write_text(json.dumps(_rows(peers, "cpu_us")))
    tokens = [
        {
            "system": s,
            "workers": w,
            "mtok_s": rate * (1 if w == 0 else 0.5),
            "tree_cpu_us_per_batch": 100.0,
        }
        for s, rate in (("litdata", 50.0), ("shardloader", 150.0), ("lean", 200.0))
        for w in (0, 2)
    ]
    (tmp_path / "tokens.json").write_text(json.dumps({"rows": tokens}))
    runners = {
        "shardloader train": {"img_s": 900.0, "cpu_ms": 2.0},
        "plain files + torchvision decode_jpeg": {"img_s": 450.0, "cpu_ms": 4.0},
        "bare ops: decode of the crop box + resize to 224, 1 process": {
            "img_s": 1e3,
            "cpu_ms": 1.6,
        },
    }
    vision = {"load": [1.0, 1.0, 1.0], "tables": [{"size": "256x256", "runners": runners}]}
    (tmp_path / "vision.json").write_text(json.dumps(vision))
    pack = {
        "rows": [
            {"workload": "images", "writer": w, "input_mb": 100.0, "mb_s": mb_s, "cpu_s": cpu}
            for w, mb_s, cpu in (("shardloader", 120.0, 1.0), ("mds", 100.0, 2.0))
        ],
        "load": {"before": [1.0, 1.0, 1.0], "after": [2.0, 1.0, 1.0]},
    }
    (tmp_path / "pack.json").write_text(json.dumps(pack))
    (tmp_path / "s3.json").write_text(json.dumps({"rows": [{"source": "S3", "mb_s": 12.5}]}))
    records = []
    for step in ("read", "s3"):
        (tmp_path / f"{step}.md").write_text(f"{step}'s own table\n")
        records.append(
            {
                "step": step,
                "command": "python x",
                "rc": 0,
                "wall_s": 60.0,
                "cpu_s": 90.0,
                "uptime_before": "up, load average: 1.0, 1.0, 1.0",
                "uptime_after": "up, load average: 2.0, 1.0, 1.0",
            }
        )
    args = type("Args", (), {"scale": 1.0, "repeat": 3, "out": "o"})()
    text = bench_campaign.summary(str(tmp_path), {"commit": "abc"}, records, args)
    lines = text.splitlines()
    read = next(x for x in lines if x.startswith("| [read] raw images, 0 workers"))
    assert "1.50 / 0.50" in read and "2.00 / 0.50" in read  # speed, and LitData's CPU over ours
    assert any(
        x.startswith("| [peers] raw images, 0 workers") and "1.50 / 0.50" in x for x in lines
    )
    one = next(x for x in lines if x.startswith("| [tokens] token rows 2048 x 8, 0 workers"))
    assert "3.00 / 4.00" in one
    assert any("2 workers" in x and "keeps 0.50" in x for x in lines if "[tokens]" in x)
    assert any(x.startswith("| [vision]") and "| 2.00 | 2.00 |" in x for x in lines)
    assert any(x.startswith("| [vision] train CPU / bare ops") and "| 1.25 |" in x for x in lines)
    assert any(x.startswith("| [pack] pack images") and "| 1.20 | 2.00 |" in x for x in lines)
    assert "| S3 | 12.5 |" in text and "read's own table" in text and "| read | 60 | 90 |" in text


def test_a_json_a_tool_did_not_write_is_named_not_fatal(tmp_path):
    args = type("Args", (), {"scale": 1.0, "repeat": 3, "out": "o"})()
    (tmp_path / "read.json").write_text("{}")
    text = bench_campaign.summary(str(tmp_path), {}, [], args)
    assert "not extracted (KeyError" in text and "see read.md" in text
    assert "not extracted (FileNotFoundError" in text and "see tokens.md" in text


@pytest.mark.slow
@pytest.mark.subprocess
def test_bench_peers_runs_every_system_and_counts_no_padding(tmp_path):
    systems = ["shardloader-arrow"]  # one format: each pack and run is a process of its own
    if importlib.util.find_spec("litdata") is not None:
        systems.append("litdata")
    out = tmp_path / "peers.json"
    argv = [sys.executable, "tools/bench_peers.py", "--work", str(tmp_path / "w"), "--images", "70"]
    argv += [
        "--docs",
        "333",
        "--repeat",
        "1",
        "--workers",
        "0",
        "--batch",
        "32",
        "--json",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, SHARDLOADER_CACHE_DIR=str(tmp_path / "cache"))
    got = subprocess.run(
        [*argv, "--systems", ",".join(systems)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["tool"] == "tools/bench_peers.py"
    assert {(r["corpus"], r["system"]) for r in data["rows"]} == {
        (c, s) for c in ("images", "docs") for s in systems
    }
    for run in data["runs"]:
        # 70 and 333 are no multiples of 32: shardloader fills its last batch up with repeats
        assert run["samples"] == (70 if run["corpus"] == "images" else 333), run
        assert run["samples_s"] > 0 and run["cpu_us"] > 0
    assert "| images | 0 | shardloader-arrow |" in got.stdout

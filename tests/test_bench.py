"""bench: the knee and the recommendation on made-up curves; the command on a small dataset."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner
from helpers import write_dataset
from hypothesis import example, given
from hypothesis import strategies as st
from PIL import Image

from shardloader import bench
from shardloader.bench import BenchResult, knee, recommend
from shardloader.cli import main
from shardloader.errors import UsageError

WORKERS = (0, 1, 2, 4, 8)


def point(w, samples_per_s, *, decode=True, prefetch=2, memory=100.0):
    """A measurement that took 1 s, so samples == samples/s."""
    return BenchResult(
        num_workers=w,
        prefetch_factor=prefetch if w else None,
        decode=decode,
        batches=max(1, int(samples_per_s) // 10),
        samples=int(samples_per_s),
        seconds=1.0,
        first_batch_s=0.1,
        mb=samples_per_s / 100,
        peak_rss_mb=memory * 2,
        pss_mb=memory,
    )


def curve(ys, workers=WORKERS, **kw):
    return [point(w, y, **kw) for w, y in zip(workers, ys, strict=True)]


# -- the knee (pure) ------------------------------------------------------------------------


def test_knee_is_the_first_point_within_tolerance_of_the_best():
    assert knee([100, 190, 350, 600, 610]) == 3
    assert knee([100, 190, 350, 600, 610], tolerance=0.0) == 4
    assert knee([100, 200, 300, 400, 500]) == 4  # still rising: the last point
    assert knee([500, 300, 200]) == 0
    with pytest.raises(UsageError):
        knee([])
    with pytest.raises(UsageError):
        knee([1.0], tolerance=1.5)


@given(st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=12), st.floats(0.0, 0.5))
def test_knee_properties(ys, tol):
    k = knee(ys, tol)
    assert ys[k] >= (1 - tol) * max(ys)  # as fast as the best, within tolerance
    assert all(y < (1 - tol) * max(ys) for y in ys[:k])  # and nothing earlier is


# -- recommend (pure, synthetic curves) -----------------------------------------------------


def test_plateau_after_four_recommends_four():
    rec = recommend(curve([100, 190, 350, 600, 610]))
    assert (rec.num_workers, rec.prefetch_factor) == (4, 2)
    assert "stop helping after 4" in rec.reason
    assert "recommended: num_workers=4, prefetch_factor=2" in rec.line()


def test_monotonic_rise_recommends_the_most_workers():
    rec = recommend(curve([100, 200, 300, 400, 500]))
    assert rec.num_workers == 8 and "still rises at 8" in rec.reason
    assert "sweep higher" in rec.reason
    rec = recommend(curve([100, 200, 300, 400, 500]), cpu_count=8)
    assert rec.num_workers == 8 and "CPU bound" in rec.reason


def test_zero_workers_fastest():
    rec = recommend(curve([500, 300, 250, 200, 150]))
    assert (rec.num_workers, rec.prefetch_factor) == (0, None)
    assert "do not help" in rec.reason


def test_falling_after_the_peak_is_reported():
    rec = recommend(curve([100, 400, 300, 200, 150]))
    assert rec.num_workers == 1 and "stop helping after 1" in rec.reason
    assert "slower" in rec.reason


def test_plateau_at_the_core_count_is_cpu_bound():
    rec = recommend(curve([100, 190, 350, 600, 610]), cpu_count=4)
    assert rec.num_workers == 4 and "CPU bound: 4 workers use all 4 cores" in rec.reason


def test_raw_vs_decoded_tells_reading_from_decoding():
    decoded = curve([100, 150, 200, 205, 200])
    fast_raw = curve([300, 550, 700, 720, 720], decode=False)
    rec = recommend(decoded + fast_raw)
    assert rec.decode is True and rec.num_workers == 2  # read off the decoded curve
    assert "decode/transform bound" in rec.reason and "3.5x" in rec.reason
    same_raw = curve([105, 160, 210, 210, 205], decode=False)
    rec = recommend(decoded + same_raw)
    assert rec.num_workers == 2 and "read bound" in rec.reason
    only_raw = recommend(fast_raw)
    assert only_raw.decode is False and only_raw.num_workers == 2


def test_prefetch_is_the_smallest_that_is_as_fast():
    base = curve([100, 190, 350, 600, 610])
    close = base + [point(4, 640, prefetch=4), point(8, 650, prefetch=4)]
    assert recommend(close).prefetch_factor == 2  # +7 %: not worth more memory
    far = base + [point(4, 900, prefetch=4), point(8, 905, prefetch=4)]
    rec = recommend(far)
    assert (rec.num_workers, rec.prefetch_factor) == (4, 4)


def test_memory_limit_caps_the_workers():
    results = [
        point(w, y, memory=m)
        for w, y, m in zip(
            WORKERS, [100, 190, 350, 600, 610], [500, 900, 1500, 4000, 7000], strict=True
        )
    ]
    rec = recommend(results, memory_limit_mb=2000)
    assert rec.num_workers == 2 and rec.knee == 4 and "capped at 2 workers" in rec.reason
    assert bench.format_table(results, rec).count("<- recommended (memory)") == 1
    assert recommend(results, memory_limit_mb=10_000).num_workers == 4


def test_single_point_and_empty():
    assert "only num_workers=2" in recommend([point(2, 100)]).reason
    with pytest.raises(UsageError):
        recommend([])


@given(st.lists(st.floats(1.0, 1e5), min_size=5, max_size=5))
@example([1.0, 1.0, 1.0, 1.0, 1.5])  # found in CI: 1.5 samples/s is measured as 1
def test_recommendation_follows_any_curve(ys):
    points = curve(ys)
    rec = recommend(points)
    # the knee of the curve as measured: samples are whole numbers, so 1.5/s reads as 1/s
    assert rec.num_workers == WORKERS[knee([p.samples_per_s for p in points])]
    assert rec.samples_per_s >= 0.9 * max(ys) - 1  # samples are whole numbers


def test_default_workers():
    assert bench.default_workers(8) == (0, 1, 2, 4, 8)
    assert bench.default_workers(6) == (0, 1, 2, 4, 6)
    assert bench.default_workers(1) == (0, 1)


def test_table_marks_the_knee():
    results = curve([100, 190, 350, 600, 610])
    text = bench.format_table(results, recommend(results))
    marked = [line for line in text.splitlines() if line.endswith("<- knee")]
    assert len(marked) == 1 and marked[0].split()[:3] == ["yes", "4", "2"]
    assert text.splitlines()[-1].startswith("recommended: num_workers=4")


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError, match=r"pip install 'shardloader\[plot\]'"):
        bench.plot(curve([1, 2, 3, 4, 5]), None, str(tmp_path / "x.png"))


# -- the command on a real small dataset ----------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    write_dataset(str(d / "ds"), [40, 40], compression="zstd")
    return d


def invoke(small, *args):
    base = [
        "bench",
        str(small / "ds"),
        "--workers",
        "0,1",
        "--prefetch",
        "2",
        "--batches",
        "3",
        "--batch-size",
        "4",
        "--cache-dir",
        str(small / "cache"),
    ]
    return CliRunner().invoke(main, [*base, *args])


@pytest.mark.slow
def test_bench_prints_a_table_and_draws_a_png(small):
    png = small / "sweep.png"
    result = invoke(small, "--plot", str(png))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "samples/s" in out and "peak MB" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["yes"], ["no"])]
    assert sorted((r[0], r[1]) for r in rows) == [
        ("no", "0"),
        ("no", "1"),
        ("yes", "0"),
        ("yes", "1"),
    ]
    assert sum(line.endswith("<- knee") for line in out.splitlines()) == 1
    assert out.strip().splitlines()[-1].startswith("recommended: num_workers=")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100


def test_bench_json_one_mode(small):
    result = invoke(small, "--no-decode", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert {r["decode"] for r in doc["results"]} == {False}
    assert [r["num_workers"] for r in doc["results"]] == [0, 1]
    for r in doc["results"]:
        assert r["batches"] == 3 and r["samples"] == 12 and r["samples_per_s"] > 0
        assert r["mb_per_s"] > 0 and r["first_batch_s"] > 0 and r["peak_rss_mb"] > 0
    assert doc["recommendation"]["num_workers"] in (0, 1)


@pytest.mark.parametrize("args", [["--workers", "0,x"], ["--prefetch", "0"], ["--plot", "out.txt"]])
def test_bench_usage_errors_exit_2(small, args):
    result = invoke(small, *args)
    assert result.exit_code == 2 and "error:" in result.output


def test_bench_images_with_the_training_transform(tmp_path):
    import corpus

    from shardloader.pack import pack

    corpus.class_folders(str(tmp_path / "raw"), per_class=4)
    pack(str(tmp_path / "raw"), str(tmp_path / "packed"))
    result = CliRunner().invoke(
        main,
        [
            "bench",
            str(tmp_path / "packed"),
            "--workers",
            "0",
            "--decode",
            "--batches",
            "2",
            "--batch-size",
            "4",
            "--image-size",
            "16",
            "--json",
            "--cache-dir",
            str(tmp_path / "c"),
        ],
    )
    assert result.exit_code == 0, result.output
    (point,) = json.loads(result.stdout)["results"]
    assert point["decode"] is True and point["samples"] == 8


def test_bench_transform_needs_an_image_field(small):
    result = invoke(small, "--transform", "train")
    assert result.exit_code == 2 and "no image field" in result.output


def test_bench_without_psutil_says_what_to_install(small, monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)
    result = invoke(small)
    assert result.exit_code == 2 and "pip install psutil" in result.output

"""monitor(): data wait vs step, the article's reading, reports, and the disabled path."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest
from helpers import torchrun, write_dataset
from hypothesis import given
from hypothesis import strategies as st

import shardloader as sl
import shardloader.monitoring as mon


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class SlowLoader:
    """Yields ``len(waits)`` batches; producing batch i advances the clock by ``waits[i]``."""

    def __init__(self, clock: FakeClock, waits: list[float]) -> None:
        self.clock, self.waits = clock, waits

    def __len__(self) -> int:
        return len(self.waits)

    def __iter__(self):
        for i, w in enumerate(self.waits):
            self.clock.now += w
            yield i


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(mon, "_clock", c)
    return c


def run(m, clock, step):
    out = []
    for batch in m:
        out.append(batch)
        clock.now += step
    return out


def test_wait_and_step_are_separated(clock):
    m = mon.monitor(SlowLoader(clock, [5.0, 1.0, 1.0, 1.0]), interval=0)
    assert run(m, clock, 3.0) == [0, 1, 2, 3]
    s = m.stats()
    assert s.batches == 4 and s.timed_batches == 3
    assert s.first_batch_s == 5.0  # start-up, kept out of the shares
    assert s.data_wait_s == 3.0 and s.step_s == 12.0
    assert s.data_share == 0.2 and s.step_share == 0.8
    assert s.verdict == "balanced"  # exactly 20 % is not "above 20 %"


@pytest.mark.parametrize(
    "wait, step, expected",
    [
        (1.0, 1.0, "data-bound"),
        (21.0, 79.0, "data-bound"),
        (1.0, 9.0, "balanced"),
        (1.0, 19.0, "balanced"),
        (1.0, 24.0, "compute-bound"),
        (0.0, 1.0, "compute-bound"),
    ],
)
def test_the_articles_reading(clock, wait, step, expected):
    m = mon.monitor(SlowLoader(clock, [0.0, wait]), interval=0)
    run(m, clock, step / 2)  # two steps, one timed wait
    assert m.stats().verdict == expected
    assert mon.verdict(wait / (wait + step)) == expected


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=2, max_size=2))
def test_shares_add_up_exactly(pair):
    s = mon.MonitorStats(5, 4, pair[0], pair[1], 0.1)
    assert s.data_share + s.step_share == 1.0
    assert 0.0 <= s.data_share <= 1.0


def test_totals_accumulate_over_passes(clock):
    m = mon.monitor(SlowLoader(clock, [2.0, 1.0]), interval=0)
    run(m, clock, 1.0)
    run(m, clock, 1.0)  # second epoch: its first wait is steady-state data time
    s = m.stats()
    assert (s.batches, s.timed_batches, s.first_batch_s) == (4, 3, 2.0)
    assert s.data_wait_s == 4.0 and s.step_s == 4.0 and s.data_share == 0.5


def test_periodic_reports_to_stderr_and_callback(clock, capsys):
    got = []
    m = mon.monitor(SlowLoader(clock, [1.0] * 3 + [3.0] * 4), interval=3, callback=got.append)
    run(m, clock, 1.0)
    assert len(got) == 3  # after batches 3 and 6, and when the pass ends (batch 7)
    first, second, last = got
    assert last["batches"] == 1 and last["total"]["batches"] == 7
    # reported on handing out batch 3: waits of batches 2-3, steps of batches 1-2
    assert first["batches"] == 3 and first["data_share"] == 0.5
    assert second["batches"] == 3 and second["data_share"] == 0.75  # waits 3+3+3, steps 3
    assert second["verdict"] == "data-bound" and second["first_batch_s"] is None
    assert second["total"]["batches"] == 6
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        "shardloader.monitor: batch 3: waiting for data 50.0% (1000.0 ms/batch), 0.5 batches/s, "
        "data-bound, first batch 1.00s",
        "shardloader.monitor: batch 6: waiting for data 75.0% (3000.0 ms/batch), 0.2 batches/s, "
        "data-bound",
        "shardloader.monitor: batch 7: waiting for data 60.0% (3000.0 ms/batch), 0.2 batches/s, "
        "data-bound",
    ]


def test_an_epoch_shorter_than_the_interval_still_reports(clock, capsys):
    """The README's example: 4 batches an epoch, interval 5: a line at the end of each."""
    m = mon.monitor(SlowLoader(clock, [1.0] * 4), interval=5)
    run(m, clock, 1.0)
    assert [line.split(":")[1] for line in capsys.readouterr().err.splitlines()] == [" batch 4"]


def test_report_to_the_log_a_logger_a_stream_or_nowhere(clock, caplog, capsys):
    with caplog.at_level(logging.INFO):
        run(mon.monitor(SlowLoader(clock, [1.0] * 4), interval=2, report="log"), clock, 1.0)
        mine = logging.getLogger("my.training")
        run(mon.monitor(SlowLoader(clock, [1.0] * 4), interval=2, report=mine), clock, 1.0)
        run(mon.monitor(SlowLoader(clock, [1.0] * 4), interval=2, logger=mine), clock, 1.0)
    assert [r.name for r in caplog.records] == ["shardloader.monitoring"] * 2 + ["my.training"] * 4
    assert all("waiting for data 50.0%" in r.getMessage() for r in caplog.records)
    stream = io.StringIO()
    run(mon.monitor(SlowLoader(clock, [1.0] * 4), interval=2, report=stream), clock, 1.0)
    assert stream.getvalue().count("shardloader.monitor: batch") == 2
    got = []
    run(
        mon.monitor(SlowLoader(clock, [1.0] * 4), interval=2, report=None, callback=got.append),
        clock,
        1.0,
    )
    assert len(got) == 2  # the callback still runs with the line off
    assert capsys.readouterr().err == ""


def test_bad_report_target():
    with pytest.raises(sl.UsageError, match="report must be"):
        mon.monitor([], report="stdout")  # type: ignore[arg-type]


_DEFAULT_LOGGING = """
import shardloader
loader = range(447)
for batch in shardloader.monitor(loader):  # README: nothing configured, interval 100
    pass
"""


@pytest.mark.subprocess
def test_visible_without_configuring_logging():
    """A fresh process with Python's default logging: one line per 100 batches on stderr."""
    done = subprocess.run(
        [sys.executable, "-c", _DEFAULT_LOGGING],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = done.stderr.splitlines()
    assert [line.split(":")[1] for line in lines] == [
        " batch 100",
        " batch 200",
        " batch 300",
        " batch 400",
        " batch 447",  # the end of the pass
    ]
    assert all(line.startswith("shardloader.monitor: ") for line in lines)
    assert done.stdout == ""


_RANKS = """
import sys
import torch.distributed as dist
import shardloader

dist.init_process_group("gloo")
for batch in shardloader.monitor(range(6), interval=5):
    pass
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_each_rank_says_which_it_is(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_RANKS)
    done = torchrun(str(tmp_path), str(script), 2)
    lines = sorted(line for line in done.stderr.splitlines() if "shardloader.monitor" in line)
    assert [line.split(":")[0] for line in lines] == [  # batch 5, and the end of the pass
        "shardloader.monitor [rank 0/2]",
        "shardloader.monitor [rank 0/2]",
        "shardloader.monitor [rank 1/2]",
        "shardloader.monitor [rank 1/2]",
    ]


def test_disabled_returns_the_loaders_own_iterator():
    data = [1, 2, 3]
    it = mon.monitor(data, enabled=False)
    assert type(it) is type(iter(data))
    assert list(it) == data


def test_empty_loader_and_early_break(clock):
    m = mon.monitor(SlowLoader(clock, []), interval=0)
    assert run(m, clock, 1.0) == []
    assert m.stats().verdict == "no data yet" and m.stats().data_share == 0.0
    m = mon.monitor(SlowLoader(clock, [1.0] * 10), interval=0)
    for i, _ in enumerate(m):
        clock.now += 1.0
        if i == 2:
            break
    s = m.stats()
    assert (s.batches, s.timed_batches, s.data_wait_s, s.step_s) == (3, 2, 2.0, 2.0)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_interval(bad):
    with pytest.raises(sl.UsageError):
        mon.monitor([], interval=bad)


def test_over_a_real_loader(tmp_path):
    write_dataset(str(tmp_path), [20, 20], compression="zstd")
    ds = sl.ShardedDataset(
        str(tmp_path),
        batch_size=4,
        read=sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "c"))),
    )
    m = mon.monitor(sl.make_loader(ds, num_workers=1), interval=0)
    assert len(m) == 10
    assert sum(len(b["__index__"]) for b in m) == 40
    s = m.stats()
    d = s.as_dict()
    assert s.batches == 10 and d["data_share"] + d["step_share"] == 1.0
    assert d["first_batch_s"] > 0 and d["data_wait_s"] >= 0 and d["step_s"] >= 0
    assert "data-bound share" in s.summary()


def test_all_ranks_is_identity_outside_distributed():
    stats = mon.MonitorStats(5, 4, 0.2, 0.6, 0.1)
    assert mon.all_ranks(stats) is stats

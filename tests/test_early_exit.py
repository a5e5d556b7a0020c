"""A script that leaves a shuffled pass early and exits says nothing: what the pass opened is
closed before the interpreter tears its modules down (NOTE [closing a pass left early] in
shardloader/read/openpasses.py), not by a ``finally`` that finds ``queue`` gone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import write_dataset

SCRIPT = textwrap.dedent(
    """
    import sys
    import shardloader as sl

    path, cache, how = sys.argv[1:]
    ds = sl.ShardedDataset(
        path, batch_size=4, shuffle=True, seed=1,
        read=sl.ReadOptions(cache=sl.CacheOptions(dir=cache)),
    )
    if how == "loader":  # the iterator kept in a global, dropped only at exit
        it = iter(sl.make_loader(ds, num_workers=0))
        batch = next(it)
    else:
        it = iter(ds)
        batch = next(it)
    print(len(batch["__key__"]))
    """
)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["loader", "dataset"])
def test_a_script_that_leaves_a_shuffled_pass_early_exits_quietly(tmp_path, how):
    data = str(tmp_path / "ds")
    write_dataset(data, [40] * 6, compression="zstd")  # staged: read-ahead threads run
    script = tmp_path / "early.py"
    script.write_text(SCRIPT)
    cache = str(tmp_path / "cache")
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    for run in ("cold", "warm"):  # the warm node cache is where it showed
        done = subprocess.run(
            [sys.executable, str(script), data, cache, how],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert (done.returncode, done.stderr, done.stdout) == (0, "", "4\n"), run

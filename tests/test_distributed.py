"""A real multi-process torch.distributed run (gloo on CPU, started with torchrun)."""

from __future__ import annotations

import json

import pytest
from helpers import torchrun, write_dataset


@pytest.mark.slow
@pytest.mark.subprocess
def test_ranks_disjoint_complete_equal(tmp_path):
    data = str(tmp_path / "ds")
    write_dataset(data, [13, 2, 40, 7], compression="zstd")  # 62 samples
    out = str(tmp_path / "seen.json")
    torchrun(str(tmp_path), "dist_job.py", 3, data, out, "2")
    with open(out) as f:
        ranks = sorted(json.load(f), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for epoch in ("0", "1"):
        lengths = {len(r["seen"][epoch]["ids"]) for r in ranks}
        assert len(lengths) == 1  # equal steps on every rank
        assert lengths == {r["seen"][epoch]["len"] for r in ranks}  # len(loader) told the truth
        real = [
            i
            for r in ranks
            for b, p in zip(r["seen"][epoch]["ids"], r["seen"][epoch]["pads"], strict=False)
            for i, pad in zip(b, p, strict=False)
            if not pad
        ]
        assert sorted(real) == list(range(62))  # disjoint and complete
        total = sum(len(b) for r in ranks for b in r["seen"][epoch]["ids"])
        assert total - 62 == ranks[0]["padded"]  # padding is exactly what the report says
    order0 = [r["seen"]["0"]["ids"] for r in ranks]
    order1 = [r["seen"]["1"]["ids"] for r in ranks]
    assert order0 != order1  # each epoch reshuffles

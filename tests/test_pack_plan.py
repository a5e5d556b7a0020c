"""Shard planning is a pure function of the stream; tar header sizes are exact."""

from __future__ import annotations

import tarfile

from hypothesis import given, settings
from hypothesis import strategies as st

from shardloader.format.registry import get_format
from shardloader.format.tar.writer import _member_header, header_size
from shardloader.pack.plan import Planner, part_of, shard_names
from shardloader.pack.refs import InputFile, SampleRef


def _tarfile_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = size, 0, 0o644, 0, 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


@settings(max_examples=300, deadline=None)
@given(
    name=st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
        min_size=1,
        max_size=140,
    ),
    size=st.one_of(st.integers(0, 4096), st.integers(0, 8**11 + 10)),
)
def test_member_headers_are_tarfiles_bytes_and_planned_sizes_exact(name, size):
    expected = _tarfile_header(name, size)
    assert _member_header(name, size) == expected  # fast ustar path included
    assert header_size(name, size) == len(expected)


def _raw_size(sample: SampleRef) -> int:
    """Uncompressed bytes the sample adds to a tar shard."""
    sizes = [(ext, ref.size) for ext, ref in sample.fields]
    return get_format("tar").sample_raw_size(sample.key, sizes)


def _samples(sizes: list[int]) -> list[SampleRef]:
    return [
        SampleRef(f"k/{i:04d}", (("bin", InputFile(f"{i}", f"/x/{i}", s)),))
        for i, s in enumerate(sizes)
    ]


@given(
    sizes=st.lists(st.integers(0, 5000), max_size=40),
    limit=st.integers(0, 20000),
    max_samples=st.one_of(st.none(), st.integers(1, 7)),
)
def test_planner_cuts_by_size_and_count(sizes, limit, max_samples):
    samples = _samples(sizes)
    plans = list(Planner("tar", limit, max_samples).shards(samples))
    assert [s for p in plans for s in p.samples] == samples
    assert [p.number for p in plans] == list(range(len(plans)))
    for p, nxt in zip(plans, [*plans[1:], None], strict=False):
        assert p.raw_bytes == 1024 + sum(_raw_size(s) for s in p.samples)
        if max_samples is not None:
            assert len(p.samples) <= max_samples
        if limit and len(p.samples) > 1:
            assert p.raw_bytes <= limit
        if nxt is not None and limit and (max_samples is None or len(p.samples) < max_samples):
            assert p.raw_bytes + _raw_size(nxt.samples[0]) > limit  # it was full


def test_parts_and_names():
    assert [part_of(n, 3) for n in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert shard_names(7, "tar", "zstd") == ("shard-00007.tar.zst", "shard-00007.idx.arrow")
    assert shard_names(7, "arrow", "zstd", part=2, local_number=3) == (
        "part-0002-shard-00003.arrow",
        "part-0002-shard-00003.idx.arrow",
    )
    assert shard_names(123456, "tar", "none")[0] == "shard-123456.tar"

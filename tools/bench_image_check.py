#!/usr/bin/env python
"""What the cheap image check costs ``pack``: the same pack with and without it.

    python tools/bench_image_check.py [--images 2000] [--repeat 5] [--corpus DIR] [--mixed]

Packs ``--images`` real-size generated JPEGs (tools/make_corpus.py, 160-640 px, ~30-100 KB;
``--mixed``: the mixed-format folder) into zstd tar shards with ``--workers 1`` (in this
process, so the check can be switched off by replacing ``shardloader.codecs.allowlist.check_image``
with a no-op), alternating runs with and without the check (the order flips each round), from
a warm page cache.  Reports the median pack time of each, the check's share of pack time, and
the check alone (header parse + end marker) per image.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def corpus(path: str, images: int, mixed: bool) -> str:
    from make_corpus import make_corpus

    meta = os.path.join(path, "corpus.json")
    if os.path.exists(meta):
        with open(meta) as f:
            params = json.load(f)
        if (params.get("images"), params.get("mixed")) == (images, mixed):
            return os.path.join(path, "images")
        shutil.rmtree(path)
    print(f"generating {images} images in {path} ...", file=sys.stderr)
    make_corpus(path, images=images, classes=10, docs=0, mixed=mixed)
    return os.path.join(path, "images")


def read_all(root: str) -> list[bytes]:
    out = []
    for d, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            with open(os.path.join(d, name), "rb") as f:
                out.append(f.read())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5, help="runs with and without, interleaved")
    p.add_argument("--corpus", default=None, help="default: a temporary folder")
    p.add_argument("--mixed", action="store_true", help="the mixed-format corpus, not JPEGs")
    args = p.parse_args(argv)

    from shardloader import codecs
    from shardloader.pack import PackOptions, pack

    work = tempfile.mkdtemp(prefix="bench-image-check-")
    try:
        src = corpus(args.corpus or os.path.join(work, "corpus"), args.images, args.mixed)
        data = read_all(src)  # warms the page cache too
        real = codecs.check_image
        started = time.perf_counter()
        for blob in data:
            real(blob)
        check_s = time.perf_counter() - started

        cpu: dict[bool, list[float]] = {True: [], False: []}

        def run(checked: bool) -> float:
            codecs.check_image = real if checked else (lambda data: None)  # type: ignore[assignment]
            out = os.path.join(work, "out")
            t, c = time.perf_counter(), time.process_time()  # workers=1: all in this process
            pack(src, out, PackOptions(workers=1, overwrite=True))
            seconds = time.perf_counter() - t
            cpu[checked].append(time.process_time() - c)
            shutil.rmtree(out)
            return seconds

        run(True)  # warm-up: imports, plugin registry, page cache
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.repeat):
            for checked in (True, False) if r % 2 == 0 else (False, True):
                times[checked].append(run(checked))
        codecs.check_image = real
    finally:
        shutil.rmtree(work, ignore_errors=True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    mb = sum(len(b) for b in data) / 1e6
    print(f"{len(data)} images, {mb:.1f} MB, {args.repeat} interleaved runs each, median:")
    con, coff = statistics.median(cpu[True]), statistics.median(cpu[False])
    print(
        f"  pack with the check     {on:7.3f} s   ({mb / on:6.1f} MB/s; CPU {con / mb * 1e3:.1f} "
        "ms per MB)"
    )
    print(
        f"  pack without the check  {off:7.3f} s   ({mb / off:6.1f} MB/s; CPU "
        f"{coff / mb * 1e3:.1f} ms per MB)"
    )
    print(f"  the check's share       {(on - off) / on * 100:+6.1f} % of pack time")
    print(
        f"  the check alone         {check_s / len(data) * 1e6:7.1f} us per image "
        f"({check_s / on * 100:.1f} % of the pack time with it)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

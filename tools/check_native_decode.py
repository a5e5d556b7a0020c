"""Do the native JPEG decoder and PIL give the same pixels on *your* JPEGs?  And how much CPU
does each spend?

    python tools/check_native_decode.py DIR [DIR ...] [--limit N]

Walks the folders for ``*.jpg``/``*.jpeg``, decodes each whole image with the native decoder
(``shardloader.codecs.jpeg``, what ``Decoder()`` uses for JPEGs) and with PIL (converted to RGB
as ``Decoder`` converts), and prints, per file that differs, the largest difference; then how
many files matched, differed, or were left to PIL (CMYK, 12-bit, files libjpeg warns about),
and the CPU ms per image of each path.  Exit status 1 if any file differs.  The JPEGs of
``tools/make_corpus.py`` and the tests were written by PIL: run this over images other encoders
wrote (cameras, phones, other libraries), e.g. a sample of your dataset.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardloader.codecs.imagemode import convert  # noqa: E402
from shardloader.vision import jpeg  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--limit", type=int, default=0, help="at most this many files (0: all)")
    args = ap.parse_args()
    if jpeg.native_reason() is not None:
        raise SystemExit(f"the native decoder is not built here: {jpeg.native_reason()}")
    files = sorted(
        os.path.join(d, f)
        for folder in args.folders
        for d, _, names in os.walk(folder)
        for f in names
        if f.lower().endswith((".jpg", ".jpeg"))
    )
    if args.limit:
        files = files[: args.limit]
    same = differ = declined = 0
    native_cpu = pil_cpu = 0.0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        t0 = time.process_time()
        size = jpeg.probe(data)
        native = None if size is None else jpeg.decode_box(data, size, None, None)
        t1 = time.process_time()
        try:
            want = np.asarray(convert(Image.open(io.BytesIO(data)), "RGB"))
        except (OSError, ValueError) as err:
            print(f"{path}: PIL cannot decode it ({err})")
            continue
        t2 = time.process_time()
        if native is None:
            declined += 1
            continue
        native_cpu, pil_cpu = native_cpu + t1 - t0, pil_cpu + t2 - t1
        if native.shape == want.shape and np.array_equal(native, want):
            same += 1
        else:
            differ += 1
            most = np.abs(native.astype(int) - want).max() if native.shape == want.shape else "-"
            print(f"{path}: differs (shapes {native.shape} / {want.shape}, max difference {most})")
    decoded = max(same + differ, 1)
    print(
        f"{len(files)} JPEGs: {same} identical, {differ} differ, {declined} left to PIL; CPU per "
        f"image: native {native_cpu / decoded * 1e3:.2f} ms, PIL {pil_cpu / decoded * 1e3:.2f} ms "
        f"(load {os.getloadavg()[0]:.1f})"
    )
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()

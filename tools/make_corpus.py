#!/usr/bin/env python
"""Generate a deterministic raw corpus for packing benchmarks and manual tests.

    python tools/make_corpus.py OUT [--images 20000] [--classes 100] [--docs 200000]
                                    [--doc-files 8] [--parquet-rows 0] [--seed 0] [--jobs N]
                                    [--jpeg-only]

Writes
  OUT/images/<class>/<i>.<ext> real images (PIL) of varied sizes from smooth random content plus
                               noise, so they compress like photos (i.e. hardly at all), mixed
                               as real folders are: per 10 images, 6 RGB .jpg, 1 RGB .jpeg,
                               1 grey or CMYK .jpg, 2 .png (RGB, RGBA, palette with a
                               transparent colour, 16-bit grey, in turn); --jpeg-only: all RGB
                               .jpg (the corpus of the packing benchmarks);
  OUT/docs/part-NNNNN.jsonl    {"id", "text"} documents of lognormal length, Zipf-distributed
                               pseudo-words (compresses roughly like natural text);
  OUT/table/part-00000.parquet (with --parquet-rows) columns id, text, label;
  OUT/corpus.json              the parameters, so a benchmark can reuse a matching corpus.
Everything derives from --seed: the same flags give the same bytes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np

_LETTERS = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
_LETTER_P = np.array(
    [
        12.7,
        9.1,
        8.2,
        7.5,
        7.0,
        6.7,
        6.3,
        6.1,
        6.0,
        4.3,
        4.0,
        2.8,
        2.8,
        2.4,
        2.4,
        2.2,
        2.0,
        2.0,
        1.9,
        1.5,
        1.0,
        0.8,
        0.2,
        0.2,
        0.1,
        0.1,
    ]
)


def image_bytes(seed: int, index: int) -> bytes:
    """One RGB JPEG: a smooth random field (upsampled low-res noise) plus fine grain."""
    img, quality = _picture(seed, index)
    return _save(img, "JPEG", quality=quality)


def mixed_image(seed: int, index: int) -> tuple[str, bytes]:
    """(extension, bytes) of image ``index`` in a mixed folder (see the module doc)."""
    from PIL import Image

    img, quality = _picture(seed, index)
    slot, turn = index % 10, index // 10
    if slot < 8:
        if slot == 7:
            img = img.convert("L" if turn % 2 == 0 else "CMYK")
        return ("jpeg" if slot == 6 else "jpg"), _save(img, "JPEG", quality=quality)
    kind = (2 * turn + slot - 8) % 4
    if kind == 1:  # RGBA: an alpha ramp, fully transparent at the left edge
        alpha = np.linspace(0, 255, img.size[0], dtype=np.uint8)[None, :].repeat(img.size[1], 0)
        img = Image.fromarray(np.dstack([np.asarray(img), alpha]))
    elif kind == 2:  # palette, colour 0 transparent
        return "png", _save(img.quantize(64), "PNG", transparency=0)
    elif kind == 3:  # 16-bit grey
        img = Image.fromarray(np.asarray(img.convert("L"), np.uint16) * 257)
    return "png", _save(img, "PNG")


def _save(img, fmt: str, **options) -> bytes:  # noqa: ANN001 - PIL is imported lazily
    buf = io.BytesIO()
    img.save(buf, fmt, **options)
    return buf.getvalue()


def _picture(seed: int, index: int) -> tuple:
    """(RGB PIL image, JPEG quality): a smooth random field (upsampled low-res noise) plus
    fine grain, so it compresses like a photo."""
    from PIL import Image

    rng = np.random.default_rng([seed, index])
    w, h = int(rng.integers(160, 640)), int(rng.integers(120, 480))
    low = rng.random((int(rng.integers(3, 12)), int(rng.integers(3, 12)), 3)) * 255
    img = Image.fromarray(low.astype(np.uint8)).resize((w, h), Image.BICUBIC)
    grain = np.frombuffer(rng.bytes(w * h), np.uint8).reshape(h, w, 1) & 15  # cheap noise
    pixels = np.asarray(img, dtype=np.uint16) + grain
    img = Image.fromarray(np.minimum(pixels, 255).astype(np.uint8))
    return img, int(rng.integers(80, 96))


def _write_images(args: tuple[str, int, int, int, int, bool]) -> int:
    out, seed, classes, start, stop, mixed = args
    total = 0
    for i in range(start, stop):
        folder = os.path.join(out, "images", f"class-{i % classes:03d}")
        os.makedirs(folder, exist_ok=True)
        ext, data = mixed_image(seed, i) if mixed else ("jpg", image_bytes(seed, i))
        with open(os.path.join(folder, f"{i:07d}.{ext}"), "wb") as f:
            f.write(data)
        total += len(data)
    return total


def vocabulary(seed: int, size: int = 20000) -> np.ndarray:
    rng = np.random.default_rng([seed, 1 << 30])
    lengths = np.clip(rng.poisson(5, size) + 1, 1, 14)
    letters = "".join(rng.choice(_LETTERS, int(lengths.sum()), p=_LETTER_P / _LETTER_P.sum()))
    ends = np.cumsum(lengths)
    words = {letters[e - n : e] for e, n in zip(ends, lengths, strict=True)}
    return rng.permutation(np.array(sorted(words)))  # frequency rank independent of spelling


def documents(seed: int, file_index: int, start: int, count: int, vocab: np.ndarray) -> bytes:
    """``count`` JSONL documents; lengths in words are lognormal (median ~150 words)."""
    rng = np.random.default_rng([seed, 2, file_index])
    lengths = np.clip(rng.lognormal(5.0, 1.0, count).astype(np.int64), 1, 20000)
    ranks = rng.zipf(1.15, int(lengths.sum())) - 1
    ranks = ranks % len(vocab)  # fold the long tail back over the vocabulary
    words = vocab[ranks]
    lines = []
    pos = 0
    for i, n in enumerate(lengths):
        text = " ".join(words[pos : pos + n])
        pos += n
        lines.append(json.dumps({"id": start + i, "text": text}))
    return ("\n".join(lines) + "\n").encode()


def _write_docs(args: tuple[str, int, int, int, int]) -> int:
    out, seed, file_index, start, count = args
    vocab = vocabulary(seed)
    data = documents(seed, file_index, start, count, vocab)
    os.makedirs(os.path.join(out, "docs"), exist_ok=True)
    with open(os.path.join(out, "docs", f"part-{file_index:05d}.jsonl"), "wb") as f:
        f.write(data)
    return len(data)


def _write_table(out: str, seed: int, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    vocab = vocabulary(seed)
    text = documents(seed, 10_000, 0, rows, vocab).decode().splitlines()
    table = pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "text": pa.array([json.loads(t)["text"] for t in text], pa.string()),
            "label": pa.array([i % 7 for i in range(rows)], pa.int64()),
        }
    )
    os.makedirs(os.path.join(out, "table"), exist_ok=True)
    pq.write_table(table, os.path.join(out, "table", "part-00000.parquet"), row_group_size=4096)


def make_corpus(
    out: str,
    images: int = 20000,
    classes: int = 100,
    docs: int = 200000,
    doc_files: int = 8,
    parquet_rows: int = 0,
    seed: int = 0,
    jobs: int | None = None,
    mixed: bool = True,
) -> dict:
    """Generate the corpus (see the module docstring); returns its parameters and sizes."""
    jobs = jobs or os.cpu_count() or 1
    os.makedirs(out, exist_ok=True)
    params = {
        "images": images,
        "classes": classes,
        "docs": docs,
        "doc_files": doc_files,
        "parquet_rows": parquet_rows,
        "seed": seed,
        "mixed": mixed,
        "version": 2,
    }
    chunk = max(1, images // (jobs * 8) or 1)
    image_jobs = [
        (out, seed, classes, s, min(s + chunk, images), mixed) for s in range(0, images, chunk)
    ]
    per_file = -(-docs // doc_files) if docs else 0
    doc_jobs = [
        (out, seed, f, f * per_file, min(per_file, docs - f * per_file))
        for f in range(doc_files)
        if docs - f * per_file > 0
    ]
    with ProcessPoolExecutor(jobs) as pool:
        image_total = sum(pool.map(_write_images, image_jobs))
        doc_total = sum(pool.map(_write_docs, doc_jobs))
    if parquet_rows:
        _write_table(out, seed, parquet_rows)
    params["image_bytes"] = image_total
    params["doc_bytes"] = doc_total
    with open(os.path.join(out, "corpus.json"), "w") as f:
        json.dump(params, f, indent=1, sort_keys=True)
    return params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out")
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--docs", type=int, default=200000)
    p.add_argument("--doc-files", type=int, default=8)
    p.add_argument("--parquet-rows", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=None, help="generator processes (default: cores)")
    p.add_argument("--jpeg-only", action="store_true", help="every image an RGB .jpg")
    a = p.parse_args(argv)
    params = make_corpus(
        a.out,
        a.images,
        a.classes,
        a.docs,
        a.doc_files,
        a.parquet_rows,
        a.seed,
        a.jobs,
        mixed=not a.jpeg_only,
    )
    print(
        f"{a.out}: {a.images} images ({params['image_bytes'] / 1e6:.1f} MB), {a.docs} docs "
        f"({params['doc_bytes'] / 1e6:.1f} MB)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

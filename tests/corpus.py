"""Small generated corpora for the pack tests, and helpers to read a packed dataset back."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import tarfile
from collections.abc import Iterable, Sequence

import numpy as np

from shardloader import format as shard_format
from shardloader.manifest import Manifest, SampleIndex

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
    "rho sigma tau upsilon phi chi psi omega"
).split()


def jpeg(seed: int, width: int = 24, height: int = 16) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.random((height, width, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def mask_png(seed: int, width: int = 6, height: int = 4) -> bytes:
    """A small palette PNG (segmentation-mask style): a real image, of a few hundred bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 4, (height, width)).astype("uint8")).convert("P")
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def undecodable_png(seed: int = 0) -> bytes:
    """A PNG whose header and IEND chunk are intact but whose pixel data is garbage: only a
    full decode (``--validate``) finds it."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((40, 50, 3)) * 255).astype("uint8")).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    start = data.index(b"IDAT") + 14
    data[start : start + 30] = bytes(30)
    return bytes(data)


def write(root: str, rel: str, data: bytes) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def class_folders(
    root: str, classes: Iterable[str] = ("cat", "dog", "eel"), per_class: int = 4
) -> dict[str, bytes]:
    """``root/<class>/<i>.jpg``; returns {relative path: bytes}."""
    files = {}
    for c, name in enumerate(classes):
        for i in range(per_class):
            rel = f"{name}/img{i:03d}.jpg"
            files[rel] = jpeg(100 * c + i, 16 + 4 * i, 12 + 2 * c)
            write(root, rel, files[rel])
    return files


def _encode(image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def mixed_image(
    kind: str, seed: int, width: int = 20, height: int = 14
) -> tuple[str, bytes, np.ndarray, float]:
    """One image of the kind a real folder mixes: (extension, bytes, the RGB pixels every
    decoder must produce as uint8 HWC, the mean absolute error allowed: 0 for lossless
    formats, exact; 1 where alpha compositing rounds).

    Transparent pixels are white (composited), 16-bit grey is scaled (not clipped) to 8 bits.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    rgb = (rng.random((height, width, 3)) * 255).astype(np.uint8)
    grey = (rng.random((height, width)) * 255).astype(np.uint8)
    if kind == "jpg-rgb":
        smooth = np.asarray(Image.fromarray(rgb[::4, ::4]).resize((width, height)))
        return "jpg", _encode(Image.fromarray(smooth), "JPEG", quality=95, subsampling=0), smooth, 6
    if kind == "jpeg-grey":
        smooth = np.asarray(Image.fromarray(grey[::4, ::4]).resize((width, height)))
        data = _encode(Image.fromarray(smooth), "JPEG", quality=95, subsampling=0)
        return "jpeg", data, np.repeat(smooth[:, :, None], 3, 2), 6
    if kind == "jpg-cmyk":
        smooth = np.asarray(Image.fromarray(rgb[::4, ::4]).resize((width, height)))
        data = _encode(Image.fromarray(smooth).convert("CMYK"), "JPEG", quality=95, subsampling=0)
        return "jpg", data, smooth, 6
    if kind == "png-rgb":
        return "png", _encode(Image.fromarray(rgb), "PNG"), rgb, 0
    if kind == "png-grey":
        return "png", _encode(Image.fromarray(grey), "PNG"), np.repeat(grey[:, :, None], 3, 2), 0
    if kind == "png-rgba":
        alpha = rng.integers(0, 256, (height, width))
        alpha[rng.random((height, width)) < 0.3] = 0
        alpha[0, 0], alpha[0, 1] = 0, 255
        rgba = np.dstack([rgb, alpha.astype(np.uint8)])
        a = alpha[:, :, None] / 255
        want = np.rint(rgb * a + 255 * (1 - a)).astype(np.uint8)
        return "png", _encode(Image.fromarray(rgba), "PNG"), want, 1
    if kind in ("png-palette", "gif"):
        colours = (rng.random((4, 3)) * 255).astype(np.uint8)
        index = rng.integers(0, 4, (height, width)).astype(np.uint8)
        index[0, 0] = 0
        image = Image.fromarray(index, "L").convert("P")  # indices stay the pixel values
        image.putpalette(colours.flatten().tolist() + [0] * (3 * 252))
        want = colours[index].copy()
        want[index == 0] = 255  # index 0 is transparent: white
        return (
            kind.split("-")[0],
            _encode(image, kind.split("-")[0].upper(), transparency=0),
            want,
            0,
        )
    if kind == "png-16bit":
        wide = grey.astype(np.uint16) * 257  # exactly g/255 of full scale
        return "png", _encode(Image.fromarray(wide), "PNG"), np.repeat(grey[:, :, None], 3, 2), 0
    if kind == "webp":
        return "webp", _encode(Image.fromarray(rgb), "WEBP", lossless=True), rgb, 0
    if kind == "bmp":
        return "bmp", _encode(Image.fromarray(rgb), "BMP"), rgb, 0
    if kind == "tiff-cmyk":
        return "tiff", _encode(Image.fromarray(rgb).convert("CMYK"), "TIFF"), rgb, 0
    raise ValueError(kind)


MIXED_KINDS = (
    "jpg-rgb",
    "jpeg-grey",
    "jpg-cmyk",
    "png-rgb",
    "png-grey",
    "png-rgba",
    "png-palette",
    "png-16bit",
    "gif",
    "webp",
    "bmp",
    "tiff-cmyk",
)


def pixels_match(got: np.ndarray, want: np.ndarray, tolerance: float) -> bool:
    """uint8 HWC ``got`` equals ``want`` exactly (tolerance 0), or within the mean error."""
    diff = np.abs(np.asarray(got, np.int64) - want)
    return got.shape == want.shape and (
        diff.max() == 0 if tolerance == 0 else diff.mean() <= tolerance and diff.max() <= 64
    )


def mixed_class_folders(
    root: str, classes: Iterable[str] = ("cat", "dog"), per_class: int = len(MIXED_KINDS)
) -> dict[str, tuple[np.ndarray, float]]:
    """Class folders as real ones are: every extension and mode of :data:`MIXED_KINDS`, in
    turn; returns {sample key: (expected RGB pixels HWC, mean error allowed)}."""
    want = {}
    for c, name in enumerate(classes):
        for i in range(per_class):
            kind = MIXED_KINDS[(i + c) % len(MIXED_KINDS)]
            ext, data, pixels, tol = mixed_image(kind, 1000 * c + i, 20 + i % 3, 14 + c)
            write(root, f"{name}/{i:03d}.{ext}", data)
            want[f"{name}/{i:03d}"] = (pixels, tol)
    return want


class Boom:
    """Unpickling this would create the file named by ``path``: proves nothing unpickles."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


def key_groups(root: str, n: int = 6, marker: str | None = None) -> dict[str, bytes]:
    """webdataset-style groups: ``a/0001.jpg`` + ``.json`` (+ ``.txt``, ``.seg.png``, ``.pkl``)."""
    files = {}
    for i in range(n):
        key = f"{'ab'[i % 2]}/{i:04d}"
        files[f"{key}.jpg"] = jpeg(i)
        files[f"{key}.json"] = json.dumps({"i": i, "caption": WORDS[i % len(WORDS)]}).encode()
        if i % 2 == 0:
            files[f"{key}.txt"] = " ".join(WORDS[: i + 1]).encode()
        if i % 3 == 0:
            files[f"{key}.seg.png"] = mask_png(i, 4 + i)
        if marker is not None and i == 1:
            files[f"{key}.pkl"] = pickle.dumps(Boom(marker))
    for rel, data in files.items():
        write(root, rel, data)
    return files


def docs(
    n: int, seed: int = 0, mean: float = 2.0, sigma: float = 1.0, longest: int = 400
) -> list[str]:
    """``n`` documents of :data:`WORDS`, 1 to ``longest`` words long (lognormal: mostly short,
    a few long)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(mean, sigma, n).astype(int) + 1, longest)
    return [" ".join(WORDS[int(j)] for j in rng.integers(0, len(WORDS), size=k)) for k in lengths]


def jsonl(
    path: str,
    texts: list[str],
    compress: str | None = None,
    extra_lines: dict[int, bytes] | None = None,
) -> list[bytes]:
    """Write one JSON object per line (``extra_lines`` inserts raw lines at 0-based positions)."""
    lines = [json.dumps({"id": i, "text": t}).encode() for i, t in enumerate(texts)]
    for pos, raw in sorted((extra_lines or {}).items()):
        lines.insert(pos, raw)
    data = b"\n".join(lines) + b"\n"
    if compress == "gzip":
        data = gzip.compress(data, mtime=0)
    elif compress == "zstd":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return lines


def parquet(path: str, n: int) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "text": WORDS[i % len(WORDS)] * (i + 1),
            "label": i % 3,
            "score": i / 4,
            "blob": bytes([i]) * (i + 1),
            "tags": [i, i + 1] if i % 2 else None,
        }
        for i in range(n)
    ]
    table = pa.Table.from_pylist(rows)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pq.write_table(table, path, row_group_size=4)
    return rows


def train_tokenizer(path: str, texts: list[str], vocab_size: int = 64) -> str:
    """A tiny word-level tokenizer trained here (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"])
    tok.train_from_iterator(texts, trainer)
    tok.save(path)
    return path


def tar_file(path: str, members: Sequence[tuple[str, bytes | None]], tar_format: int) -> None:
    """A tar that another tool wrote (``tarfile``'s GNU or pax details): ``members`` in order,
    a name ending in ``/`` with ``None`` a directory entry."""
    with tarfile.open(path, "w", format=tar_format) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name.rstrip("/"))
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def packed_docs(root: str, texts: list[str], **options: object) -> str:
    """``texts`` as ``root/raw/docs.jsonl``, packed into ``root/packed`` with a tokenizer
    trained on them (``root/tok.json``; ``options``: the rest of the PackOptions); returns
    the packed folder."""
    from shardloader.pack import PackOptions, pack

    jsonl(os.path.join(root, "raw", "docs.jsonl"), texts)
    tok = train_tokenizer(os.path.join(root, "tok.json"), [t for t in texts if t])
    out = os.path.join(root, "packed")
    pack(os.path.join(root, "raw"), out, PackOptions(tokenizer=tok, **options))  # type: ignore[arg-type]
    return out


def read_back(out: str) -> tuple[Manifest, list[tuple[str, dict[str, bytes]]]]:
    """Every sample of a packed dataset, streamed from its stored shards in manifest order."""
    with open(os.path.join(out, "index.json"), "rb") as f:
        manifest = Manifest.from_json(f.read())
    samples = []
    for shard in manifest.shards:
        with open(os.path.join(out, shard.path), "rb") as f:
            stream = shard_format.get_format(manifest.format)
            samples.extend(stream.iter_stored(f, manifest.compression, shard.path))
    return manifest, samples


def sidecar(out: str, index_path: str) -> SampleIndex:
    with open(os.path.join(out, index_path), "rb") as f:
        return SampleIndex.from_arrow_bytes(f.read())


def tree(root: str) -> dict[str, bytes]:
    """{relative path: bytes} of every file under ``root``."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out

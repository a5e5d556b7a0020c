"""``Decoder()`` decodes whole JPEGs with the native decoder (libjpeg-turbo) where it is built,
with PIL's pixels: checked on JPEGs written by other encoders than the fixed set of
tests/test_vision_fast.py (which PIL wrote), and everything the native decoder declines still
decodes through PIL.  ``tools/check_native_decode.py DIR`` runs the same comparison over any
folder of JPEGs (a real dataset)."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

import shardloader as sl
from shardloader.codecs.allowlist import decode_field
from shardloader.codecs.imagemode import convert
from shardloader.vision import jpeg

needs_native = pytest.mark.skipif(
    jpeg.native_reason() is not None, reason=str(jpeg.native_reason())
)


def _pil(data: bytes, mode: str = "RGB") -> torch.Tensor:
    """What the Decoder gave before: PIL, converted, as CHW."""
    a = np.asarray(convert(Image.open(io.BytesIO(data)), mode))
    a = a[:, :, None] if a.ndim == 2 else a
    return torch.from_numpy(a.copy()).permute(2, 0, 1)


def _jpeg(a: np.ndarray, **options) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", **{"quality": 88, **options})
    return buf.getvalue()


def _photo(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = jpeg.decode_box

    def counted(*args, **kw):
        out = real(*args, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(jpeg, "decode_box", counted)
    return calls


@needs_native
def test_the_decoder_decodes_a_jpeg_natively_with_pils_pixels(monkeypatch):
    data = _jpeg(_photo(97, 131, 0))
    calls = _counting(monkeypatch)
    got = decode_field("image", "image", data, sl.Decoder())
    assert calls == [True]
    assert got.dtype == torch.uint8 and got.shape == (3, 97, 131)
    assert torch.equal(got, _pil(data))
    got[0, 0, 0] = 1  # the tensor owns writable memory, as before


def _foreign_jpegs() -> dict[str, bytes]:
    """JPEGs other encoders wrote: matplotlib's sample photo (where matplotlib is installed)
    and any named by $SHARDLOADER_FOREIGN_JPEGS (a folder)."""
    out = {}
    try:
        import matplotlib

        path = os.path.join(
            os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data", "grace_hopper.jpg"
        )
        with open(path, "rb") as f:
            out["matplotlib grace_hopper.jpg"] = f.read()
    except (ImportError, OSError):
        pass
    folder = os.environ.get("SHARDLOADER_FOREIGN_JPEGS")
    for name in sorted(os.listdir(folder)) if folder else []:
        if name.lower().endswith((".jpg", ".jpeg")):
            with open(os.path.join(folder, name), "rb") as f:
                out[name] = f.read()
    return out


@needs_native
def test_native_and_pil_agree_on_jpegs_other_encoders_wrote():
    foreign = _foreign_jpegs()
    if not foreign:
        pytest.skip("no JPEG from another encoder here (matplotlib is not installed)")
    for name, data in foreign.items():
        size = jpeg.probe(data)
        assert size is not None, name
        native = jpeg.decode_box(data, size, None, None)
        assert native is not None, name
        want = _pil(data).permute(1, 2, 0).numpy()
        assert np.array_equal(native, want), (
            f"{name}: max difference {np.abs(native.astype(int) - want).max()}"
        )


def test_what_the_native_decoder_declines_still_decodes_with_pil(monkeypatch):
    cmyk = io.BytesIO()
    Image.fromarray(_photo(20, 30, 1)).convert("CMYK").save(cmyk, "JPEG")
    png = io.BytesIO()
    Image.fromarray(_photo(20, 30, 2)).save(png, "PNG")
    grey = _jpeg(_photo(20, 30, 3)[..., 0])
    calls = _counting(monkeypatch)
    for data in (cmyk.getvalue(), png.getvalue()):
        assert torch.equal(decode_field("image", "image", data, sl.Decoder()), _pil(data))
    assert calls == []  # probe() declined both: never offered to the native decoder
    # other modes and kinds keep PIL's path and its shapes
    assert decode_field("image", "image", grey, sl.Decoder(mode="L")).shape == (1, 20, 30)
    assert decode_field("image", "image", grey, sl.Decoder(mode=None)).shape == (1, 20, 30)
    assert decode_field("image", "image", grey, sl.Decoder(image="numpy")).shape == (20, 30, 3)
    assert isinstance(decode_field("image", "image", grey, sl.Decoder(image="pil")), Image.Image)
    assert calls == []
    if jpeg.native_reason() is None:  # grey to RGB: natively, the same pixels
        assert torch.equal(decode_field("image", "image", grey, sl.Decoder()), _pil(grey))
        assert calls == [True]


def test_a_dataset_decodes_jpegs_and_pngs_alike(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    images = {f"{i}.jpg": _jpeg(_photo(40 + i, 50, i)) for i in range(3)}
    png = io.BytesIO()
    Image.fromarray(_photo(33, 44, 9)).save(png, "PNG")
    images["9.png"] = png.getvalue()
    for name, data in images.items():
        (src / name).write_bytes(data)
    from shardloader.pack import pack

    pack(str(tmp_path / "src"), str(tmp_path / "ds"))
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    ds = sl.ShardedDataset(str(tmp_path / "ds"), read=read)
    got = {s["__key__"].rsplit("/", 1)[-1]: s["image"] for s in ds}
    for name, data in images.items():
        assert torch.equal(got[name.split(".")[0]], _pil(data)), name

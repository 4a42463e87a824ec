"""tritonkit.serving.imaging (the code the image_preprocess Python backend runs) and the EfficientNet-Lite0 spec
data."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.support.image_support import bad_inputs
from tritonkit import kinds
from tritonkit.kinds.image import CALIBRATION_BATCH
from tritonkit.serving import imaging

spec = kinds.get("image_classification")


@pytest.fixture(scope="module")
def chelsea_jpeg() -> bytes:
    return spec.photo_bytes("chelsea")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_formats_decode_to_the_same_pixels(fmt):
    rgb = spec.photo("chelsea").rgb
    got = imaging.preprocess_one(imaging.encode(rgb, fmt, quality=98))
    ref = imaging.preprocess_one(imaging.encode(rgb, "PNG"))
    assert got.shape == (3, 224, 224) and got.dtype == np.float32
    # JPEG/WebP at q98 are lossy: a few levels of 255 (in units of 1/128 after normalisation) on average.
    assert np.abs(got - ref).mean() < (0.02 if fmt != "PNG" else 1e-7)


def test_fast_path_matches_plain_pil(chelsea_jpeg):
    """DCT-domain downscale + crop-box resample ≈ full decode, resize shorter side to 256, centre crop."""
    for name in ("chelsea", "coffee", "astronaut", "retina", "hubble_deep_field"):
        data = spec.photo_bytes(name)
        fast, plain = imaging.preprocess_one(data), imaging.plain_preprocess(data)
        assert fast.shape == plain.shape == (3, 224, 224)
        assert np.abs(fast - plain).mean() < 0.06, name
        # Same global content: per-channel means agree closely.
        np.testing.assert_allclose(fast.mean(axis=(1, 2)), plain.mean(axis=(1, 2)), atol=0.02)


def test_normalisation_and_modes():
    # Grey (L) and RGBA inputs come out as 3 equal / RGB channels; 127 maps to 0, 255 to 1 - 1/128.
    grey = np.full((300, 400), 255, np.uint8)
    out = imaging.preprocess_one(imaging.encode(grey, "PNG"))
    np.testing.assert_allclose(out, (255 - 127) / 128, rtol=0, atol=1e-6)
    rgba = np.dstack([np.full((260, 260, 3), 127, np.uint8), np.zeros((260, 260), np.uint8)])
    np.testing.assert_allclose(imaging.preprocess_one(imaging.encode(rgba, "PNG")), 0.0, atol=1e-6)


@pytest.mark.parametrize("case", list(bad_inputs()))
def test_bad_inputs_get_a_clear_per_image_error(case):
    data, expected = bad_inputs()[case]
    batch, errors = imaging.preprocess([spec.photo_bytes("chelsea"), data], imaging.PreprocessConfig())
    assert errors[0] is None and np.abs(batch[0]).sum() > 0
    assert isinstance(errors[1], imaging.ImageInputError)
    assert str(errors[1]).startswith("IMAGE[1]: ") and expected in str(errors[1]), str(errors[1])


def test_pixel_limit_comes_from_config(chelsea_jpeg):
    with pytest.raises(imaging.ImageInputError, match=r"451x300 = 135300 pixels exceeds max_pixels 100000"):
        imaging.preprocess_one(chelsea_jpeg, imaging.PreprocessConfig(max_pixels=100_000))


def test_labels_and_splits():
    names = spec.labels()
    assert len(names) == 1000 and names[285] == "Egyptian cat" and names[967] == "espresso"
    assert names[281].startswith("tabby")
    photos = {split: {e.name.rsplit("/", 1)[0] for e in spec.examples(split)}
              for split in ("calibration", "validation", "test")}
    assert all(photos.values())
    assert not photos["calibration"] & photos["validation"] and not photos["validation"] & photos["test"]
    assert not photos["calibration"] & photos["test"]
    assert spec.calibration_batch_count() * CALIBRATION_BATCH <= len(spec.examples("calibration"))


def _with_orientation(im: Image.Image, orientation: int, fmt: str) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, format=fmt, exif=exif, **({"quality": 92} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(orientation):
    """Stored pixels + EXIF orientation → the upright photo's pixels (exactly for PNG; JPEG re-encoding differs)."""
    upright = Image.fromarray(spec.photo("rocket").rgb)
    # The inverse of what the tag asks for: rotating/flipping back must give the upright photo.
    inverse = {1: [], 2: [Image.Transpose.FLIP_LEFT_RIGHT], 3: [Image.Transpose.ROTATE_180],
               4: [Image.Transpose.FLIP_TOP_BOTTOM], 5: [Image.Transpose.TRANSPOSE], 6: [Image.Transpose.ROTATE_90],
               7: [Image.Transpose.TRANSVERSE], 8: [Image.Transpose.ROTATE_270]}[orientation]
    stored = upright
    for t in inverse:
        stored = stored.transpose(t)
    ref = imaging.preprocess_one(imaging.encode(np.asarray(upright), "PNG"))
    png = imaging.preprocess_one(_with_orientation(stored, orientation, "PNG"))
    np.testing.assert_allclose(png, ref, rtol=0, atol=1e-6)
    jpeg = imaging.preprocess_one(_with_orientation(stored, orientation, "JPEG"))
    assert np.abs(jpeg - imaging.preprocess_one(imaging.encode(np.asarray(upright), "JPEG", 92))).mean() < 0.03


def test_a_jpeg_decoder_passed_in_gets_pillows_dct_size_and_the_rest_of_the_path_is_the_served_one():
    """perf/bench_preprocess.py times other JPEG libraries through this hook: Pillow itself must give the served
    tensor exactly, EXIF orientation included, and PNGs must not reach the decoder."""
    sizes = []

    def pillow(data: bytes, w: int, h: int) -> np.ndarray:
        im = Image.open(io.BytesIO(data))
        im.draft("RGB", (w, h))
        sizes.append((im.size, (w, h)))
        return np.asarray(im.convert("RGB"))

    rotated = _with_orientation(Image.fromarray(spec.photo("rocket").rgb), 6, "JPEG")
    for data in (spec.photo_bytes("chelsea"), spec.photo_bytes("hubble_deep_field"), rotated):
        np.testing.assert_array_equal(imaging.preprocess([data], jpeg=pillow)[0], imaging.preprocess([data])[0])
    assert len(sizes) == 3 and all(got == asked for got, asked in sizes)
    assert sizes[1][1][0] < Image.open(io.BytesIO(spec.photo_bytes("hubble_deep_field"))).size[0]  # DCT-scaled
    imaging.preprocess([imaging.encode(spec.photo("chelsea").rgb, "PNG")], jpeg=pillow)
    assert len(sizes) == 3


def test_malformed_exif_is_ignored(chelsea_jpeg):
    buf = io.BytesIO()
    Image.fromarray(spec.photo("chelsea").rgb).save(buf, format="JPEG", quality=92, exif=b"Exif\x00\x00" + b"\xde" * 40)
    np.testing.assert_array_equal(imaging.preprocess_one(buf.getvalue()), imaging.preprocess_one(chelsea_jpeg))


def test_sixteen_bit_grey_png_keeps_its_top_byte():
    grey = np.asarray(Image.fromarray(spec.photo("chelsea").rgb).convert("L"))
    buf = io.BytesIO()
    Image.fromarray(grey.astype(np.uint16) * 257).save(buf, format="PNG")  # mode I;16: Pillow's convert() clips it
    eight_bit = imaging.preprocess_one(imaging.encode(grey, "PNG"))
    np.testing.assert_array_equal(imaging.preprocess_one(buf.getvalue()), eight_bit)


def test_transparent_pixels_are_the_mean_whatever_lies_under_them():
    rng = np.random.default_rng(3)
    rgba = np.dstack([rng.integers(0, 256, (300, 300, 3), dtype=np.uint8), np.zeros((300, 300), np.uint8)])
    np.testing.assert_allclose(imaging.preprocess_one(imaging.encode(rgba, "PNG")), 0.0, atol=1e-6)
    rgba[..., 3] = 255  # opaque: exactly the RGB image
    np.testing.assert_array_equal(imaging.preprocess_one(imaging.encode(rgba, "PNG")),
                                  imaging.preprocess_one(imaging.encode(rgba[..., :3], "PNG")))


def test_bomb_beyond_pillows_own_limit_names_ours():
    """20000 x 20000 trips Pillow's guard while the header is read; the message still names max_pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    with pytest.raises(imaging.ImageInputError, match=r"^IMAGE\[0\]: 400000000 pixels exceeds max_pixels 40000000 "):
        imaging.preprocess_one(png)


def test_an_unexpected_failure_is_still_one_images_error(monkeypatch, chelsea_jpeg):
    real = imaging.decode_crop

    def flaky(data, cfg, index, jpeg=None):
        if index == 1:
            raise ValueError("conversion not supported")
        return real(data, cfg, index, jpeg)

    monkeypatch.setattr(imaging, "decode_crop", flaky)
    batch, errors = imaging.preprocess([chelsea_jpeg, chelsea_jpeg])
    assert errors[0] is None and np.abs(batch[0]).sum() > 0
    assert str(errors[1]) == "IMAGE[1]: cannot preprocess (ValueError: conversion not supported)"


def test_per_request_gives_each_request_its_rows_or_its_first_bad_image():
    from tritonkit.errors import ImageInputError

    bad = ImageInputError("IMAGE[3]: empty input (0 bytes)")
    worse = ImageInputError("IMAGE[4]: not a decodable image")
    spans = imaging.per_request([2, 3, 1], [None, None, None, bad, worse, None])
    assert spans == [slice(0, 2), "IMAGE[1]: empty input (0 bytes) (+1 more bad images)", slice(5, 6)]


def test_config_from_parameters_reads_the_generated_parameters():
    params = {"resize": "320", "mean": "1,2,3", "std": "4,5,6", "max_pixels": "100", "max_bytes": "50"}
    cfg = imaging.config_from_parameters({"parameters": {k: {"string_value": v} for k, v in params.items()}}, 288)
    assert (cfg.crop, cfg.resize, cfg.mean, cfg.std, cfg.max_pixels, cfg.max_bytes) == (
        288, 320, (1.0, 2.0, 3.0), (4.0, 5.0, 6.0), 100, 50)
    with pytest.raises(ValueError, match=r"parameters\.mean"):
        imaging.config_from_parameters({"parameters": {"mean": {"string_value": "1,2"}}}, 224)

"""tritonkit.imaging (the code the image_preprocess Python backend runs) and the EfficientNet-Lite0 spec data."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tritonkit import imaging
from tritonkit.models import efficientnet_lite0 as spec


@pytest.fixture(scope="module")
def chelsea_jpeg() -> bytes:
    return spec.photo_bytes("chelsea")


def bad_inputs() -> dict[str, tuple[bytes, str]]:
    """Name → (bytes, substring the per-image error must contain)."""
    good = spec.photo_bytes("coffee")
    png = io.BytesIO()
    # 8000 x 6000 = 48 M pixels of black: a 50 kB PNG that would decode to 48 MB (limit: 40 M pixels).
    Image.new("L", (8000, 6000)).save(png, format="PNG")
    gif = io.BytesIO()
    Image.fromarray(spec.photo("coffee").rgb[:64, :64]).save(gif, format="GIF")
    return {
        "empty": (b"", "empty input"),
        "non-image": (b"this is plain text, not an image" * 10, "not a decodable image"),
        "corrupt": (good[:200] + bytes(range(256)) * 40, "corrupt"),
        "truncated": (good[: len(good) // 2], "truncated"),
        "bomb": (png.getvalue(), "max_pixels 40000000"),
        "gif": (gif.getvalue(), "accepted formats: JPEG, PNG, WEBP"),
    }


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
    cal = {e.name.split("/")[0] for e in spec.examples("calibration")}
    ev = {e.name.split("/")[0] for e in spec.examples("evaluation")}
    assert cal and ev and not cal & ev and {"chelsea", "coffee"} <= ev
    assert len(spec.examples("evaluation")) == len(ev) * len(spec.VIEWS)
    assert spec.calibration_batch_count() * spec.CALIBRATION_BATCH <= len(spec.examples("calibration"))

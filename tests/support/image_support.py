"""Helpers shared by the image tests: the bad uploads every image path must refuse with a clear per-image error."""

from __future__ import annotations

import io

from PIL import Image

from tritonkit import kinds


def bad_inputs() -> dict[str, tuple[bytes, str]]:
    """Name → (bytes, substring the per-image error must contain)."""
    spec = kinds.get("image_classification")
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

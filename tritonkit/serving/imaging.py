"""Image bytes → normalised FP32 NCHW, the one implementation used by the Triton preprocessor and in-process paths.

Fast path (`preprocess`): read the header only, reject oversized images before decoding, let libjpeg decode at
1/2, 1/4 or 1/8 scale in the DCT domain (`Image.draft`) when that still leaves the shorter side >= `resize`,
then resample only the centre-crop box straight to `crop`×`crop` (`Image.resize(box=...)`): nothing outside
the crop is resized and no intermediate 256-px image is made. Normalisation is one uint8 → float32 lookup.

Input variants have one defined result each: EXIF orientation (JPEG, PNG, WebP) is applied, so a rotated photo
gives the pixels of the upright one; 16-bit PNGs keep their top 8 bits; grey, palette and CMYK images become RGB;
transparent pixels are composited over the normalisation mean (127 grey), i.e. they reach the model as 0.0.

`plain_preprocess` is the textbook PIL path (full decode, resize shorter side, crop, normalise) used as the
naive baseline in the benchmarks and as the reference the fast path is checked against.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from tritonkit.errors import ImageInputError

FORMATS = ("JPEG", "PNG", "WEBP")
_ORIENTATION = 0x0112  # EXIF tag
# EXIF orientation → the transpose that shows the stored pixels upright (as ImageOps.exif_transpose does).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_WIDE_GREY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")  # 16-bit grey PNG (Pillow's convert() clips these)


@dataclass(frozen=True)
class PreprocessConfig:
    resize: int = 256  # shorter side after resizing
    crop: int = 224  # centre crop
    # EfficientNet-Lite (TF) normalisation: (pixel - 127) / 128 on every channel.
    mean: tuple[float, float, float] = (127.0, 127.0, 127.0)
    std: tuple[float, float, float] = (128.0, 128.0, 128.0)
    max_pixels: int = 40_000_000  # width × height from the header; larger is refused before decoding
    max_bytes: int = 32 * 1024 * 1024
    formats: tuple[str, ...] = FORMATS
    field: str = "IMAGE"  # tensor name used in error messages

    def lut(self) -> np.ndarray:
        """[3, 256] float32: normalised value of every uint8 level per channel."""
        levels = np.arange(256, dtype=np.float32)
        return np.stack([(levels - m) / s for m, s in zip(self.mean, self.std)]).astype(np.float32)


def config_from_parameters(config: dict, crop: int) -> PreprocessConfig:
    """A Triton model config's preprocessing parameters (resize, mean, std, max_pixels, max_bytes), as generated
    for the preprocessor and the fused classifier; `crop` is the model's input size."""
    from tritonkit.serving.backend_utils import param

    def floats(key: str, default: str) -> tuple[float, float, float]:
        text = param(config, key, default)
        values = tuple(float(v) for v in text.split(","))
        if len(values) != 3:
            raise ValueError(f"parameters.{key}: expected three comma-separated values, got {text!r}")
        return values

    return PreprocessConfig(crop=crop, resize=int(param(config, "resize", "256")),
                            mean=floats("mean", "127,127,127"), std=floats("std", "128,128,128"),
                            max_pixels=int(param(config, "max_pixels", "40000000")),
                            max_bytes=int(param(config, "max_bytes", str(32 * 1024 * 1024))), field="IMAGE")


def per_request(counts: Sequence[int], errors: Sequence[ImageInputError | None]) -> list[slice | str]:
    """Requests of `counts` images each, preprocessed as one batch with `errors`: each request's rows of the batch
    (consecutive, so a slice), or the message of its first bad image, indexed within the request."""
    out: list[slice | str] = []
    start = 0
    for n in counts:
        bad = [(i, e) for i, e in enumerate(errors[start : start + n]) if e is not None]
        if bad:
            more = f" (+{len(bad) - 1} more bad images)" if len(bad) > 1 else ""
            out.append(f"IMAGE[{bad[0][0]}]: {str(bad[0][1]).split(': ', 1)[-1]}{more}")
        else:
            out.append(slice(start, start + n))
        start += n
    return out


def _open(data: bytes, cfg: PreprocessConfig, index: int) -> Image.Image:
    where = f"{cfg.field}[{index}]"
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ImageInputError(f"{where}: expected encoded image bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ImageInputError(f"{where}: empty input (0 bytes)")
    if len(data) > cfg.max_bytes:
        raise ImageInputError(f"{where}: {len(data)} bytes exceeds max_bytes {cfg.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=list(cfg.formats))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own guard (MAX_IMAGE_PIXELS) fired while reading the header; report it against our limit.
        found = re.search(r"\((\d+) pixels\)", str(exc))
        pixels = int(found.group(1)) if found else None
        if pixels is None or pixels > cfg.max_pixels:
            count = f"{pixels} pixels" if pixels is not None else "the image size"
            raise ImageInputError(
                f"{where}: {count} exceeds max_pixels {cfg.max_pixels} (decompression-bomb limit; refused "
                "before decoding)"
            ) from None
        raise ImageInputError(f"{where}: refused by Pillow's decompression-bomb guard ({exc})") from None
    except UnidentifiedImageError:
        raise ImageInputError(
            f"{where}: not a decodable image (accepted formats: {', '.join(cfg.formats)})"
        ) from None
    except Exception as exc:  # corrupt headers raise assorted errors inside the format plugins
        raise ImageInputError(f"{where}: corrupt image header ({type(exc).__name__}: {exc})") from None
    w, h = im.size
    if w <= 0 or h <= 0:
        raise ImageInputError(f"{where}: invalid image size {w}x{h}")
    if w * h > cfg.max_pixels:
        raise ImageInputError(
            f"{where}: {w}x{h} = {w * h} pixels exceeds max_pixels {cfg.max_pixels} (decompression-bomb limit)"
        )
    return im


def _decoded(im: Image.Image, cfg: PreprocessConfig, index: int) -> Image.Image:
    try:
        im.load()
    except Exception as exc:  # truncated or corrupt data: OSError, SyntaxError, zlib errors ...
        raise ImageInputError(f"{cfg.field}[{index}]: corrupt or truncated image data ({exc})") from None
    return im


def _crop_box(w: int, h: int, cfg: PreprocessConfig) -> tuple[float, float, float, float]:
    """Centre-crop box in source pixels equal to resize-shorter-side-then-crop."""
    side = cfg.crop * min(w, h) / cfg.resize
    left, top = (w - side) / 2, (h - side) / 2
    return left, top, left + side, top + side


JpegDecoder = Callable[[bytes, int, int], np.ndarray]  # (data, width, height) → uint8 RGB decoded at that size


def decode_crop(
    data: bytes, cfg: PreprocessConfig = PreprocessConfig(), index: int = 0, jpeg: JpegDecoder | None = None
) -> np.ndarray:
    """Encoded bytes → uint8 [crop, crop, 3] RGB, via DCT-domain JPEG downscaling and a crop-box resample.
    `jpeg`: another library decoding JPEGs at Pillow's DCT scale, for perf/bench_preprocess.py to compare."""
    im = _open(data, cfg, index)
    if im.format == "JPEG":
        _jpeg_draft(im, cfg)
        if jpeg is not None:
            return _crop_decoded(Image.fromarray(jpeg(data, *im.size)), _orientation(im), cfg)
    im = _decoded(im, cfg, index)
    return _crop_decoded(im, _orientation(im), cfg)


def _jpeg_draft(im: Image.Image, cfg: PreprocessConfig) -> None:
    """Before decoding an opened JPEG: ask for the largest 1/2, 1/4 or 1/8 DCT-domain reduction that keeps the
    shorter side >= `cfg.resize`; `im.size` becomes the size the decode will have."""
    w, h = im.size
    scale = cfg.resize / min(w, h)
    im.draft("RGB", (max(1, int(w * scale + 0.999)), max(1, int(h * scale + 0.999))))


def _crop_decoded(im: Image.Image, orientation: int, cfg: PreprocessConfig) -> np.ndarray:
    """Decoded pixels with their EXIF `orientation` → uint8 [crop, crop, 3] RGB, upright."""
    upright = _UPRIGHT.get(orientation)
    alpha = im.mode in _ALPHA_MODES or "transparency" in im.info
    if im.mode in _WIDE_GREY_MODES:
        im = Image.fromarray((np.clip(np.asarray(im), 0, 65535) >> 8).astype(np.uint8), "L")
    mode = "RGBA" if alpha else "RGB"
    if im.mode != mode:
        im = im.convert(mode)
    dw, dh = im.size
    # A centred square box is the same region before and after a rotation/flip, so the (cheap) transpose is
    # applied to the crop only; resampling commutes with it.
    box = _crop_box(dw, dh, cfg)
    # reducing_gap: large PNG/WebP sources are first box-reduced by an integer factor (cheap), then filtered.
    out = im.resize((cfg.crop, cfg.crop), Image.Resampling.BILINEAR, box=box, reducing_gap=3.0)
    if alpha:  # Pillow resamples RGBA premultiplied; composite over the mean so transparency reads as 0.0
        background = Image.new("RGBA", out.size, (*(round(m) for m in cfg.mean), 255))
        out = Image.alpha_composite(background, out).convert("RGB")
    if upright is not None:
        out = out.transpose(upright)
    return np.asarray(out)


def _orientation(im: Image.Image) -> int:
    """EXIF orientation 1-8; 1 (as stored) when absent or unreadable: the pixels are still usable."""
    try:
        value = im.getexif().get(_ORIENTATION, 1)
        return value if isinstance(value, int) and value in _UPRIGHT else 1
    except Exception:  # malformed EXIF blocks raise assorted errors inside Pillow
        return 1


def preprocess(
    images: Sequence[bytes], cfg: PreprocessConfig = PreprocessConfig(), jpeg: JpegDecoder | None = None
) -> tuple[np.ndarray, list[ImageInputError | None]]:
    """Batch of encoded images → (float32 [n, 3, crop, crop], per-image error or None); bad rows stay zero.
    `jpeg`: as for `decode_crop`."""
    lut = cfg.lut()
    out = np.zeros((len(images), 3, cfg.crop, cfg.crop), dtype=np.float32)
    errors: list[ImageInputError | None] = []
    for i, data in enumerate(images):
        try:
            rgb = decode_crop(data, cfg, i, jpeg)
        except ImageInputError as exc:
            errors.append(exc)
            continue
        except Exception as exc:  # an image Pillow opens but cannot convert: still this image's error alone
            errors.append(ImageInputError(f"{cfg.field}[{i}]: cannot preprocess ({type(exc).__name__}: {exc})"))
            continue
        for c in range(3):
            np.take(lut[c], rgb[:, :, c], out=out[i, c])
        errors.append(None)
    return out, errors


def preprocess_one(data: bytes, cfg: PreprocessConfig = PreprocessConfig()) -> np.ndarray:
    """One image → float32 [3, crop, crop]; raises ImageInputError."""
    out, errors = preprocess([data], cfg)
    if errors[0] is not None:
        raise errors[0]
    return out[0]


def plain_preprocess(data: bytes, cfg: PreprocessConfig = PreprocessConfig()) -> np.ndarray:
    """Textbook PIL (what a naive server does): full decode, resize shorter side, crop, normalise → [3, H, W]."""
    im = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = im.size
    scale = cfg.resize / min(w, h)
    im = im.resize((round(w * scale), round(h * scale)), Image.Resampling.BILINEAR)
    w, h = im.size
    left, top = (w - cfg.crop) // 2, (h - cfg.crop) // 2
    im = im.crop((left, top, left + cfg.crop, top + cfg.crop))
    x = np.asarray(im, dtype=np.float32)
    x = (x - np.asarray(cfg.mean, np.float32)) / np.asarray(cfg.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def encode(rgb: np.ndarray, fmt: str = "JPEG", quality: int = 90) -> bytes:
    """uint8 array (H, W[, 3]) → encoded bytes (for tests, calibration sets and perf input files)."""
    buf = io.BytesIO()
    im = Image.fromarray(np.asarray(rgb, dtype=np.uint8))
    kwargs = {"quality": quality} if fmt.upper() in ("JPEG", "WEBP") else {}
    im.save(buf, format=fmt, **kwargs)
    return buf.getvalue()

"""Bad-input matrix for both pipelines on one real tritonserver, every case over HTTP and gRPC.

Requests are built with tritonclient directly, so wrong dtypes, ranks, shapes, missing inputs, unknown outputs and
malformed BYTES tensors really reach the server. Every case ends in one of two ways:

* a defined result, checked: e.g. an EXIF-rotated JPEG classifies like the upright photo, a 16-bit PNG exactly
  like its 8-bit version, transparent pixels count as the normalisation mean, a text over 256 tokens is truncated;
* an `InferenceServerException` with a client-error status (HTTP 400 / gRPC INVALID_ARGUMENT) whose message names
  the field (`'text'`, `IMAGE[2]`, ...) and the limit where there is one (`max_pixels 40000000`, `<= 64`, ...);

and in both ways a healthy request right after it must succeed with the right answer.

The mixed-batch tests keep the preprocessor (tokenizer / image_preprocess) busy so that several good requests and
one bad one queue up and run as one dynamic batch (checked in Triton's batch statistics), then check that only the
bad one failed and that every good one got what it gets when sent alone.

Photos are scikit-image's bundled ones; odd images are made here with PIL or written byte by byte.
"""

from __future__ import annotations

import io
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from tests.support.text_support import INT8_PACKING_NOISE
from tritonkit import build, data, kinds, paths
from tritonkit.serving import imaging

spec = kinds.get("image_classification")


pytestmark = pytest.mark.slow  # builds both pipelines' artefacts if they are missing (a no-op when current)

PROTOCOLS = ["http", "grpc"]
TEXT, IMAGE = "text_embedding", "image_classification"
CLIENT_ERROR = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
# Queue policies (default_queue_policy) reject requests that wait too long or find the queue full: load shedding on
# a busy shared machine, not an answer to the input. Such a request is sent again; nothing else is retried.
SHED = ("Request timeout expired", "Exceeds maximum queue size")
ESPRESSO = 967


def shed(result) -> bool:
    return isinstance(result, InferenceServerException) and any(s in str(result) for s in SHED)


@pytest.fixture(scope="module")
def server(start_server):
    build.build("text", progress=False)
    build.build("image", progress=False)
    return start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=[TEXT, IMAGE])


# ---------------------------------------------------------------------------------------------------------------
# Requests as data: the same case is sent over either protocol.


@dataclass(frozen=True)
class In:
    """One input tensor; `raw` replaces its serialized bytes on the wire (the declared shape stays the array's)."""

    name: str
    array: np.ndarray
    datatype: str = "BYTES"
    raw: bytes | None = None


def strings(name: str, *items: bytes) -> In:
    return In(name, np.array([[x] for x in items], dtype=object))


class Caller:
    """tritonclient for one protocol, plus what every case needs: send, expect an error, check health."""

    def __init__(self, server, protocol: str):
        self.protocol = protocol
        self.module = httpclient if protocol == "http" else grpcclient
        url = server.http_url if protocol == "http" else server.grpc_url
        self.client = self.module.InferenceServerClient(url)
        self.still_serving: np.ndarray | None = None

    def close(self) -> None:
        # Idle keep-alive connections would hold the server's shutdown drain up to its exit timeout.
        self.client.close()

    def _tensor(self, tensor: In):
        t = self.module.InferInput(tensor.name, list(tensor.array.shape), tensor.datatype)
        t.set_data_from_numpy(tensor.array)
        if tensor.raw is not None:  # tritonclient always serializes correctly; put the malformed bytes in ourselves
            if self.protocol == "http":
                t._raw_data = tensor.raw
                t._parameters["binary_data_size"] = len(tensor.raw)
            else:
                t._raw_content = tensor.raw
        return t

    def infer(self, model: str, inputs: list[In], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        send = self.prepare(model, inputs, outputs)
        for _ in range(4):
            try:
                return send()
            except InferenceServerException as err:
                if not shed(err):
                    raise
                time.sleep(0.2)
        return send()

    def prepare(self, model: str, inputs: list[In], outputs: list[str] | None = None):
        """Serialize now, send when called (so that concurrent senders start as close together as possible)."""
        requested = [self.module.InferRequestedOutput(o) for o in outputs] if outputs else None
        tensors = [self._tensor(i) for i in inputs]
        names = outputs or (["embedding", "num_tokens", "truncated"] if model == TEXT else ["PROBABILITIES"])

        def send() -> dict[str, np.ndarray]:
            result = self.client.infer(model, tensors, outputs=requested)
            return {n: result.as_numpy(n) for n in names}

        return send

    def expect_error(self, model: str, inputs: list[In], *fragments: str, outputs: list[str] | None = None) -> str:
        with pytest.raises(InferenceServerException) as info:
            self.infer(model, inputs, outputs)
        message = str(info.value)
        for fragment in fragments:
            assert fragment in message, f"{fragment!r} not in {message!r}"
        assert str(info.value.status()) == CLIENT_ERROR[self.protocol], f"not a client error: {message}"
        return message

    def embed(self, *texts: bytes) -> np.ndarray:
        return self.infer(TEXT, [strings("text", *texts)])["embedding"]

    def probs(self, *images: bytes) -> np.ndarray:
        return self.infer(IMAGE, [strings("IMAGE", *images)])["PROBABILITIES"]

    def healthy(self, pipeline: str) -> None:
        assert self.client.is_server_live() and self.client.is_server_ready()
        if pipeline == TEXT:
            assert float(self.embed(b"still serving")[0] @ self.still_serving) > 0.9999
        else:
            assert int(self.probs(spec.photo_bytes("coffee")).argmax()) == ESPRESSO


@pytest.fixture(scope="module")
def callers(server) -> Iterator[dict[str, Caller]]:
    out = {p: Caller(server, p) for p in PROTOCOLS}
    for caller in out.values():
        # Embedded before any case ran: what a healthy request after a case must get again.
        caller.still_serving = caller.embed(b"still serving")[0]
    yield out
    for caller in out.values():
        caller.close()


# ---------------------------------------------------------------------------------------------------------------
# Images made here.


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A ~100-byte PNG whose header claims width x height RGB pixels (a decompression bomb's header)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _png_chunk(b"IEND", b""))


def png16(array: np.ndarray) -> bytes:
    """uint16 [H, W] or [H, W, C] (C = 2, 3, 4) → 16-bit PNG (PIL cannot write 16-bit colour PNGs)."""
    h, w = array.shape[:2]
    colour = {1: 0, 2: 4, 3: 2, 4: 6}[1 if array.ndim == 2 else array.shape[2]]
    rows = np.ascontiguousarray(array.astype(">u2")).view(np.uint8).reshape(h, -1)
    raw = b"".join(b"\0" + row.tobytes() for row in rows)
    ihdr = struct.pack(">IIBBBBB", w, h, 16, colour, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(raw))
            + _png_chunk(b"IEND", b""))


def jpeg_claiming(width: int, height: int) -> bytes:
    """A tiny baseline JPEG whose frame header (SOF0) is patched to claim width x height."""
    data = bytearray(imaging.encode(np.zeros((8, 8, 3), np.uint8), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def save(im: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


@cache
def rgb(name: str = "chelsea") -> np.ndarray:
    return spec.photo(name).rgb


@cache
def grey(name: str = "chelsea") -> np.ndarray:
    return np.asarray(Image.fromarray(rgb(name)).convert("L"))


def over_grey(im: Image.Image) -> bytes:
    """What the user sees, composited over the normalisation mean (127 grey), as an RGB PNG."""
    background = Image.new("RGBA", im.size, (127, 127, 127, 255))
    return save(Image.alpha_composite(background, im.convert("RGBA")).convert("RGB"))


def with_exif(im: Image.Image, orientation: int, fmt: str = "JPEG") -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return save(im, fmt, exif=exif, **({"quality": 92} if fmt == "JPEG" else {}))


# The stored pixels whose EXIF orientation says "show me as the upright photo" (inverse of exif_transpose).
STORED_FOR = {
    2: [Image.Transpose.FLIP_LEFT_RIGHT],
    3: [Image.Transpose.ROTATE_180],
    4: [Image.Transpose.FLIP_TOP_BOTTOM],
    5: [Image.Transpose.TRANSPOSE],
    6: [Image.Transpose.ROTATE_90],
    7: [Image.Transpose.TRANSVERSE],
    8: [Image.Transpose.ROTATE_270],
}


def stored_pixels(name: str, orientation: int) -> Image.Image:
    im = Image.fromarray(rgb(name))
    for t in STORED_FOR[orientation]:
        im = im.transpose(t)
    return im


# ---------------------------------------------------------------------------------------------------------------
# The matrix. Each case gets a Caller and raises on failure; the test then sends a healthy request.

CASES: dict[str, tuple[str, Callable[[Caller], None]]] = {}


def case(pipeline: str, name: str):
    def register(fn: Callable[[Caller], None]) -> Callable[[Caller], None]:
        assert name not in CASES, name
        CASES[name] = (pipeline, fn)
        return fn

    return register


def error_case(pipeline: str, name: str, make: Callable[[], list[In]], *fragments: str,
               outputs: list[str] | None = None) -> None:
    case(pipeline, name)(lambda c: c.expect_error(pipeline, make(), *fragments, outputs=outputs))


def triton_rejects(pipe: str, field: str) -> None:
    """Errors raised by Triton itself before any model runs: the same for both pipelines (field = the input)."""
    p = "text" if pipe == TEXT else "image"

    def one(array: np.ndarray, datatype: str = "BYTES", raw: bytes | None = None) -> Callable[[], list[In]]:
        return lambda: [In(field, array, datatype, raw=raw)]

    x = np.array([[b"x"]], dtype=object)
    error_case(pipe, f"{p}/dtype-int32", one(np.array([[7]], np.int32), "INT32"),
               f"inference input '{field}' data-type is 'INT32', but model '{pipe}' expects 'BYTES'")
    error_case(pipe, f"{p}/dtype-uint8-raw-bytes", one(np.frombuffer(b"\xff\xd8\xff\xe0abc", np.uint8)[None], "UINT8"),
               f"inference input '{field}' data-type is 'UINT8'")
    error_case(pipe, f"{p}/rank-1-no-batch-dim", one(np.array([b"x"], dtype=object)),
               f"unexpected shape for input '{field}' for model '{pipe}'. Expected [-1,1], got [1]")
    error_case(pipe, f"{p}/rank-3", one(np.array([[[b"x"]]], dtype=object)),
               f"unexpected shape for input '{field}'", "got [1,1,1]")
    error_case(pipe, f"{p}/shape-1x2", one(np.array([[b"x", b"y"]], dtype=object)),
               f"unexpected shape for input '{field}'", "got [1,2]")
    error_case(pipe, f"{p}/batch-65-over-max", one(np.array([[b"x"]] * 65, dtype=object)),
               f"batch-size must be <= 64 for '{pipe}'")
    error_case(pipe, f"{p}/batch-0", one(np.zeros((0, 1), dtype=object)), f"inference input '{field}'")
    error_case(pipe, f"{p}/missing-input", lambda: [], f"missing required input(s) ['{field}']")
    error_case(pipe, f"{p}/misspelt-input", lambda: [In(field + "s", x)],
               f"unexpected inference input '{field}s' for model '{pipe}'")
    error_case(pipe, f"{p}/extra-input", lambda: [In(field, x), In("extra", x)], "'extra'", f"for model '{pipe}'")
    error_case(pipe, f"{p}/unknown-output", one(x), f"unexpected inference output 'nonexistent' for model '{pipe}'",
               outputs=["nonexistent"])
    # A BYTES element whose 4-byte length prefix promises 1000 bytes, followed by 3.
    error_case(pipe, f"{p}/bytes-length-prefix-lies", one(x, raw=struct.pack("<I", 1000) + b"abc"),
               f"string data for inference input '{field}', expecting string of length 1000")
    # The shape declares 2 elements, the body holds 1.
    error_case(pipe, f"{p}/fewer-elements-than-shape",
               one(np.array([[b"x"], [b"y"]], dtype=object), raw=struct.pack("<I", 1) + b"x"), f"input '{field}'")


triton_rejects(TEXT, "text")
triton_rejects(IMAGE, "IMAGE")


# Text: errors from the tokenizer, per request, naming the element.
error_case(TEXT, "text/empty", lambda: [strings("text", b"")], "tokenizer: text[0] is empty or whitespace-only")
error_case(TEXT, "text/whitespace-only", lambda: [strings("text", " \t\n\u00a0\u3000 ".encode())],
           "tokenizer: text[0] is empty or whitespace-only")
error_case(TEXT, "text/zero-width-and-control-only", lambda: [strings("text", "\u200b\ufeff\x00\x07".encode())],
           "tokenizer: text[0] has no tokens")
error_case(TEXT, "text/non-utf8-latin1", lambda: [strings("text", b"caf\xe9 au lait")],
           "tokenizer: text[0] is not valid UTF-8 (byte 0xe9 at offset 3)")
error_case(TEXT, "text/non-utf8-surrogate", lambda: [strings("text", b"ab\xed\xa0\x80")],
           "text[0] is not valid UTF-8 (byte 0xed at offset 2)")
error_case(TEXT, "text/non-utf8-cut-sequence", lambda: [strings("text", "日本".encode()[:-1])],
           "text[0] is not valid UTF-8")
error_case(TEXT, "text/huge-over-max-chars", lambda: [strings("text", b"word " * 24_000)],
           "text[0] is 120000 bytes; the limit is 100000 (parameter max_chars)")
error_case(TEXT, "text/bad-element-in-batch", lambda: [strings("text", b"fine", b"also fine", b"\xff\xfe")],
           "tokenizer: text[2] is not valid UTF-8")


@cache
def long_text(chars: int) -> bytes:
    return " ".join(data.split("evaluation")[:3000]).encode()[:chars]


@case(TEXT, "text/long-under-limit-truncated")
def _(c: Caller) -> None:
    out = c.infer(TEXT, [strings("text", long_text(99_000), b"short")])
    assert out["truncated"].ravel().tolist() == [True, False]
    assert out["num_tokens"].ravel()[0] == 256 and out["num_tokens"].ravel()[1] < 5
    np.testing.assert_allclose(np.linalg.norm(out["embedding"], axis=1), 1.0, atol=1e-4)


@case(TEXT, "text/odd-but-valid")
def _(c: Caller) -> None:
    texts = [b"a\x00b", "🙂 emoji".encode(), "日本語のテキスト".encode(), "مرحبا hello".encode(), b"\t padded \n"]
    out = c.infer(TEXT, [strings("text", *texts)])
    assert np.isfinite(out["embedding"]).all() and (out["num_tokens"].ravel() >= 3).all()
    np.testing.assert_allclose(np.linalg.norm(out["embedding"], axis=1), 1.0, atol=1e-4)
    # Surrounding whitespace is not content: the same embedding as the stripped text.
    assert 1.0 - float(out["embedding"][4] @ c.embed(b"padded")[0]) <= INT8_PACKING_NOISE  # batch of 5 vs alone


@case(TEXT, "text/batch-64-at-max")
def _(c: Caller) -> None:
    out = c.infer(TEXT, [strings("text", *[f"text number {i}".encode() for i in range(64)])])
    assert out["embedding"].shape == (64, 384) and out["num_tokens"].shape == (64, 1)


# Images: errors from image_preprocess, per request, naming the element and the limit.
def _image(*items: bytes) -> Callable[[], list[In]]:
    return lambda: [strings("IMAGE", *items)]


error_case(IMAGE, "image/zero-bytes", _image(b""), "image_preprocess: IMAGE[0]: empty input (0 bytes)")
error_case(IMAGE, "image/text-not-image", _image(b"this is plain text, not an image\n" * 8),
           "IMAGE[0]: not a decodable image (accepted formats: JPEG, PNG, WEBP)")
error_case(IMAGE, "image/gif-unsupported", lambda: [strings("IMAGE", save(Image.fromarray(rgb()[:64, :64]), "GIF"))],
           "IMAGE[0]: not a decodable image (accepted formats: JPEG, PNG, WEBP)")
error_case(IMAGE, "image/tiff-unsupported",
           lambda: [strings("IMAGE", save(Image.fromarray(rgb()[:64, :64]), "TIFF"))],
           "IMAGE[0]: not a decodable image (accepted formats: JPEG, PNG, WEBP)")
error_case(IMAGE, "image/jpeg-corrupt-after-header",
           lambda: [strings("IMAGE", spec.photo_bytes("coffee")[:200] + bytes(range(256)) * 40)],
           "IMAGE[0]: corrupt")
error_case(IMAGE, "image/jpeg-truncated",
           lambda: [strings("IMAGE", spec.photo_bytes("coffee")[: len(spec.photo_bytes("coffee")) // 2])],
           "IMAGE[0]: corrupt or truncated image data")
error_case(IMAGE, "image/png-truncated",
           lambda: [strings("IMAGE", spec.photo_bytes("coffee", "PNG")[:5000])], "IMAGE[0]: corrupt or truncated")


def _bad_crc_png() -> bytes:
    good = bytearray(spec.photo_bytes("coffee", "PNG"))
    idat = good.index(b"IDAT")
    good[idat + 100] ^= 0xFF  # flips bits inside the first IDAT: its CRC no longer matches
    return bytes(good)


error_case(IMAGE, "image/png-bad-crc", lambda: [strings("IMAGE", _bad_crc_png())], "IMAGE[0]: corrupt")
error_case(IMAGE, "image/bomb-png-20000x20000", lambda: [strings("IMAGE", png_header_only(20_000, 20_000))],
           "IMAGE[0]: 400000000 pixels exceeds max_pixels 40000000", "refused before decoding")
error_case(IMAGE, "image/bomb-png-just-over-limit", lambda: [strings("IMAGE", png_header_only(8000, 5001))],
           "IMAGE[0]: 8000x5001 = 40008000 pixels exceeds max_pixels 40000000")
error_case(IMAGE, "image/bomb-jpeg-60000x60000", lambda: [strings("IMAGE", jpeg_claiming(60_000, 60_000))],
           "IMAGE[0]: 3600000000 pixels exceeds max_pixels 40000000")
error_case(IMAGE, "image/over-max-bytes", lambda: [strings("IMAGE", b"\0" * (33 * 2**20))],
           "IMAGE[0]: 34603008 bytes exceeds max_bytes 33554432")
error_case(IMAGE, "image/bad-element-in-batch",
           lambda: [strings("IMAGE", spec.photo_bytes("chelsea"), spec.photo_bytes("coffee"), b"GIF89a junk")],
           "image_preprocess: IMAGE[2]: not a decodable image")


def assert_probabilities(p: np.ndarray, n: int = 1) -> None:
    assert p.shape == (n, 1000) and np.isfinite(p).all() and (p >= 0).all()
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-4)


def same_as(data: bytes, reference: bytes, atol: float) -> Callable[[Caller], None]:
    """The image classifies like `reference` (same top-1; probabilities within atol)."""

    def check(c: Caller) -> None:
        got, want = c.probs(data), c.probs(reference)
        assert_probabilities(got)
        assert got.argmax() == want.argmax(), (got.argmax(), want.argmax())
        assert np.abs(got - want).max() <= atol, np.abs(got - want).max()

    return check


def defined(name: str, make: Callable[[], tuple[bytes, bytes]], atol: float) -> None:
    case(IMAGE, name)(lambda c: same_as(*make(), atol)(c))


EXACT = 1e-5  # the same pixels reach the classifier
for size in ((1, 1), (1, 20_000), (20_000, 1), (16, 16_000)):
    for fmt in ("PNG", "JPEG"):

        def one(c: Caller, size=size, fmt=fmt) -> None:
            w, h = size
            img = np.zeros((h, w, 3), np.uint8)
            img[..., 0], img[..., 2] = 200, np.linspace(0, 255, h * w).reshape(h, w).astype(np.uint8)
            assert_probabilities(c.probs(imaging.encode(img, fmt)))

        case(IMAGE, f"image/{size[0]}x{size[1]}-{fmt.lower()}")(one)

defined("image/grey-png-L", lambda: (save(Image.fromarray(grey())), imaging.encode(np.dstack([grey()] * 3), "PNG")),
        EXACT)
defined("image/grey-jpeg-L", lambda: (imaging.encode(grey(), "JPEG", 95), save(Image.fromarray(grey()))), 0.05)
defined("image/png-16bit-grey", lambda: (png16(grey().astype(np.uint16) * 257), save(Image.fromarray(grey()))),
        EXACT)
defined("image/png-16bit-rgb", lambda: (png16(rgb().astype(np.uint16) * 257), imaging.encode(rgb(), "PNG")), EXACT)
defined("image/png-16bit-rgba-opaque",
        lambda: (png16(np.dstack([rgb(), np.full(rgb().shape[:2], 255, np.uint8)]).astype(np.uint16) * 257),
                 imaging.encode(rgb(), "PNG")), EXACT)
defined("image/png-rgba-opaque",
        lambda: (save(Image.fromarray(rgb()).convert("RGBA")), imaging.encode(rgb(), "PNG")), EXACT)
defined("image/png-la-opaque", lambda: (save(Image.fromarray(grey()).convert("LA")), save(Image.fromarray(grey()))),
        EXACT)
defined("image/jpeg-cmyk",
        lambda: (save(Image.fromarray(rgb("coffee")).convert("CMYK"), "JPEG", quality=95),
                 spec.photo_bytes("coffee", quality=95)), 0.05)
defined("image/png-palette",
        lambda: (save(Image.fromarray(rgb()).quantize(128)), save(Image.fromarray(rgb()).quantize(128).convert("RGB"))),
        EXACT)


def _transparent_border() -> tuple[bytes, bytes]:
    """RGBA photo whose 40-px border is transparent with random noise under it: the noise must not count."""
    h, w = rgb().shape[:2]
    alpha = np.zeros((h, w), np.uint8)
    alpha[40:-40, 40:-40] = 255
    noisy = rgb().copy()
    noisy[alpha == 0] = np.random.default_rng(7).integers(0, 256, ((alpha == 0).sum(), 3), dtype=np.uint8)
    im = Image.fromarray(np.dstack([noisy, alpha]), "RGBA")
    return save(im), over_grey(im)


def _palette_with_transparency() -> tuple[bytes, bytes]:
    im = Image.fromarray(rgb()).quantize(64)
    im.info["transparency"] = int(np.bincount(np.asarray(im).ravel()).argmax())  # the commonest colour: see-through
    data = save(im, transparency=im.info["transparency"])
    return data, over_grey(Image.open(io.BytesIO(data)))


defined("image/png-rgba-transparent-border-over-noise", _transparent_border, 0.02)
defined("image/png-palette-with-transparency", _palette_with_transparency, 0.02)


def _exif_case(orientation: int, fmt: str) -> Callable[[Caller], None]:
    """The rocket photo stored sideways/flipped with the EXIF tag that shows it upright classifies like the
    upright photo; without the tag the same stored pixels get another top-1 (so the tag really is applied)."""

    def check(c: Caller) -> None:
        stored = stored_pixels("rocket", orientation)
        upright = spec.photo_bytes("rocket") if fmt == "JPEG" else imaging.encode(rgb("rocket"), "PNG")
        same_as(with_exif(stored, orientation, fmt), upright, 0.1 if fmt == "JPEG" else EXACT)(c)
        if orientation != 2:  # a mirror image is still a rocket, and ranks the same
            plain = save(stored, fmt, **({"quality": 92} if fmt == "JPEG" else {}))
            assert c.probs(plain).argmax() != c.probs(upright).argmax()

    return check


for _o in range(2, 9):
    case(IMAGE, f"image/jpeg-exif-orientation-{_o}")(_exif_case(_o, "JPEG"))
case(IMAGE, "image/png-exif-orientation-6")(_exif_case(6, "PNG"))
defined("image/jpeg-malformed-exif-ignored",
        lambda: (save(Image.fromarray(rgb()), "JPEG", quality=92, exif=b"Exif\x00\x00" + b"\xde\xad" * 30),
                 spec.photo_bytes("chelsea")), EXACT)


@case(IMAGE, "image/batch-64-at-max")
def _(c: Caller) -> None:
    assert_probabilities(c.probs(*[imaging.encode(np.full((8, 8, 3), i, np.uint8), "PNG") for i in range(64)]), 64)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", list(CASES))
def test_case_then_healthy_request(callers, name, protocol):
    pipeline, check = CASES[name]
    caller = callers[protocol]
    check(caller)
    caller.healthy(pipeline)


def test_the_matrix_is_large_enough():
    text = [n for n, (p, _) in CASES.items() if p == TEXT]
    assert len(text) >= 15 and len(CASES) - len(text) >= 15 and len(CASES) >= 30


# ---------------------------------------------------------------------------------------------------------------
# Mixed dynamic batches: one bad request among good ones, all in the same execute() of the preprocessor.


def batch_counts(caller: Caller, model: str) -> dict[int, int]:
    kwargs = {"as_json": True} if caller.protocol == "grpc" else {}
    stats = caller.client.get_inference_statistics(model, **kwargs)
    batches = stats["model_stats"][0].get("batch_stats", [])
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in batches}


def scheduling(caller: Caller, model: str) -> tuple[int, float | None]:
    """(instances, default queue timeout in s or None) from the served config: a request queued for longer than
    the timeout is rejected."""
    config = caller.client.get_model_config(model, **({"as_json": True} if caller.protocol == "grpc" else {}))
    config = config.get("config", config)
    instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
    policy = config.get("dynamic_batching", {}).get("default_queue_policy", {})
    us = int(policy.get("default_timeout_microseconds", 0))
    return instances, (us / 1e6 if us else None)


def _send(server, protocol: str, job: tuple, ready: threading.Barrier, go: threading.Event | None):
    """Connect and serialize in this thread (HTTP clients are bound to theirs), wait until every sender is ready,
    then send at once (blockers) or when `go` is set (the requests that are to queue up behind them)."""
    caller = Caller(server, protocol)
    try:
        assert caller.client.is_server_live()
        send = caller.prepare(*job)
        ready.wait()
        if go is not None:
            go.wait()
        try:
            return send()
        except InferenceServerException as err:
            return err
    finally:
        caller.close()


def rows_of(inputs: list[In]) -> int:
    return int(inputs[0].array.shape[0])


@dataclass(frozen=True)
class Blocker:
    """A request straight to the preprocessor that keeps one instance busy for a while: `row` repeated."""

    model: str
    field: str
    row: bytes
    output: str

    def sized(self, main: Caller, seconds: float) -> list[In]:
        """As many rows as take about `seconds` now (the machine is shared: measured, not assumed)."""
        probe = [strings(self.field, self.row, self.row)]
        main.infer(self.model, probe, [self.output])  # warm
        started = time.perf_counter()
        main.infer(self.model, probe, [self.output])
        per_row = (time.perf_counter() - started) / 2
        return [strings(self.field, *[self.row] * max(1, min(64, round(seconds / per_row))))]


def run_mixed_batch(server, protocol: str, model: str, blocker: Blocker, goods: list[list[In]],
                    bad: list[In], compare: Callable[[dict, dict], None], fragments: list[str]) -> None:
    """Keep every preprocessor instance busy (one blocker each), queue the good requests and the bad one behind
    them (released together), then check that only the bad one failed, that every good one got what it gets
    alone, and that the bad request ran in one execute() with good ones: goods have 1 row each and `bad` more rows
    than all goods together, so a preprocessor batch of more than rows(bad) rows (other than the blockers' own)
    holds the bad request and at least one good one. The timing is retried a few times; every round checks the
    results (a round in which a queue policy shed requests proves nothing either way and is retried too)."""
    assert all(rows_of(g) == 1 for g in goods) and rows_of(bad) > len(goods)
    shared = range(rows_of(bad) + 1, rows_of(bad) + len(goods) + 1)
    main = Caller(server, protocol)
    try:
        refs = [main.infer(model, g) for g in goods]
        # Busy long enough for the queued requests to gather, short enough for them not to hit a queue timeout.
        instances, timeout = scheduling(main, blocker.model)
        block = blocker.sized(main, min(0.1, timeout / 4) if timeout else 0.1)
        jobs = [(model, g) for g in goods] + [(model, bad)]
        seen: list[dict] = []
        for _attempt in range(6):
            before = batch_counts(main, blocker.model)
            with ThreadPoolExecutor(instances + len(jobs)) as pool:
                ready, go = threading.Barrier(instances + len(jobs) + 1), threading.Event()
                lanes = [threading.Event() for _ in range(instances)]
                busy = [pool.submit(_send, server, protocol, (blocker.model, block, [blocker.output]), ready, lane)
                        for lane in lanes]
                queued = [pool.submit(_send, server, protocol, job, ready, go) for job in jobs]
                ready.wait()
                for lane in lanes:  # one blocker per instance: a few ms apart, so that they do not batch together
                    lane.set()
                    time.sleep(0.004)
                time.sleep(0.006)
                go.set()
                results = [f.result() for f in queued]
                for f in busy:
                    assert not isinstance(f.result(), Exception), f.result()
            if any(shed(r) for r in results):
                seen.append({"shed by a queue policy": sum(shed(r) for r in results)})
                continue
            *good_results, error = results
            for i, (ref, got) in enumerate(zip(refs, good_results)):
                assert not isinstance(got, Exception), f"good request {i} failed beside the bad one: {got}"
                compare(ref, got)
            assert isinstance(error, InferenceServerException), "the bad request succeeded"
            message = str(error)
            assert all(f in message for f in fragments) and str(error.status()) == CLIENT_ERROR[protocol], message
            after = batch_counts(main, blocker.model)
            delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            delta[rows_of(block)] = delta.get(rows_of(block), 0) - instances  # the blockers ran on their own
            seen.append({k: v for k, v in delta.items() if v})
            if any(seen[-1].get(size, 0) > 0 for size in shared):
                return
        pytest.fail(f"the bad request never shared a {blocker.model} batch with good ones; "
                    f"batch sizes per round: {seen}")
    finally:
        main.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("bad_text, fragment", [(b"caf\xe9", "text[1] is not valid UTF-8"),
                                                ("\u200b".encode(), "text[1] has no tokens")],
                         ids=["non-utf8", "no-tokens"])
def test_text_mixed_batch_bad_request_fails_alone(server, callers, protocol, bad_text, fragment):
    sentences = [s.encode() for s in data.split("evaluation")[:12]]
    goods = [[strings("text", s)] for s in sentences[:5]]
    bad = [strings("text", *sentences[5:6], bad_text, *sentences[6:11])]  # 7 rows, element 1 bad

    def compare(ref, got):
        assert (got["num_tokens"] == ref["num_tokens"]).all()
        # Alone vs in a mixed batch: the INT8 packed graph's measured batching noise, no more.
        assert (1.0 - (got["embedding"] * ref["embedding"]).sum(1)).max() <= INT8_PACKING_NOISE

    blocker = Blocker("tokenizer", "text", long_text(20_000), "input_ids")
    run_mixed_batch(server, protocol, TEXT, blocker, goods, bad, compare, ["tokenizer: ", fragment])
    callers[protocol].healthy(TEXT)


@cache
def gradient_png() -> bytes:
    """1.4 M pixels that compress to a few kB: several ms of decoding per copy."""
    y, x = np.mgrid[0:1200, 0:1200]
    return imaging.encode(np.dstack([x % 256, y % 256, (x + y) % 256]).astype(np.uint8), "PNG")


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("bad_image, fragment", [
    (lambda: spec.photo_bytes("coffee")[:3000], "IMAGE[1]: corrupt or truncated"),
    (lambda: png_header_only(20_000, 20_000), "IMAGE[1]: 400000000 pixels exceeds max_pixels 40000000"),
], ids=["truncated", "bomb"])
def test_image_mixed_batch_bad_request_fails_alone(server, callers, protocol, bad_image, fragment):
    photos = [spec.photo_bytes(n) for n in ("chelsea", "coffee", "astronaut", "rocket", "motorcycle_left")]
    goods = [[strings("IMAGE", p)] for p in photos]
    # 7 rows, element 1 bad; small fillers, so that its upload is not slower than the others'
    fillers = [imaging.encode(np.full((32, 32, 3), 40 * i, np.uint8), "PNG") for i in range(5)]
    bad = [strings("IMAGE", photos[1], bad_image(), *fillers)]

    def compare(ref, got):
        assert (got["PROBABILITIES"].argmax(1) == ref["PROBABILITIES"].argmax(1)).all()
        np.testing.assert_allclose(got["PROBABILITIES"], ref["PROBABILITIES"], atol=1e-4)

    blocker = Blocker("image_preprocess", "IMAGE", gradient_png(), "PIXELS")
    run_mixed_batch(server, protocol, IMAGE, blocker, goods, bad, compare, ["image_preprocess: ", fragment])
    callers[protocol].healthy(IMAGE)

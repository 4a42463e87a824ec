"""Real photographs for INT8 calibration and held-out evaluation of image models, from installed packages.

`photos_manifest.tsv` lists every photo: where it comes from (a Debian package, paths relative to the file
system root, or a Python package, paths relative to its directory), its sha256 and its scene group. The list is
fixed and sorted; a package update that changes or removes a file is reported by name instead of silently
changing the data. Sources (licences in the data README): Tux Paint's photo stamps (cutouts with alpha; drawings
and clip art left out by eye), MATE's and Lomiri's photographic wallpapers, and the sample photos of
scikit-image, matplotlib and scikit-learn.

Photos decode to RGB (transparent pixels over the preprocessing mean, as tritonkit.serving.imaging does), shrink so the
shorter side is at most `MAX_SIDE` (evaluation stays fast; the model sees 224 px anyway), and are dealt by
scene group into disjoint splits, within each source: 1 in 5 to "calibration", 2 to "validation", 2 to "test".
Deterministic crops and flips (`VIEWS`) widen each photo into several inputs.

`python -m tritonkit.data.photos check` verifies the installed files; `... rehash` rewrites the hashes after a
deliberate package update (review the changed photos first).
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from tritonkit.errors import PhotoDataError
from tritonkit.paths import PackageNotInstalled, package_dir

MANIFEST = Path(__file__).with_name("photos_manifest.tsv")
SPLITS = ("calibration", "validation", "test")
# Position of a group within its source, modulo 5 → split (20 / 40 / 40 %).
_DEAL = ("calibration", "validation", "test", "validation", "test")
MAX_SIDE = 320
BACKGROUND = (127, 127, 127)  # EfficientNet-Lite's normalisation mean: transparent pixels reach the model as 0
APT_PACKAGES = ("tuxpaint-stamps-default", "mate-backgrounds", "lomiri-wallpapers-16.04")

# Deterministic views of a photo: (name, crop box as fractions of width/height, horizontal flip).
VIEWS: tuple[tuple[str, tuple[float, float, float, float], bool], ...] = (
    ("full", (0.0, 0.0, 1.0, 1.0), False),
    ("flip", (0.0, 0.0, 1.0, 1.0), True),
    ("center70", (0.15, 0.15, 0.85, 0.85), False),
    ("center70-flip", (0.15, 0.15, 0.85, 0.85), True),
    ("top-left80", (0.0, 0.0, 0.8, 0.8), False),
    ("top-right80", (0.2, 0.0, 1.0, 0.8), False),
    ("bottom-left80", (0.0, 0.2, 0.8, 1.0), True),
    ("bottom-right80", (0.2, 0.2, 1.0, 1.0), True),
    ("center50", (0.25, 0.25, 0.75, 0.75), False),
    ("left-half", (0.0, 0.1, 0.6, 0.9), False),
    ("right-half", (0.4, 0.1, 1.0, 0.9), True),
)


@dataclass(frozen=True)
class Entry:
    source: str  # "deb:<package>" or "py:<package>"
    path: str  # relative to / (deb) or to the Python package's directory (py)
    sha256: str
    group: str  # photos of one scene share a group and so a split

    @property
    def name(self) -> str:
        return f"{self.source.split(':', 1)[1]}/{self.path}"


@dataclass(frozen=True)
class Photo:
    name: str
    source: str
    rgb: np.ndarray  # uint8 [H, W, 3], shorter side <= MAX_SIDE


@dataclass(frozen=True)
class View:
    name: str  # photo name/view name
    rgb: np.ndarray


@cache
def manifest() -> tuple[Entry, ...]:
    rows = []
    for n, line in enumerate(MANIFEST.read_text(encoding="utf-8").splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 4:
            raise PhotoDataError(f"{MANIFEST.name}:{n}: expected source, path, sha256, group; got {fields!r}")
        rows.append(Entry(*fields))
    return tuple(rows)


def _fix(source: str) -> str:
    kind, package = source.split(":", 1)
    if kind == "deb":
        return f"apt-get install {package} (make setup installs {', '.join(APT_PACKAGES)})"
    return f"pip install {package} (make setup installs requirements.txt)"


def resolve(entry: Entry) -> Path:
    kind, package = entry.source.split(":", 1)
    if kind == "deb":
        return Path("/") / entry.path
    if kind != "py":
        raise PhotoDataError(f"{entry.name}: unknown source kind '{kind}' (deb or py)")
    try:
        return package_dir(package) / entry.path
    except PackageNotInstalled:
        raise PhotoDataError(f"{entry.name}: Python package '{package}' is not installed: "
                             f"{_fix(entry.source)}") from None


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check() -> None:
    """Every listed file exists and has its recorded hash; all problems in one error."""
    problems = []
    for e in manifest():
        path = resolve(e)
        if not path.is_file():
            problems.append(f"{e.name}: missing ({_fix(e.source)})")
        elif sha256(path) != e.sha256:
            problems.append(f"{e.name}: sha256 differs from {MANIFEST.name} (package updated? review, then rehash)")
    if problems:
        raise PhotoDataError(f"{len(problems)} photo(s) not as recorded:\n  " + "\n  ".join(problems))


def decode(path: Path, max_side: int = MAX_SIDE) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        im.draft("RGB", (max_side, max_side))  # JPEG: let libjpeg decode big wallpapers at a fraction
        im = im.convert("RGBA")
    scale = max_side / min(im.size)
    if scale < 1:
        im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))), Image.Resampling.LANCZOS)
    out = Image.new("RGBA", im.size, (*BACKGROUND, 255))
    out.alpha_composite(im)
    return np.asarray(out.convert("RGB"))


def split_of(entry: Entry) -> str:
    return _splits()[entry.group]


@cache
def _splits() -> dict[str, str]:
    """Groups of each source, ordered by a hash of their name (stable when others are added), dealt 1:2:2."""
    by_source: dict[str, list[str]] = {}
    for e in manifest():
        groups = by_source.setdefault(e.source, [])
        if e.group not in groups:
            groups.append(e.group)
    out = {}
    for groups in by_source.values():
        for i, g in enumerate(sorted(groups, key=lambda g: hashlib.sha256(g.encode()).hexdigest())):
            out[g] = _DEAL[i % len(_DEAL)]
    return out


def entries(split: str) -> tuple[Entry, ...]:
    if split not in SPLITS:
        raise KeyError(f"unknown photo split '{split}' (known: {', '.join(SPLITS)})")
    return tuple(e for e in manifest() if split_of(e) == split)


@cache
def photos(split: str) -> tuple[Photo, ...]:
    """Decoded photos of a split; a missing package is named with the command that installs it."""
    out = []
    for e in entries(split):
        path = resolve(e)
        if not path.is_file():
            raise PhotoDataError(f"{e.name}: missing ({_fix(e.source)})")
        out.append(Photo(e.name, e.source, decode(path)))
    return tuple(out)


def crop(rgb: np.ndarray, box: tuple[float, float, float, float], flip: bool) -> np.ndarray:
    h, w = rgb.shape[:2]
    x0, y0, x1, y1 = int(box[0] * w), int(box[1] * h), round(box[2] * w), round(box[3] * h)
    out = rgb[y0:y1, x0:x1]
    return np.ascontiguousarray(out[:, ::-1] if flip else out)


def views(split: str, names: tuple[str, ...] | None = None) -> tuple[View, ...]:
    """Every photo of a split under each view in `names` (all of VIEWS by default)."""
    chosen = [v for v in VIEWS if names is None or v[0] in names]
    if names is not None and len(chosen) != len(names):
        raise KeyError(f"unknown view in {names} (known: {', '.join(v[0] for v in VIEWS)})")
    return tuple(View(f"{p.name}/{name}", crop(p.rgb, box, flip)) for p in photos(split) for name, box, flip in chosen)


def rehash() -> int:
    """Rewrite the recorded hashes from the installed files; returns how many changed."""
    lines, changed = [], 0
    for line in MANIFEST.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            e = Entry(*line.split("\t"))
            digest = sha256(resolve(e))
            changed += digest != e.sha256
            line = "\t".join((e.source, e.path, digest, e.group))
        lines.append(line)
    MANIFEST.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tritonkit.data.photos", description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("check", "rehash", "counts"))
    args = ap.parse_args()
    if args.command == "check":
        check()
        print(f"{len(manifest())} photos as recorded")
    elif args.command == "rehash":
        print(f"{rehash()} hash(es) changed in {MANIFEST.name}")
    else:
        for split in SPLITS:
            es = entries(split)
            by_source: dict[str, int] = {}
            for e in es:
                by_source[e.source] = by_source.get(e.source, 0) + 1
            print(f"{split:12s} {len(es):4d}  " + "  ".join(f"{s}={n}" for s, n in sorted(by_source.items())))


if __name__ == "__main__":
    main()

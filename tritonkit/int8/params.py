"""Quantization parameters of a recipe: everything a build would otherwise compute from calibration data.

A replay of a committed recipe used to recalibrate on every fresh clone (minutes: histograms, GPTQ's Hessians,
SmoothQuant's activation maxima). These parameters are what those passes produce for one FP32 graph: activation
ranges of the calibrated graph, SmoothQuant scales, GPTQ's integer codes (as the difference from round-to-nearest,
which compresses to little) and row scales, corrected biases. With them a replay is a pure function of the FP32
graph and this file, so every machine builds the same INT8 bytes, in seconds (tests/int8/test_params.py proves
byte equality with a fresh calibration on the same data). They apply only to the FP32 graph they were computed
from (its sha256) and the recipe they were computed for; anything else recalibrates, saying why.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonkit.errors import QuantizationError

VERSION = 1


_DIGESTS: dict[tuple, str] = {}


def file_digest(path: Path) -> str:
    """sha256 of a file, once per process while it is unchanged (MPNet's FP32 file is 400 MB; a build asks often)."""
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _DIGESTS:
        _DIGESTS[key] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return _DIGESTS[key]


@dataclass
class QuantParams:
    source: str  # sha256 of the FP32 graph they were computed from
    recipe: str  # the digest of the recipe they were computed for (recipe.recipe_digest)
    method: str  # the calibration method of `ranges`
    # What the FP32 graph was made from (spec, packages: tritonkit.int8.floor.source): an export's last bits differ
    # between CPUs (Lite0's does between an AMD EPYC and an Intel Xeon), the parameters still hold for it.
    origin: str = ""
    ranges: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # calibrated graph's tensors
    smooth: dict[str, np.ndarray] = field(default_factory=dict)  # smoothed tensor -> SmoothQuant scales s
    rounding: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # weight -> (codes, scales)
    biases: dict[str, np.ndarray] = field(default_factory=dict)  # bias initializer -> corrected bias
    # Each rounded weight's round-to-nearest codes: GPTQ's codes are stored as their difference from these.
    nearest: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def tensors_data(self):
        """The ranges as onnxruntime's TensorsData, as the calibration computed them."""
        from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

        method = "MinMax" if self.method == "minmax" else self.method.capitalize()
        return TensorsData(getattr(CalibrationMethod, method),
                           {k: TensorData(lowest=lo, highest=hi) for k, (lo, hi) in self.ranges.items()})

    def save(self, path: Path) -> Path:
        """Writes the parameters (GPTQ codes as their differences from round-to-nearest: mostly zeros)."""
        arrays: dict[str, np.ndarray] = {}
        names: dict[str, list[str]] = {"ranges": list(self.ranges), "smooth": list(self.smooth),
                                       "rounding": list(self.rounding), "biases": list(self.biases)}
        for i, (lo, hi) in enumerate(self.ranges.values()):
            arrays[f"range{i}_lo"], arrays[f"range{i}_hi"] = np.asarray(lo), np.asarray(hi)
        for i, s in enumerate(self.smooth.values()):
            arrays[f"smooth{i}"] = s
        for i, (name, (codes, scales)) in enumerate(self.rounding.items()):
            delta = codes.values if isinstance(codes, Delta) else codes - self.nearest[name]
            if np.abs(delta).max(initial=0) > 127:
                raise QuantizationError(f"GPTQ codes of {name} differ from round-to-nearest by more than int8 holds")
            arrays[f"round{i}_delta"], arrays[f"round{i}_scale"] = delta.astype(np.int8), scales
        for i, b in enumerate(self.biases.values()):
            arrays[f"bias{i}"] = b
        meta = {"version": VERSION, "source": self.source, "recipe": self.recipe, "method": self.method,
                "origin": self.origin, "names": names}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            np.savez_compressed(f, meta=np.array(json.dumps(meta)), **arrays)
        return path

    @classmethod
    def load(cls, path: Path) -> QuantParams:
        """The stored parameters; GPTQ codes are stored as differences and come back as `Delta`s, resolved against
        the weights they apply to when the rounding is replayed (rounding.round_weights)."""
        with np.load(str(path), allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("version") != VERSION:
                raise QuantizationError(f"{path}: quantization parameters of version {meta.get('version')}, "
                                        f"this build reads {VERSION}")
            names = meta["names"]
            return cls(
                meta["source"], meta["recipe"], meta["method"], meta.get("origin", ""),
                ranges={n: (data[f"range{i}_lo"], data[f"range{i}_hi"]) for i, n in enumerate(names["ranges"])},
                smooth={n: data[f"smooth{i}"] for i, n in enumerate(names["smooth"])},
                rounding={n: (Delta(data[f"round{i}_delta"]), data[f"round{i}_scale"])
                          for i, n in enumerate(names["rounding"])},
                biases={n: data[f"bias{i}"] for i, n in enumerate(names["biases"])},
            )

    def applies(self, source: str, recipe: str, origin: str = "") -> tuple[bool, str]:
        """(whether these parameters apply to this FP32 graph and recipe, what to say about it)."""
        if self.recipe != recipe:
            return False, "the recipe differs from the one they were computed for"
        if self.source == source:
            return True, ""
        if origin and self.origin == origin:
            return True, ("the FP32 graph differs in its bytes from the one they were computed from, made from the "
                          "same spec and packages (an export's last bits differ between CPUs); the INT8 bytes may "
                          "differ from the committing machine's, and every gate is checked here")
        return False, "the FP32 graph differs from the one they were computed from"


@dataclass
class Delta:
    """GPTQ codes stored as their difference from round-to-nearest codes of the same weights."""

    values: np.ndarray

    def resolve(self, nearest: np.ndarray) -> np.ndarray:
        return nearest + self.values.astype(nearest.dtype)


def capture(prepared, ranges, method: str, source: str, recipe: str, origin: str = "") -> QuantParams:
    """The parameters a prepared graph and its calibrated ranges (before input isolation's copies) hold."""
    rounding = prepared.rounding
    return QuantParams(source, recipe, method, origin,
                       ranges={k: tuple(np.asarray(v) for v in td.range_value) for k, td in ranges.items()},
                       smooth=dict(prepared.smooth_scales), rounding=dict(rounding.codes) if rounding else {},
                       biases=dict(prepared.corrected_biases), nearest=dict(rounding.nearest) if rounding else {})

"""What every model kind shares: names, gates and sessions; the interface the build, the INT8 search and the
config generator read (see tritonkit.int8.search.SearchSpec)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import ClassVar

from tritonkit.kinds.gates import Target
from tritonkit.kinds.spec import Spec, SpecError


class Kind:
    WEIGHT_OPS: tuple[str, ...] = ()
    DEFAULT_GATES: ClassVar[dict[str, float]] = {}
    # Gates bounded from above (a divergence such as kl_mean): a spec tightens them by lowering them.
    UPPER_GATES: ClassVar[frozenset[str]] = frozenset()
    # Per gate metric, how far under the FP32 graph's half-precision floor INT8 may fall; and the bounds no floor
    # loosens (tritonkit.int8.gates.targets).
    FLOOR_SLACK: ClassVar[dict[str, float]] = {}
    CATASTROPHE: ClassVar[tuple[Target, ...]] = ()
    SPEED_BATCHES: tuple[int, ...] = (1, 8, 32)
    # The overload profile's shedding queue per step, (default_timeout_microseconds, max_queue_size)
    # (tritonkit.repository.variants): timeouts above a full batch's worst case at normal load, queue sizes a
    # memory backstop well above what the timeout lets pile up at 4x load (perf/bench_overload.py).
    OVERLOAD: ClassVar[dict[str, tuple[int, int]]] = {"preprocessor": (250_000, 1024), "model": (300_000, 1024)}
    DATA_FILES: tuple[Path, ...] = ()

    def __init__(self, spec: Spec):
        self.spec = spec
        self.NAME = spec.name
        self.FP32_MODEL = spec.fp32_model
        self.INT8_MODEL = spec.int8_model
        self.PREPROCESSOR = spec.preprocessor
        for key, value in spec.gates.items():
            if key not in self.DEFAULT_GATES:
                raise SpecError(spec.label, f"gates.{key}", f"unknown gate (known: {', '.join(self.DEFAULT_GATES)})")
            if (value > self.DEFAULT_GATES[key]) if key in self.UPPER_GATES else (value < self.DEFAULT_GATES[key]):
                raise SpecError(spec.label, f"gates.{key}", f"{value} is looser than the project's gate "
                                f"{self.DEFAULT_GATES[key]}; a spec may only tighten gates")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.NAME!r})"

    def gate(self, metric: str) -> float:
        return self.spec.gates.get(metric, self.DEFAULT_GATES[metric])

    @property
    def SPEED_TARGET(self) -> Target:
        """INT8 ÷ FP32 on the runtimes that serve them: the lower end of its 95 % interval at the slowest served
        batch size (tritonkit.int8.speed.speedup), at least the gate; a knife-edge median decides nothing."""
        return Target("int8_speedup_lo", ">=", self.gate("int8_speedup"))

    @property
    def FP32_RUNTIME_CHECK(self) -> Target:
        """What the FP32 file run on another runtime must keep against ONNX Runtime's outputs to serve there
        (tritonkit.repository.runtime_choice): its top-1 class, nearly always."""
        return Target("top1_agreement", ">=", 0.995)

    def timing_feeds(self, batch: int, mixes: int) -> list[dict]:
        """The feeds a served file is timed on at `batch` rows (tritonkit.repository.runtime_choice): up to `mixes`
        different batches where the kind's inputs vary in shape; one fixed batch here."""
        return [self.speed_feeds(batch)]

    @staticmethod
    def session(path: Path, threads: int = 0):
        """A CPU session in the arithmetic a served replica of this CPU computes: off VNNI an INT8 file's sums take
        the exact path as served (backend_utils.session_options), not the default saturating int16 pairs."""
        import onnxruntime as ort

        from tritonkit.serving.backend_utils import exact_int8

        options = exact_int8(ort.SessionOptions())
        if threads:
            options.intra_op_num_threads = threads
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class TransformerKind(Kind):
    """A kind served from a Hugging Face transformer directory: its source, tokenizer.json and architecture
    (tritonkit.kinds.architectures), shared by the text kinds."""

    def model_dir(self) -> Path:
        return self.spec.source.path()

    def tokenizer_file(self) -> Path:
        return self.model_dir() / "tokenizer.json"

    @cached_property
    def architecture(self):
        from tritonkit.kinds import architectures

        return architectures.get(self.spec.facts.architecture)

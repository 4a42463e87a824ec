"""Stage 4 of the INT8 stage: a built INT8 graph judged on this machine, once.

Takes the graph's bytes' digest, the form, the arithmetic it is judged in and the runtime variants its speed is
timed on; returns a `Judgement`: its metrics on the held-out test split and, for the served form, its speed against
the FP32 competitor (tritonkit.int8.speed). Judgements are kept under build/int8-judgements/ by digest, with what
else their numbers depend on (`context`: the FP32 file, the spec, the evaluation data, the packages and this CPU),
so a graph is never measured twice: the replay after a search rebuilds the very bytes the search judged and reuses
its judgement, and a later build of unchanged files reuses its own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tritonkit import envinfo, paths

STORE = paths.BUILD_OUTPUTS / "int8-judgements"


@dataclass
class Judgement:
    digest: str  # sha256 of the judged graph's bytes (before the marks a served file gets)
    form: str
    exact: bool  # judged in exact int32 sums (tritonkit.int8.evaluate.session)
    context: str  # what else its numbers depend on (`context`)
    test: dict[str, float]
    speed: dict[str, float] = field(default_factory=dict)  # served form: INT8 against FP32 (speed.speedup)
    variants: list[str] = field(default_factory=list)  # FP32's and INT8's runtime variants the speed was timed on
    by: str = "replay"  # who measured it: "search" or "replay"

    def fits(self, form: str, exact: bool, context: str, variants: Sequence[str] | None) -> bool:
        """Whether it judges what a caller asks: the same form, arithmetic and context, and (served form) speed
        timed on the same variants."""
        same = (self.form, self.exact, self.context) == (form, exact, context)
        return same and (variants is None or list(variants) == self.variants)


def digest_of(model) -> str:
    """sha256 of a graph: a ModelProto's serialized bytes (what onnx.save writes) or a file's bytes."""
    data = model.SerializeToString() if hasattr(model, "SerializeToString") else Path(model).read_bytes()
    return hashlib.sha256(data).hexdigest()


def context(kind, fp32: Path) -> str:
    """What a judgement's numbers depend on besides the graph: the FP32 file (the references), the spec (gates,
    batch sizes), the evaluation data, the packages and this CPU (speed, and the exact path's availability)."""
    from tritonkit import data
    from tritonkit.int8.params import file_digest

    h = hashlib.sha256(file_digest(fp32).encode())
    for path in [getattr(getattr(kind, "spec", None), "file", None), data.SENTENCES, *getattr(kind, "DATA_FILES", ())]:
        if path is not None and Path(path).exists():
            h.update(Path(path).read_bytes())
    h.update(json.dumps([envinfo.fingerprint(), envinfo.cpu_model()], sort_keys=True, default=str).encode())
    return h.hexdigest()[:24]


def _file(digest: str) -> Path:
    return STORE / f"{digest[:32]}.json"


def lookup(digest: str, form: str, exact: bool, ctx: str, variants: Sequence[str] | None) -> Judgement | None:
    path = _file(digest)
    if not path.exists():
        return None
    for item in json.loads(path.read_text()):
        found = Judgement(**item)
        if found.digest == digest and found.fits(form, exact, ctx, variants):
            return found
    return None


def record(judgement: Judgement) -> Judgement:
    """Keep `judgement` (replacing one of the same form, arithmetic, context and variants)."""
    path = _file(judgement.digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = [j for j in (json.loads(path.read_text()) if path.exists() else [])
            if not Judgement(**j).fits(judgement.form, judgement.exact, judgement.context, judgement.variants)]
    path.write_text(json.dumps([*kept, asdict(judgement)], indent=1) + "\n")
    return judgement


def judge(kind, fp32: Path, form: str, model: Path, exact: bool, variants: Sequence[str] | None = None,
          digest: str | None = None, log: Callable[[str], None] = print, known: Judgement | None = None
          ) -> Judgement:
    """`model` (a file) on the test split in the arithmetic `exact` asks for and, with `variants` (served form), its
    speed against FP32 at the served batch sizes; a judgement already made of the same bytes is reused instead:
    `known`, this build's search's, handed on in memory, else one kept by an earlier build."""
    from tritonkit.int8.evaluate import Evaluator
    from tritonkit.int8.speed import speedup

    digest = digest or digest_of(model)
    ctx = context(kind, fp32)
    same = known is not None and known.digest == digest and known.fits(form, exact, ctx, variants)
    found = known if same else lookup(digest, form, exact, ctx, variants)
    if found is not None:
        log(f"{kind.NAME}: {form} INT8 {digest[:12]} judged already (by the {found.by}, on this CPU): not "
            "measured again")
        return found
    test = Evaluator(kind, fp32, "test").metrics(model, exact=exact)
    speed = speedup(kind, fp32, model, kind.SPEED_BATCHES, variants=tuple(variants),
                    separate_from=kind.SPEED_TARGET.value) if variants else {}
    return record(Judgement(digest, form, exact, ctx, test, speed, list(variants or [])))


def exact_judgement() -> bool:
    """Whether INT8 accuracy is judged in a session that asks for exact int32 sums (evaluate.session(exact=True)):
    wherever this CPU's u8s8 kernels do not sum exactly (no VNNI). Both forms are then judged in the arithmetic every
    served session computes on every class, as TensorRT sums too; with VNNI the plain session is that."""
    return not envinfo.int8_sums_exact()

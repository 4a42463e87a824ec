"""A CPU class's INT8 proof made where the user builds: the last stage's record for a class with no committed entry.

A replica serves INT8 only where its CPU class proved it. A class with no served entry of its own in the recipe file
borrows a donor class's recipe (tritonkit.int8.recipe.load_recipes); the build replays it and judges it on this CPU
(exact arithmetic, this CPU's floor, the speed gate against this CPU's FP32). `write` keeps that outcome under
build/proofs/<name>.json for this machine only; `valid` gives it back to the embedded server's replica view
(tritonkit.repository.replica.record(local=True)) while the CPU class, the packages and the served file's bytes are
the ones it judged. The NGC views, the container supervisor and the Kubernetes manifests read committed proofs only.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tritonkit import envinfo, paths
from tritonkit.int8.params import file_digest

DIR = "proofs"


@dataclass
class Proof:
    model: str
    cpu_class: str
    donor: str  # the class whose recipe was replayed
    status: str  # "passed" (INT8 serves) or "fp32-fallback"
    reason: str
    recipe: dict | None
    variant: str  # the runtime variant its INT8 was judged and timed on
    sha256: str  # of the served file it judged
    packages: dict
    cpu: str
    date: str


def path(kind) -> Path:
    return paths.BUILD_OUTPUTS / DIR / f"{kind.NAME}.json"


def write(kind, donor: str, status: str, reason: str, recipe: dict | None, variant: str, served: Path) -> Proof:
    proof = Proof(kind.NAME, envinfo.int8_class(), donor, status, reason, recipe, variant, file_digest(served),
                  envinfo.versions(), envinfo.cpu_model(), datetime.date.today().isoformat())
    out = path(kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(proof), indent=1, sort_keys=True) + "\n")
    return proof


def forget(kind) -> None:
    """A build whose class now has its own entry (or whose replay failed) leaves no proof behind."""
    path(kind).unlink(missing_ok=True)


def valid(kind, served: Path) -> tuple[Proof | None, str]:
    """(this machine's proof for `kind`, "") while it speaks for `served` here, else (None, why not)."""
    file = path(kind)
    if not file.exists():
        return None, f"no proof made on this machine ({paths.rel(file)})"
    proof = Proof(**json.loads(file.read_text()))
    if proof.cpu_class != envinfo.int8_class():
        return None, f"{paths.rel(file)} was made on a {proof.cpu_class} CPU"
    if proof.packages != envinfo.versions():
        return None, f"{paths.rel(file)} was made with other package versions: rebuild"
    if not Path(served).exists() or proof.sha256 != file_digest(served):
        return None, f"{paths.rel(file)} judged another file than {paths.rel(Path(served))}: rebuild"
    return proof, ""

"""Before `make serve` starts tritonserver: one line per problem a newcomer can cause, with the command that
fixes it, instead of tritonserver's start-up table.

    python -m tritonkit.runtime.preflight [--models a,b] [--http-port 8000 ...]  # prints the models to load or exits 2

Checks: setup done; generated configs match their specs; which spec'd models are built (unbuilt ones are left
out and named; none built is an error); builds current with the checkout (a `git pull` that changed a spec or the
code behind a build); INT8 reports passed and made with this package set and CPU; ports free.
"""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tritonkit import paths


@dataclass
class Preflight:
    models: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _built(kind) -> list[str]:
    """Missing build outputs of a spec'd model (empty: built)."""
    from tritonkit.repository import generate

    wanted = [paths.model_file(kind.FP32_MODEL), paths.model_file(kind.INT8_MODEL)]
    # Every labels file the kind's layout names: Triton refuses to load a model whose label_filename is missing.
    wanted += [paths.MODEL_REPOSITORY / e.config.name / t.label_filename for e in generate.repository(kind)
               for t in e.config.outputs if t.label_filename]
    return [paths.rel(p) for p in wanted if not p.exists()]


def _stale(kind) -> bool:
    """True when the spec or the code behind its FP32 export changed since it was built."""
    from tritonkit import fingerprint

    stamp = fingerprint.stage(kind, "fp32")
    return not fingerprint.up_to_date(paths.model_file(kind.FP32_MODEL), kind.NAME, "fp32", stamp)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check(ports: dict[str, int], host: str = "127.0.0.1", requested: list[str] | None = None,
          specs: bool = True) -> Preflight:
    """`specs`: check the spec'd models of the project's repository (off for another --model-repository)."""
    from tritonkit import kinds
    from tritonkit.int8 import report
    from tritonkit.repository import generate

    out = Preflight()
    if not (paths.BACKEND_DIR / "python" / "libtriton_python.so").exists():
        out.errors.append(f"setup is incomplete ({paths.rel(paths.BACKEND_DIR)} not prepared): run `make setup`")
        return out
    if not specs:
        _ports(out, ports, host)
        out.models = list(requested or [])
        return out
    stale = generate.stale()
    if stale:
        out.errors.append(f"{len(stale)} generated config(s) differ from their specs (e.g. {stale[0]}): run "
                          "`python -m tritonkit.repository.generate` (or `make build`)")
    for name in kinds.names():
        kind = kinds.get(name)
        members = [e.config.name for e in generate.repository(kind)]
        if requested and not set(members) & set(requested):
            continue
        missing = _built(kind)
        if missing:
            (out.errors if requested else out.notes).append(
                f"{name}: not built ({missing[0]} missing): run `make build MODEL={name}`")
            continue
        if _stale(kind):
            out.errors.append(f"{name}: its build is older than its spec or code (after a `git pull`?): run "
                              f"`make build MODEL={name}`")
            continue
        out.errors += report.served_problems(kind)
        out.models += members
    if not out.models and not out.errors:
        out.errors.append("no model is built yet: run `make build` (every spec) or `make demo`")
    _ports(out, ports, host)
    if requested:
        out.models = list(requested)
    return out


def _ports(out: Preflight, ports: dict[str, int], host: str) -> None:
    for what, port in ports.items():
        if port and not _port_free(host, port):
            flag = {"http": "HTTP_PORT", "grpc": "GRPC_PORT", "metrics": "METRICS_PORT"}.get(what, what)
            out.errors.append(f"port {port} ({what}) is in use on {host}: stop what holds it or run "
                              f"`make serve {flag}=<free port>`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonkit.runtime.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="")
    parser.add_argument("--model-repository", default=str(paths.MODEL_REPOSITORY))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    args, _ = parser.parse_known_args(argv)
    requested = [m for m in args.models.split(",") if m]
    own = Path(args.model_repository).resolve() == paths.MODEL_REPOSITORY.resolve()
    result = check({"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}, args.host,
                   requested or None, specs=own)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    for error in result.errors:
        print(f"error: {error}", file=sys.stderr)
    if result.errors:
        return 2
    print(",".join(result.models))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run tritonserver as a child and reload any model whose Python-backend stub died (the NGC container's command).

Triton 2.51 does not restart a dead stub, and nothing outside the failing requests shows it: the repository index
still says READY, `/v2/models/<m>/ready` and `/v2/health/ready` still answer 200, while every request to the model
fails with "Stub process '<instance>' is not healthy". Kubernetes probes therefore never restart such a pod. The
embedded launcher (tritonkit.runtime.server) reloads the model with its StubWatchdog; in the container this process
runs the same watchdog (tritonkit.runtime.watchdog: backoff, operators' unloads left alone) over the HTTP API:

    python3 -m tritonkit.runtime.supervisor -- tritonserver --model-repository=/models --model-control-mode=explicit ...

It forwards SIGTERM/SIGINT (Triton drains in-flight requests), exits with the server's exit code, and restricts
the repository API with the key in $TRITONKIT_CONTROL_KEY (it needs that API to reload). A repository that carries
a replica record (the NGC views: tritonkit.repository.replica.RECORD) is served through a view made for this node's
CPU class, in $TRITONKIT_REPLICA_DIR or a temporary folder: models not proven on this class serve FP32, said loudly
on stdout. Stdlib only: it runs on the container's own Python.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tritonkit.errors import SupervisorError
from tritonkit.repository import replica
from tritonkit.runtime.server import CONTROL_HEADER, RESTRICTED_APIS
from tritonkit.runtime.watchdog import StubWatchdog, TritonHttp, _stubs_of

KEY_ENV = "TRITONKIT_CONTROL_KEY"
VIEW_ENV = "TRITONKIT_REPLICA_DIR"


def option(command: Sequence[str], flag: str, default: str | None = None) -> str | None:
    """The value of `--flag=value` or `--flag value` in a tritonserver command (the last one wins, as in Triton)."""
    value = default
    for i, arg in enumerate(command):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(command):
            value = command[i + 1]
    return value


def restricted_command(command: Sequence[str], key: str | None) -> tuple[list[str], str]:
    """(command, key): the repository/trace/logging APIs restricted to callers sending `tritonkit-key: <key>`.
    A command that already restricts them keeps its own key; otherwise $TRITONKIT_CONTROL_KEY is required,
    because an unrestricted repository API would let any client load or unload models."""
    http = option(command, "--http-restricted-api")
    if http:
        prefix = f"{RESTRICTED_APIS}:{CONTROL_HEADER}="
        if not http.startswith(prefix):
            raise SupervisorError(f"--http-restricted-api must be '{prefix}<key>' for reloads, not '{http}'")
        return list(command), http[len(prefix):]
    if not key:
        raise SupervisorError(f"set {KEY_ENV}: the repository API that reloads models must not be left open")
    restricted = f"{RESTRICTED_APIS}:{CONTROL_HEADER}={key}"
    return [*command, f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"], key


def replica_command(command: Sequence[str], view_dir: str | None = None) -> tuple[list[str], list]:
    """(command, decisions): the command reading this CPU's view of its repository when the repository carries a
    replica record (its --model-repository replaced), else the command as given and no decisions."""
    source = option(command, "--model-repository")
    data = replica.read_record(Path(source)) if source else None
    if data is None:
        return list(command), []
    dest = Path(view_dir or os.environ.get(VIEW_ENV) or tempfile.mkdtemp(prefix="tritonkit-replica-"))
    decisions = replica.view(Path(source), dest, data)
    out, skip = [], False
    for arg in command:  # every spelling of the flag goes; the view's path is the one left
        if skip:
            skip = False
        elif arg == "--model-repository":
            skip = True
        elif not arg.startswith("--model-repository="):
            out.append(arg)
    return [*out, f"--model-repository={dest}"], decisions


# A container's models can be large and its node busy: reloads keep the 300 s the supervisor always gave them.
RELOAD_TIMEOUT_S = 300.0


def supervise(command: Sequence[str], key: str | None = None, poll_s: float = 0.5) -> int:
    """Start the server, watch its stubs with the launcher's StubWatchdog until it exits; returns its exit code."""
    command, key = restricted_command(command, key if key is not None else os.environ.get(KEY_ENV))
    command, decisions = replica_command(command)
    for line in replica.describe(decisions):
        print(f"supervisor: {line}", flush=True)
    mode = option(command, "--model-control-mode", "none")
    # The server leads its own process group, so its stubs can be found (and cleared) by group.
    proc = subprocess.Popen(command, start_new_session=True)
    address = option(command, "--http-address", "127.0.0.1")
    host = "127.0.0.1" if address in ("0.0.0.0", "::", "") else address
    server = TritonHttp(f"{host}:{option(command, '--http-port', '8000')}", key, proc)

    def forward(signum, _frame):
        server.process = None  # draining: the watchdog stops, stubs leaving now are not crashes
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    watchdog: StubWatchdog | None = None
    if mode != "explicit":
        print(f"supervisor: --model-control-mode={mode} cannot reload models; dead stubs stay dead", flush=True)
    while proc.poll() is None:
        time.sleep(poll_s)
        # Started once ready, as the launcher starts it: every model loaded at startup has its stubs by then.
        if watchdog is None and mode == "explicit" and server.process is proc and server.is_ready():
            watchdog = StubWatchdog(server, poll_s, RELOAD_TIMEOUT_S)
            watchdog.start(proc)
            stubs = _stubs_of(proc.pid)
            models = sorted({m for _, m in stubs.values()})
            print(f"supervisor: watching {len(stubs)} stub(s) of {', '.join(models) or 'no model'}", flush=True)
    # Stubs normally leave with the server; a crashed server can leave them behind.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--poll-s", type=float, default=0.5, help="seconds between stub checks")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- tritonserver ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the server command after --")
    try:
        return supervise(command, poll_s=args.poll_s)
    except SupervisorError as err:
        print(f"supervisor: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

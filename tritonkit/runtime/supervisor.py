"""Run tritonserver as a child and reload any model whose Python-backend stub died (the NGC container's command).

Triton 2.51 does not restart a dead stub, and nothing outside the failing requests shows it: the repository index
still says READY, `/v2/models/<m>/ready` and `/v2/health/ready` still answer 200, while every request to the model
fails with "Stub process '<instance>' is not healthy". Kubernetes probes therefore never restart such a pod. The
embedded launcher (tritonkit.runtime.server) reloads the model itself; in the container this process does the same:

    python3 -m tritonkit.runtime.supervisor -- tritonserver --model-repository=/models --model-control-mode=explicit ...

It forwards SIGTERM/SIGINT (Triton drains in-flight requests), exits with the server's exit code, and restricts
the repository API with the key in $TRITONKIT_CONTROL_KEY (it needs that API to reload). Stdlib only: it runs on
the container's own Python.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from tritonkit.errors import SupervisorError
from tritonkit.runtime.server import CONTROL_HEADER, RESTRICTED_APIS, _stubs_of

KEY_ENV = "TRITONKIT_CONTROL_KEY"
# instance name -> (pid, model name), as tritonkit.runtime.server._stubs_of reports a server's Python-backend stubs.
Stubs = Mapping[str, tuple[int, str]]


def vanished_models(known: Stubs, live: Stubs) -> set[str]:
    """Models with a stub instance that was running and is gone. An instance that is back under a new pid was
    reloaded by someone (the API, us) and is not a crash."""
    return {model for instance, (_pid, model) in known.items() if instance not in live}


def models_to_reload(vanished: set[str], index: Mapping[str, str]) -> list[str]:
    """Of the models whose stub vanished, those the repository still lists as READY. A model unloaded on purpose
    (UNAVAILABLE, or gone from the index) is left alone."""
    return sorted(m for m in vanished if index.get(m) == "READY")


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


class Watcher:
    """Polls one server's stubs; reloads through the restricted repository API. `tick()` is one poll."""

    def __init__(self, server_pid: int, http_url: str, key: str, log=print) -> None:
        self.server_pid, self.http_url, self.key, self.log = server_pid, http_url, key, log
        self.known: dict[str, tuple[int, str]] | None = None
        self.reloads: list[dict] = []
        # A model whose reload failed is tried again, but not more often than this (a broken model stays broken).
        self.retry_s = 30.0
        self._not_before: dict[str, float] = {}

    def _request(self, path: str, data: bytes | None = None, timeout_s: float = 5.0) -> bytes:
        request = urllib.request.Request(
            f"http://{self.http_url}{path}", data=data, method="GET" if data is None else "POST",
            headers={CONTROL_HEADER: self.key, "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()

    def ready(self) -> bool:
        try:
            self._request("/v2/health/ready", timeout_s=2.0)
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def index(self) -> dict[str, str]:
        """Model name -> state of its newest listed version, from the repository index."""
        entries = json.loads(self._request("/v2/repository/index", b"{}"))
        return {e["name"]: e.get("state", "") for e in entries}

    def tick(self) -> list[str]:
        """One poll; returns the models reloaded."""
        ready = self.ready()
        if self.known is None:
            # The first snapshot waits for readiness, when every model at startup has its stubs.
            if ready:
                self.known = _stubs_of(self.server_pid)
                models = sorted({m for _, m in self.known.values()})
                self.log(f"supervisor: watching {len(self.known)} stub(s) of {', '.join(models) or 'no model'}")
            return []
        vanished = vanished_models(self.known, _stubs_of(self.server_pid))
        if vanished and not ready:
            return []  # draining or too busy to answer: keep the old snapshot so the crash is seen next tick
        reloaded, failed = [], set()
        now = time.monotonic()
        due = {m for m in vanished if self._not_before.get(m, 0.0) <= now}
        if due:
            try:
                todo = models_to_reload(due, self.index())
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as err:
                self.log(f"supervisor: repository index unavailable ({err}); retrying")
                return []
            for model in todo:
                started = time.monotonic()
                try:
                    self._request(f"/v2/repository/models/{model}/load", b"{}", timeout_s=300.0)
                    outcome = "reloaded"
                    reloaded.append(model)
                except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
                    outcome = f"reload failed: {err}; next try in {self.retry_s:.0f}s"
                    failed.add(model)
                    self._not_before[model] = time.monotonic() + self.retry_s
                seconds = round(time.monotonic() - started, 2)
                self.reloads.append({"model": model, "outcome": outcome, "seconds": seconds})
                self.log(f"supervisor: stub of '{model}' died; {outcome} in {seconds}s")
        # Dead instances of models whose reload failed or waits for its retry time stay known, to be tried again.
        retry = failed | (vanished - due)
        pending = {i: s for i, s in self.known.items() if s[1] in retry}
        self.known = {**pending, **_stubs_of(self.server_pid)}
        return reloaded


def supervise(command: Sequence[str], key: str | None = None, poll_s: float = 0.5) -> int:
    """Start the server, watch its stubs until it exits; returns its exit code."""
    command, key = restricted_command(command, key if key is not None else os.environ.get(KEY_ENV))
    mode = option(command, "--model-control-mode", "none")
    # The server leads its own process group, so its stubs can be found (and cleared) by group.
    proc = subprocess.Popen(command, start_new_session=True)
    stopping = False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    if mode != "explicit":
        print(f"supervisor: --model-control-mode={mode} cannot reload models; dead stubs stay dead", flush=True)
    address = option(command, "--http-address", "127.0.0.1")
    host = "127.0.0.1" if address in ("0.0.0.0", "::", "") else address
    watcher = Watcher(proc.pid, f"{host}:{option(command, '--http-port', '8000')}", key,
                      log=lambda line: print(line, flush=True))
    while proc.poll() is None:
        time.sleep(poll_s)
        if not stopping and mode == "explicit" and proc.poll() is None:
            watcher.tick()
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

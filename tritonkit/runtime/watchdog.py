"""The stub watchdog: Triton 2.51 never restarts a Python-backend stub that died (kill -9, OOM killer) and keeps
reporting its model READY. The watchdog reloads such a model, leaves alone what operators do through the
repository API, retries a failed reload with backoff, and reports every action (log, stdout, a counter).

One watchdog for the launcher (tritonkit.runtime.server) and the container's supervisor, which runs it on the NGC
image's own Python: keep this module stdlib only."""

from __future__ import annotations

import collections
import contextlib
import http.server
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Protocol

from tritonkit.errors import RepositoryCallError

# The header that opens Triton's restricted APIs (--http-restricted-api), the repository API among them.
CONTROL_HEADER = "tritonkit-key"


class Watched(Protocol):
    """What the watchdog uses of the server it watches: tritonkit.runtime.server.TritonServer (the launcher) or
    TritonHttp (the container's supervisor). The watchdog stops when `process` is no longer the one it watches."""

    host: str
    http_url: str
    process: subprocess.Popen | None
    _log: IO[bytes] | None

    def model_states(self) -> dict[str, tuple[str, str]]: ...

    def model_config(self, model: str) -> dict: ...

    def load_model(self, model: str, timeout_s: float = 120.0, config: dict | None = None) -> None: ...


class TritonHttp:
    """A tritonserver through its HTTP API: `Watched` for the supervisor, and the repository calls TritonServer
    makes. `control_key` opens the restricted repository API."""

    _log = None  # the server's output is this process's stdout, where the watchdog prints its lines already

    def __init__(self, http_url: str, control_key: str, process: subprocess.Popen | None = None):
        self.http_url, self.control_key, self.process = http_url, control_key, process
        self.host = http_url.rpartition(":")[0]

    def _post(self, path: str, body: dict, timeout_s: float) -> bytes:
        request = urllib.request.Request(
            f"http://{self.http_url}{path}", data=json.dumps(body).encode(), method="POST",
            headers={CONTROL_HEADER: self.control_key, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as err:  # Triton says why in a JSON body: pass it on, not just the status
            body = err.read().decode(errors="replace")
            try:
                reason = json.loads(body).get("error", body)
            except ValueError:
                reason = body
            raise RepositoryCallError(f"POST {path}: HTTP {err.code}: {reason.strip() or err.reason}") from None

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def model_config(self, model: str) -> dict:
        """The config `model` is served with, as Triton reports it (JSON)."""
        with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{model}/config", timeout=10) as r:
            return json.load(r)

    def load_model(self, model: str, timeout_s: float = 120.0, config: dict | None = None) -> None:
        """(Re)load a model through the restricted repository API, optionally with a config override."""
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else {}
        self._post(f"/v2/repository/models/{model}/load", body, timeout_s)

    def model_states(self) -> dict[str, tuple[str, str]]:
        """Model name → (state, reason) from the restricted repository index (a READY version wins)."""
        states: dict[str, tuple[str, str]] = {}
        for entry in json.loads(self._post("/v2/repository/index", {}, 10.0)):
            state = (entry.get("state", ""), entry.get("reason", ""))
            if entry["name"] not in states or state[0] == "READY":
                states[entry["name"]] = state
        return states


def _stubs_of(server_pid: int) -> dict[str, tuple[int, str]]:
    """Stub processes in the server's process group, from /proc: instance name → (pid, model name).

    A stub's argv is: stub, <repo>/<model>/<version>/<file>, shm region, sizes, parent pid, backend dir, ...,
    instance name (`<model>_<group>_<index>`), ...; the model name is read from the path.
    """
    stubs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) != server_pid:
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if argv and argv[0].endswith("triton_python_backend_stub") and len(argv) > 8:
            model = Path(argv[1]).parent.parent.name
            instance = next((a for a in argv[2:] if a.startswith(f"{model}_")), None)
            if instance is not None:  # None: the short-lived stub a load starts to auto-complete the config
                stubs[instance] = (int(entry), model)
    return stubs


class StubWatchdog:
    """Watches one server's stubs from a daemon thread (`start`), looking every `poll_s` seconds."""

    def __init__(self, server: Watched, poll_s: float = 0.5, reload_timeout_s: float = 120.0):
        self.server, self.poll_s, self.reload_timeout_s = server, poll_s, reload_timeout_s
        self.recoveries: list[dict] = []
        self.counts: collections.Counter = collections.Counter()
        self._reloads = 0
        self._thread: threading.Thread | None = None
        self._metrics_httpd: http.server.ThreadingHTTPServer | None = None

    @property
    def watching(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, process: subprocess.Popen) -> None:
        # Snapshot the stubs before start() returns, so a stub that dies at once is still seen as a crash.
        known = _stubs_of(process.pid)
        self._thread = threading.Thread(target=self._watch_stubs, args=(process, known), daemon=True)
        self._thread.start()

    def _reload_crashed(self, model: str) -> None:
        """Restart a READY model's instances. A plain load of a READY model whose files did not change is only a
        config update in Triton 2.51 (no instance restarts, the dead stub stays dead), so the served config is
        loaded back with a changed `tritonkit_reload` parameter, which forces a full reload."""
        config, server = None, self.server
        if server.model_states().get(model, ("",))[0] == "READY":  # else (a failed reload) a plain load is full
            config = server.model_config(model)
            self._reloads += 1
            config.setdefault("parameters", {})["tritonkit_reload"] = {"string_value": str(self._reloads)}
        server.load_model(model, self.reload_timeout_s, config=config)
        if server.process is not None and not any(m == model for _, m in _stubs_of(server.process.pid).values()):
            raise RuntimeError("the load returned but the model has no live stub")

    def _report(self, model: str, action: str, detail: str = "") -> None:
        """One watchdog action: to stdout, to the server's log, and to the watchdog counters."""
        self.counts[(model, action)] += 1
        line = f"watchdog: model '{model}': {action}{': ' + detail if detail else ''}"
        print(line, flush=True)
        log = self.server._log
        with contextlib.suppress(Exception):  # the log is closed while stopping
            if log is not None:
                log.write(f"{time.strftime('%H:%M:%S')} {line}\n".encode())
                log.flush()

    def _watch_stubs(self, process: subprocess.Popen, known: dict[str, tuple[int, str]]) -> None:
        """Reload a model whose stub crashed; leave alone what operators do through the repository API.

        A stub that is gone while the index still says its model is READY crashed (confirmed on a second look,
        one poll later). A stub gone with its model UNLOADING/UNAVAILABLE/LOADING was unloaded or is being
        reloaded through the API: the model is dropped from watch and picked up again when its new stubs appear.
        A failed reload is retried with exponential backoff (1 s doubling to 60 s) until it loads or an operator
        unloads or reloads the model. Readiness is not consulted: one unavailable model makes the whole server
        not ready (strict readiness), and other models' crashes must still be handled then.
        """
        suspects: set[str] = set()  # instances missing at the last look
        retry: dict[str, tuple[int, float]] = {}  # model → (failed reloads, when to try again)
        while self.server.process is process and process.poll() is None:
            time.sleep(self.poll_s)
            if self.server.process is not process:
                return
            live = _stubs_of(process.pid)
            for instance, (pid, model) in live.items():
                if known.get(instance, (None,))[0] != pid:
                    known[instance] = (pid, model)  # new stubs: a load through the API (ours or an operator's)
            missing = {i for i in known if i not in live}
            if not missing and not retry:
                suspects.clear()
                continue
            try:
                states = self.server.model_states()
            except Exception:  # too busy to answer or going down: look again next tick, forgetting nothing
                continue
            crashed: set[str] = set()
            for instance in sorted(missing):
                model = known[instance][1]
                state, reason = states.get(model, ("", ""))
                if state == "READY" and model not in retry:
                    if instance in suspects:
                        crashed.add(model)
                    continue
                del known[instance]  # unloaded or being (re)loaded through the API: not ours to undo
                if model not in retry:
                    self._report(model, "left_to_operator", f"stub gone while the model is {state or 'absent'}"
                                 + (f" ({reason})" if reason else ""))
            suspects = missing & set(known)
            for model in sorted(crashed):
                for instance in [i for i, (_, m) in known.items() if m == model]:
                    del known[instance]
                self._report(model, "crash_detected", "stub process gone while the model is READY")
                retry[model] = (0, 0.0)
            for model, (failures, due) in sorted(retry.items()):
                state, reason = states.get(model, ("", ""))
                if failures and ((state == "READY" and any(m == model for _, m in live.values()))
                                 or (state == "UNAVAILABLE" and reason == "unloaded")):
                    del retry[model]  # an operator reloaded or unloaded it meanwhile
                    self._report(model, "left_to_operator", f"model is {state} after an operator's action")
                    continue
                if time.monotonic() < due:
                    continue
                started = time.monotonic()
                try:
                    self._reload_crashed(model)
                except Exception as err:  # the watchdog must outlive any one failed reload
                    if self.server.process is not process:
                        return  # shutting down: stubs exit with the server
                    delay = min(60.0, 2.0**failures)
                    retry[model] = (failures + 1, time.monotonic() + delay)
                    self._report(model, "reload_failed", f"attempt {failures + 1}: {err}; next try in {delay:.0f}s")
                    self.recoveries.append({"model": model, "outcome": f"reload failed: {err}",
                                            "seconds": round(time.monotonic() - started, 2)})
                    continue
                del retry[model]
                seconds = round(time.monotonic() - started, 2)
                self.recoveries.append({"model": model, "outcome": "reloaded", "seconds": seconds})
                self._report(model, "reloaded", f"in {seconds}s after {failures} failed attempt(s)")

    def metrics(self) -> str:
        """The watchdog's counters in Prometheus text format (served by serve_watchdog_metrics)."""
        lines = ["# HELP tritonkit_watchdog_actions_total Stub watchdog actions by model: crash_detected, reloaded, "
                 "reload_failed, left_to_operator", "# TYPE tritonkit_watchdog_actions_total counter"]
        for (model, action), count in sorted(self.counts.items()):
            lines.append(f'tritonkit_watchdog_actions_total{{model="{model}",action="{action}"}} {count}')
        return "\n".join(lines) + "\n"

    def serve_metrics(self, port: int, host: str | None = None) -> int:
        """Serve `watchdog_metrics()` at http://host:port/metrics from a daemon thread; returns the port."""
        watchdog = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = watchdog.metrics().encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes would flood stdout
                pass

        httpd = http.server.ThreadingHTTPServer((host or self.server.host, port), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        self.close_metrics()  # one listener per watchdog: a second call replaces the first
        self._metrics_httpd = httpd
        return httpd.server_address[1]

    def close_metrics(self) -> None:
        """Stop serving the counters and free the port (the server's stop calls it)."""
        httpd, self._metrics_httpd = self._metrics_httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()

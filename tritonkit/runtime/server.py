"""Launch the embedded tritonserver (the 2.51 binary bundled in the nvidia-pytriton wheel).

We use none of PyTriton's API: only its server binary, shared libraries and Python-backend stubs.
`TritonServer` is used by `make serve`, the demo, benchmarks and the test fixture alike.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tritonkit import paths
from tritonkit.errors import ServerStartError, SetupError
from tritonkit.runtime.backend_dir import (  # noqa: F401 - the launcher's public names
    STUB_PRELOAD_VAR,
    STUB_WRAPPER,
    prepare_backend_dir,
    server_binary,
    triton_home,
)
from tritonkit.runtime.watchdog import CONTROL_HEADER, StubWatchdog, TritonHttp, _stubs_of

# Endpoints that change what the server serves or how it logs: only callers holding the control key may use them.
RESTRICTED_APIS = "model-repository,trace,logging"


def find_allocator(name: str) -> str | None:
    """The shared library to preload into tritonserver for `name` ("jemalloc"; "glibc" = none), or None when
    it is "glibc" or not installed (then glibc's malloc is used, with a warning)."""
    if name == "glibc":
        return None
    import ctypes.util

    lib = ctypes.util.find_library(name)
    if lib is None:
        print(f"warning: allocator {name} not found (Debian: apt-get install libjemalloc2); tritonserver uses "
              "glibc malloc, which keeps the memory of a request backlog after it drains", file=sys.stderr)
    return lib


def server_env(base: dict[str, str] | None = None, preload: str | None = None) -> dict[str, str]:
    """Environment for tritonserver: bundled libs + libpython, the venv's bin/ first on PATH, and `preload`
    (an allocator library) for the server process only.

    The Python backend stub resolves `python3` packages through PATH; without the venv first, `import numpy`
    fails inside model.py. The stubs inherit this environment; our stub wrapper (prepare_backend_dir) gives
    them back the caller's LD_PRELOAD.
    """
    env = dict(os.environ if base is None else base)
    if preload:
        env[STUB_PRELOAD_VAR] = env.get("LD_PRELOAD", "")
        env["LD_PRELOAD"] = " ".join(p for p in (preload, env.get("LD_PRELOAD", "")) if p)
        # jemalloc returns freed pages after its decay time only when it runs: a background thread does it
        # while the server idles after a burst, not at its next allocation.
        env.setdefault("MALLOC_CONF", "background_thread:true")
    libs = [
        str(triton_home().parent.parent / "nvidia_pytriton.libs"),
        sysconfig.get_config_var("LIBDIR") or "",
    ]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    env["PATH"] = f"{paths.venv_bin()}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(paths.ROOT), env.get("PYTHONPATH", "")) if p)
    # Thread pools inside every stub would otherwise each spawn one thread per core.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def write_secret(path: Path, text: str) -> Path:
    """Write `text` to `path` readable by its owner only (mode 0600, also when the file existed with a looser
    mode), atomically: a reader sees the old content or the new, never a partial key."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_secret(path: Path) -> str:
    key = Path(path).read_text().strip()
    if not key:
        raise SetupError(f"control key file {path} is empty")
    return key


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports: every socket stays bound until all are read, so the kernel cannot hand one twice."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


@dataclass
class TritonServer:
    """One tritonserver process. Use as a context manager; `stop()` leaves no stub processes behind."""

    model_repository: Path = paths.MODEL_REPOSITORY
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    backend_dir: Path = paths.BACKEND_DIR
    # Explicit control (so a crashed stub's model can be reloaded); `models` empty = every model this server can
    # serve (TensorRT ones are left to the NGC container).
    model_control_mode: str = "explicit"
    models: list[str] = field(default_factory=list)
    # Header `tritonkit-key: <key>` is required by the model-repository, trace and logging endpoints (Triton's
    # restricted APIs). A random key per start unless given; None or "" is never used, so they are never open.
    control_key: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    # Reload a model whose Python-backend stub died (Triton 2.51 marks it unhealthy but never restarts it).
    recover_crashed_stubs: bool = True
    exit_timeout_s: int = 30
    # malloc for the tritonserver process ("glibc" = the system's). glibc keeps what a backlog of queued tensors
    # took (perf/bench_overload.py: 2.8 GiB still held once the backlog had drained); jemalloc went back to
    # ~150 MiB. Stubs are not affected (STUB_WRAPPER).
    allocator: str = "jemalloc"
    extra_args: list[str] = field(default_factory=list)
    log_verbose: int = 0
    # Named config profile (`make tune` output): models with configs/<profile>.pbtxt use it instead of config.pbtxt.
    profile: str = ""
    log_path: Path | None = None
    # Serve what this CPU's class proved (tritonkit.repository.replica): a view of the repository made at start, from
    # its record file or from `replica_kinds` (default: every spec); `make serve` and the demo do.
    per_replica: bool = False
    replica_kinds: list | None = None
    replica_decisions: list = field(default_factory=list, init=False, repr=False)
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @classmethod
    def on_free_ports(cls, **kwargs) -> TritonServer:
        # Drawn together: one bind at a time, each socket closed before the next, may hand a port out twice.
        http_port, grpc_port, metrics_port = free_ports(3)
        return cls(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, **kwargs)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def served_repository(self) -> Path:
        """The folder tritonserver reads: the replica view once started with per_replica, else model_repository."""
        return getattr(self, "_view", None) or Path(self.model_repository)

    def replica_view(self) -> Path:
        """Write this CPU's view of the repository into a fresh temporary folder and say what it serves."""
        from tritonkit.repository import replica

        source = Path(self.model_repository)
        data = replica.read_record(source)
        if data is None:
            from tritonkit import kinds

            specs = self.replica_kinds if self.replica_kinds is not None else [kinds.get(n) for n in kinds.names()]
            data = replica.record(specs, source, local=True)  # this machine's proofs count here only
        self._view = Path(tempfile.mkdtemp(prefix="tritonkit-replica-"))
        self.replica_decisions = replica.view(source, self._view, data)
        for line in replica.describe(self.replica_decisions):
            print(line, file=sys.stderr, flush=True)
        return self._view

    def command(self) -> list[str]:
        cmd = [
            str(server_binary()),
            f"--model-repository={self.served_repository.resolve()}",
            f"--backend-directory={Path(self.backend_dir).resolve()}",
            # The wheel's response-cache implementations (`--cache-config local,size=...` needs them).
            f"--cache-directory={triton_home() / 'caches'}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=true",
            "--strict-readiness=true",
            # p50/p90/p99 summaries per model on the metrics port (dashboards, perf reports).
            "--metrics-config=summary_latencies=true",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--model-control-mode={self.model_control_mode}",
            f"--log-verbose={self.log_verbose}",
            # Larger shared-memory arenas avoid regrowth on every big batch between server and stubs.
            "--backend-config=python,shm-default-byte-size=8388608",
            "--backend-config=python,shm-growth-byte-size=8388608",
        ]
        if self.profile:
            cmd.append(f"--model-config-name={self.profile}")
        cmd += [f"--load-model={m}" for m in self.models]
        if not self.control_key:
            self.control_key = secrets.token_urlsafe(18)
        restricted = f"{RESTRICTED_APIS}:{CONTROL_HEADER}={self.control_key}"
        cmd += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
        return cmd + list(self.extra_args)

    def start(self, timeout_s: float = 180.0) -> TritonServer:
        if self.process is not None and self.process.poll() is None:  # a second process would orphan the first
            raise ServerStartError(f"tritonserver is already running (pid {self.process.pid}): stop() it first; "
                                   "`with TritonServer(...)` starts it already")
        prepare_backend_dir(Path(self.backend_dir))
        from tritonkit.repository.native_check import embedded_models

        if self.per_replica:
            self.replica_view()
        served, skipped = embedded_models(self.served_repository)
        if self.model_control_mode == "none" and skipped:
            self.model_control_mode = "explicit"
        if self.model_control_mode == "explicit" and not self.models:
            self.models = served
        if skipped:
            print(f"embedded server: leaving TensorRT models to the NGC container: {', '.join(skipped)}")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
            self._temp_log = True
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        # A new session makes the server the leader of a process group that also holds its stubs.
        self.process = subprocess.Popen(
            self.command(), env=server_env(preload=find_allocator(self.allocator)), stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        # A crashed caller must not leave a server (and its stubs) running.
        atexit.register(self.stop)
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.watchdog = StubWatchdog(self)
        if self.recover_crashed_stubs and self.model_control_mode == "explicit":
            self.watchdog.start(self.process)
        return self

    @property
    def recoveries(self) -> list[dict]:
        return self.watchdog.recoveries

    @property
    def watchdog_counts(self):
        return self.watchdog.counts

    def watchdog_metrics(self) -> str:
        return self.watchdog.metrics()

    def serve_watchdog_metrics(self, port: int, host: str | None = None) -> int:
        return self.watchdog.serve_metrics(port, host)

    def stub_processes(self) -> dict[str, tuple[int, str]]:
        """Live Python-backend stubs of this server: instance name → (pid, model name)."""
        return {} if self.process is None else _stubs_of(self.process.pid)

    @property
    def api(self) -> TritonHttp:
        """This server's HTTP API, the same client the container's supervisor watches through."""
        return TritonHttp(self.http_url, self.control_key, self.process)

    def load_model(self, model: str, timeout_s: float = 120.0, config: dict | None = None) -> None:
        """(Re)load a model through the restricted repository API, optionally with a config override."""
        self.api.load_model(model, timeout_s, config)

    def model_states(self) -> dict[str, tuple[str, str]]:
        """Model name → (state, reason) from the restricted repository index (a READY version wins)."""
        return self.api.model_states()

    def model_config(self, model: str) -> dict:
        return self.api.model_config(model)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ServerStartError(
                    f"tritonserver exited with code {self.process.returncode}:\n{self.log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(0.25)
        raise ServerStartError(f"tritonserver not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def is_ready(self) -> bool:
        return self.api.is_ready()

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (Triton drains in-flight requests), then SIGKILL whatever is left of the group."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        timeout_s = self.exit_timeout_s + 15 if timeout_s is None else timeout_s
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Stubs normally exit with the server; a crashed server can leave them, so clear the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if getattr(self, "watchdog", None) is not None:  # its counters' port closes with the server
            self.watchdog.close_metrics()
        if getattr(self, "_log", None):
            self._log.close()
        view, self._view = getattr(self, "_view", None), None
        if view is not None:
            shutil.rmtree(view, ignore_errors=True)
        # A log we chose is kept only when the server did not exit cleanly (it is what explains the failure).
        if getattr(self, "_temp_log", False) and proc.returncode == 0:
            Path(self.log_path).unlink(missing_ok=True)
        return proc.returncode

    def __enter__(self) -> TritonServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve(args: argparse.Namespace) -> int:
    server = TritonServer(
        model_repository=Path(args.model_repository),
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        models=args.models.split(",") if args.models else [],
        log_verbose=args.log_verbose,
        profile=args.profile,
        log_path=Path(args.log_file) if args.log_file else None,
        extra_args=args.extra,
        allocator=args.allocator,
        per_replica=not args.as_committed,
    )
    # Never from the command line: it would be readable in `ps` (tritonserver's own flag already is; docs/security.md).
    key = read_secret(Path(args.control_key_file)) if args.control_key_file else os.environ.get("TRITONKIT_CONTROL_KEY")
    if key:
        server.control_key = key
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            print(f"\n{signal.Signals(signum).name}: draining and stopping tritonserver...", flush=True)
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        print(f"starting tritonserver over {server.model_repository} (log: {server.log_path or 'temp file'})")
        server.start(timeout_s=args.timeout)
        print(f"ready  HTTP    http://{server.http_url}")
        print(f"       gRPC    {server.grpc_url}")
        print(f"       metrics {server.metrics_url}")
        if args.watchdog_metrics_port and server.watchdog.watching:
            try:
                port = server.serve_watchdog_metrics(args.watchdog_metrics_port)
                print(f"       watchdog metrics http://{server.host}:{port}/metrics")
            except OSError as err:  # a taken port must not cost the server; the log still has every action
                print(f"warning: watchdog metrics not served on port {args.watchdog_metrics_port}: {err}",
                      file=sys.stderr)
        key_file = write_secret(Path(args.key_file), server.control_key + "\n")
        print(f"model-repository/trace/logging APIs need header '{CONTROL_HEADER}' (key in {key_file})")
        print("Ctrl-C to stop.", flush=True)
        while server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
        print(f"tritonserver exited unexpectedly:\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        code = server.stop()
        print(f"stopped (tritonserver exit code {code})")
        return 0
    except (SetupError, ServerStartError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonkit-serve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve", help="start tritonserver and wait for Ctrl-C/SIGTERM")
    p.add_argument("--model-repository", default=str(paths.MODEL_REPOSITORY))
    p.add_argument("--host", default=os.environ.get("TRITON_HOST", "127.0.0.1"), help="bind address")
    p.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    p.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    p.add_argument("--models", default="", help="comma-separated models to load (default: all)")
    p.add_argument("--control-key-file", default="",
                   help="file holding the key for the model-control endpoints (default: $TRITONKIT_CONTROL_KEY, "
                        "else a random key per start)")
    p.add_argument("--key-file", default=str(paths.BUILD_DIR / "control-key"),
                   help="where the key in use is written (mode 0600) for local tools")
    p.add_argument("--watchdog-metrics-port", type=int, default=int(os.environ.get("WATCHDOG_METRICS_PORT", 8003)),
                   help="port for the stub watchdog's Prometheus counters (0: off)")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--profile", default=os.environ.get("TRITONKIT_PROFILE", ""),
                   help="config profile: models with configs/<profile>.pbtxt use it (see `make tune`)")
    p.add_argument("--log-file", default="")
    p.add_argument("--allocator", default=os.environ.get("TRITONKIT_ALLOCATOR", "jemalloc"),
                   help="malloc for the tritonserver process: jemalloc (default) or glibc")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    p.add_argument("--as-committed", action="store_true",
                   help="serve the repository's configs as they are, not what this CPU's class proved")
    p.add_argument("extra", nargs="*", help="extra tritonserver flags after --")
    sub.add_parser("prepare-backends", help="assemble the server's backend directory")
    sub.add_parser("check", help="fail clearly if setup is incomplete")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "serve":
            return _serve(args)
        if args.cmd == "prepare-backends":
            print(f"backend directory ready: {prepare_backend_dir()}")
            return 0
        server_binary()
        if not (paths.BACKEND_DIR / "python" / "libtriton_python.so").exists():
            raise SetupError(f"backend directory {paths.BACKEND_DIR} is not prepared; run `make setup`.")
        if shutil.which("perf_analyzer", path=str(paths.venv_bin())) is None:
            raise SetupError("perf_analyzer not found in the venv; run `make setup`.")
        print("setup ok")
        return 0
    except SetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

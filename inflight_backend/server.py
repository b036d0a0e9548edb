"""Starting a real tritonserver with the `inflight` backend (found and laid out by triton_install.py): free
ports, start, wait until ready, drain, stop, and read its metrics."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from .stop_signal import STOP_FILE_ENV, SUPERVISOR_ENV
from .triton_install import ServerError, TritonInstall, find_triton, layout_backends, server_env


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_ports_free(host: str, ports: tuple[int, ...]) -> None:
    """Raise ServerError naming the first port something already listens on (its health check would answer
    for us). SO_REUSEADDR: a port held only by closed connections (TIME_WAIT) counts as free, as for Triton."""
    if len(set(ports)) != len(ports):
        raise ServerError(f"the HTTP, gRPC and metrics ports must differ, got {list(ports)}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports:
        with socket.socket(family) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
                raise ServerError(f"port {port} on {host} {why}: choose another with --http-port/--grpc-port/"
                                  "--metrics-port or stop what holds it") from None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (tritonserver then drains and exits)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for task in tasks for c in (task / "children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def read_metrics(port: int, prefix: str = "inflight_") -> dict[tuple[str, frozenset], float]:
    """Prometheus metrics from the server's metrics port, keyed (name, frozenset of label pairs)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            pairs = frozenset(tuple(p.split("=", 1)) for p in labels.rstrip("}").replace('"', "").split(",") if p)
            values[(name, pairs)] = float(value)
    return values


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


RESTRICTED_APIS = ("shared-memory", "model-repository", "logging", "trace", "model-config")
ADMIN_KEY_HEADER = "inflight-admin-key"
_STUB_NAME = "triton_python_backend_stub"
_PR_SET_PDEATHSIG = 1


class TritonServer:
    """A tritonserver process serving `model_repository` on `host` (loopback by default).

    Safe defaults: the process and its Python stubs create files readable by their user only (umask 077; the
    stubs' shared memory under /dev/shm, which python_backend makes 0644 regardless, is made 0600 once the server
    is ready); the `restricted_apis` answer only requests that carry the
    header `inflight-admin-key: <admin_key>` (a random key when none is given); tritonserver gets SIGTERM if
    the process that started it dies. `stop()` drains first: the models end every open stream, then the server
    exits."""

    def __init__(self, model_repository: str | Path, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, log_file: str | Path | None = None, verbose: int = 0,
                 host: str = "127.0.0.1", extra_args: tuple[str, ...] = (),
                 restricted_apis: tuple[str, ...] = RESTRICTED_APIS, admin_key: str | None = None) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.host = host
        self.log_file = Path(log_file) if log_file else None
        self.verbose = verbose
        self.extra_args = tuple(extra_args)
        self.restricted_apis = tuple(restricted_apis)
        self.admin_key = admin_key or secrets.token_hex(16)
        self.process: subprocess.Popen | None = None
        self._run_dir: Path | None = None
        self._shm_prefix = ""

    @property
    def local_host(self) -> str:
        """Where a client on this machine reaches the server."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host

    def command(self, install: TritonInstall) -> list[str]:
        args = [str(install.binary), f"--model-repository={self.model_repository}",
                f"--backend-directory={layout_backends(install)}",
                f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                f"--metrics-port={self.metrics_port}", f"--http-address={self.host}", f"--grpc-address={self.host}",
                f"--metrics-address={self.host}", "--allow-metrics=true", f"--log-verbose={self.verbose}",
                "--exit-on-error=true", f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}"]
        if self.restricted_apis:
            rule = f"{','.join(self.restricted_apis)}:{ADMIN_KEY_HEADER}={self.admin_key}"
            args += [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
        return args + list(self.extra_args)

    def start(self, timeout: float = 180.0) -> TritonServer:
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} does not exist")
        check_ports_free(self.host, (self.http_port, self.grpc_port, self.metrics_port))
        install = find_triton()
        self._run_dir = Path(tempfile.mkdtemp(prefix="inflight-run-"))  # 0700: the stop file lives here
        self._shm_prefix = f"inflight_{os.getpid()}_{self._run_dir.name.rsplit('-', 1)[-1]}_"
        env = server_env(install)
        env[STOP_FILE_ENV], env[SUPERVISOR_ENV] = str(self._run_dir / "stop"), str(os.getpid())
        out = open(self.log_file, "wb") if self.log_file else None
        self.process = subprocess.Popen(self.command(install), env=env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, umask=0o077, preexec_fn=_die_with_parent)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until the models are ready and the metrics endpoint answers (tritonserver starts it last, after the
        HTTP endpoint already reports ready)."""
        deadline = time.monotonic() + timeout
        host = f"[{self.local_host}]" if ":" in self.local_host else self.local_host
        urls = [f"http://{host}:{self.http_port}/v2/health/ready", f"http://{host}:{self.metrics_port}/metrics"]
        process = self.started()
        while time.monotonic() < deadline:
            if process.poll() is not None:
                self._cleanup()
                raise ServerError(f"tritonserver exited with code {process.returncode}{self.log_excerpt()}")
            while urls and _answers(urls[0]):
                urls.pop(0)
            if not urls:
                self._restrict_shared_memory()
                return
            time.sleep(0.25)
        self.kill()
        raise ServerError(f"tritonserver not ready after {timeout:.0f}s{self.log_excerpt()}")

    def started(self) -> subprocess.Popen:
        """The tritonserver process (start() has run)."""
        if self.process is None:
            raise ServerError("tritonserver was never started")
        return self.process

    def stub_pids(self) -> set[int]:
        """The live Python backend stubs (one per model instance) of this server (a dead stub stays a zombie
        child until tritonserver reaps it, which it does only when it unloads the model)."""
        if self.process is None:
            return set()
        return {pid for pid in _children(self.process.pid) if _STUB_NAME in _cmdline(pid) and _alive(pid)}

    def _restrict_shared_memory(self) -> None:
        """python_backend creates its regions 0644 whatever the umask (boost's fchmod), and they carry every
        prompt and output: make this server's 0600. (They exist from model load; this runs once all are.)"""
        for path in Path("/dev/shm").glob(self._shm_prefix + "*"):
            with contextlib.suppress(OSError):
                path.chmod(0o600)

    def drain(self) -> None:
        """Ask every model to end its open streams (each gets a final error) and refuse new requests."""
        if self._run_dir is not None and self._run_dir.exists():
            (self._run_dir / "stop").touch()

    def stop(self, timeout: float = 60.0) -> int | None:
        """Drain, then SIGTERM; SIGKILL if it has not exited after `timeout` seconds. Returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            self._cleanup()
            return None if self.process is None else self.process.returncode
        self.drain()
        self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()
        finally:
            self._cleanup()

    def kill(self) -> int:
        """SIGKILL the server and its stubs at once (a dead stub can keep tritonserver from exiting)."""
        process, stubs = self.started(), self.stub_pids()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        for pid in stubs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        code = process.wait()
        self._cleanup()
        return code

    def _cleanup(self) -> None:
        """Remove this run's stop file and any shared memory a killed server left in /dev/shm."""
        if self._shm_prefix:
            for path in Path("/dev/shm").glob(self._shm_prefix + "*"):
                with contextlib.suppress(OSError):
                    path.unlink()
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)

    def log_excerpt(self) -> str:
        """The log's error lines and last lines (empty without a log file), for a failure message."""
        if not self.log_file or not self.log_file.exists():
            return ""
        lines = self.log_file.read_text(errors="replace").splitlines()
        errors = [line for line in lines if line.startswith("E1") or "Error" in line][:10]
        # shutdown counts its exit timeout down once a second: keep the lines that say what happened
        last = [line for line in lines if ": Found " not in line][-15:]
        return ("\n--- server log: errors ---\n" + "\n".join(errors) +
                "\n--- server log: last lines ---\n" + "\n".join(last))

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

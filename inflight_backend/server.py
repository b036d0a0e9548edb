"""Starting a real tritonserver with the `inflight` backend: find the binary, lay out the backend directory,
set library and Python paths, start, wait until ready, stop."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .paths import BUILD_DIR, PROJECT_ROOT


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@dataclass(frozen=True)
class TritonInstall:
    """Where the server binary, the Python backend's files and their shared libraries are."""

    binary: Path
    python_backend: list[Path]  # libtriton_python.so, triton_python_backend_utils.py, the stub
    library_dirs: list[Path]


def find_triton() -> TritonInstall:
    """A `tritonserver` on PATH (NVIDIA's containers) wins; otherwise the one in nvidia-pytriton."""
    on_path = shutil.which("tritonserver")
    if on_path:
        prefix = Path(on_path).resolve().parent.parent
        backend = prefix / "backends" / "python"
        return TritonInstall(Path(on_path), sorted(backend.glob("*")), [])
    try:
        import pytriton
    except ImportError:
        raise ServerError("no tritonserver on PATH and nvidia-pytriton is not installed: run `make serve` "
                          "(it installs nvidia-pytriton==0.7.0) or use an NVIDIA Triton container") from None
    base = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = base / "python_backend_stubs" / version / "triton_python_backend_stub"
    backend = base / "backends" / "python"
    files = [backend / "libtriton_python.so", backend / "triton_python_backend_utils.py", stub]
    missing = [str(f) for f in [base / "bin" / "tritonserver", *files] if not f.exists()]
    if missing:
        raise ServerError(f"nvidia-pytriton is incomplete for Python {version}: missing {missing}")
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(base / "bin" / "tritonserver", files, [libs])


def layout_backends(install: TritonInstall, root: Path = BUILD_DIR / "triton" / "backends") -> Path:
    """Make `<root>/python/` (Triton's Python backend) and `<root>/inflight/model.py` (ours). Idempotent.

    Files are copied, not linked: Triton refuses a backend library whose real path leaves the directory."""
    python_dir, inflight_dir = root / "python", root / "inflight"
    python_dir.mkdir(parents=True, exist_ok=True)
    inflight_dir.mkdir(parents=True, exist_ok=True)
    copies = {python_dir / f.name: f for f in install.python_backend}
    copies[inflight_dir / "model.py"] = PROJECT_ROOT / "inflight_backend" / "model.py"
    for copy, source in copies.items():
        _copy_if_changed(source, copy)
    return root


def _copy_if_changed(source: Path, dest: Path) -> None:
    """Replace atomically (a running stub's binary cannot be overwritten in place)."""
    if dest.exists() and not dest.is_symlink() and dest.read_bytes() == source.read_bytes():
        return
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copy2(source, tmp)
    os.replace(tmp, dest)


def server_env(install: TritonInstall) -> dict[str, str]:
    """The stub runs `python3` from PATH: put this interpreter's bin first so it brings our site-packages."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    ld = [str(d) for d in install.library_dirs] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld)
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(":") if p])
    return env


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


class TritonServer:
    """A tritonserver process serving `model_repository` on loopback ports."""

    def __init__(self, model_repository: str | Path, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, log_file: str | Path | None = None, verbose: int = 0) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_file = Path(log_file) if log_file else None
        self.verbose = verbose
        self.process: subprocess.Popen | None = None

    def command(self, install: TritonInstall) -> list[str]:
        return [str(install.binary), f"--model-repository={self.model_repository}",
                f"--backend-directory={layout_backends(install)}",
                f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                f"--metrics-port={self.metrics_port}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
                "--allow-metrics=true", f"--log-verbose={self.verbose}", "--exit-on-error=true"]

    def start(self, timeout: float = 180.0) -> "TritonServer":
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} does not exist")
        install = find_triton()
        out = open(self.log_file, "wb") if self.log_file else None
        self.process = subprocess.Popen(self.command(install), env=server_env(install), stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until the models are ready and the metrics endpoint answers (tritonserver starts it last, after the
        HTTP endpoint already reports ready)."""
        deadline = time.monotonic() + timeout
        urls = [f"http://127.0.0.1:{self.http_port}/v2/health/ready", f"http://127.0.0.1:{self.metrics_port}/metrics"]
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode}{self._log_hint()}")
            while urls and _answers(urls[0]):
                urls.pop(0)
            if not urls:
                return
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"tritonserver not ready after {timeout:.0f}s{self._log_hint()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def _log_hint(self) -> str:
        if not self.log_file or not self.log_file.exists():
            return ""
        lines = self.log_file.read_text(errors="replace").splitlines()
        errors = [line for line in lines if line.startswith("E1") or "Error" in line][:10]
        return ("\n--- server log: errors ---\n" + "\n".join(errors) +
                "\n--- server log: last lines ---\n" + "\n".join(lines[-15:]))

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

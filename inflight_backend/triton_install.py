"""Where tritonserver and Triton's Python backend are, and the backend directory and environment they run with:
`backends/python/` (Triton's) and `backends/inflight/model.py` (ours), this interpreter first on PATH (the stub
runs `python3`, which must bring our site-packages) and the project on PYTHONPATH."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .paths import BUILD_DIR, PROJECT_ROOT


class ServerError(RuntimeError):
    pass


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

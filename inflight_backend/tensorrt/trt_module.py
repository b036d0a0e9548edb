"""Which TensorRT: full TensorRT (module `tensorrt`) when installed, else TensorRT-RTX (module `tensorrt_rtx`)."""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from ..paths import BUILD_DIR


def import_trt() -> Any:
    """The TensorRT module, or a clear error saying how to install one."""
    for name in ("tensorrt", "tensorrt_rtx"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("no TensorRT: `pip install .[tensorrt]` installs TensorRT-RTX (builds anywhere); "
                       "full TensorRT (module `tensorrt`) is needed to run on Hopper GPUs")


def parser_library_dir() -> Path | None:
    """TensorRT-RTX's ONNX parser dlopens `libtensorrt_rtx.so`, which the wheel ships only as `.so.1`: a directory
    with that link must be on LD_LIBRARY_PATH when the process starts. Returns it (None for full TensorRT)."""
    trt = import_trt()
    if trt.__name__ != "tensorrt_rtx":
        return None
    import tensorrt_rtx_libs

    real = Path(tensorrt_rtx_libs.__file__).parent / "libtensorrt_rtx.so.1"
    link_dir = BUILD_DIR / "tensorrt_rtx_lib"
    link_dir.mkdir(parents=True, exist_ok=True)
    link = link_dir / "libtensorrt_rtx.so"
    if not link.exists():
        link.symlink_to(real)
    return link_dir


def parser_ready() -> bool:
    lib_dir = parser_library_dir()
    return lib_dir is None or str(lib_dir) in os.environ.get("LD_LIBRARY_PATH", "").split(":")

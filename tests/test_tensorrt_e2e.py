"""engine: tensorrt through the real server gives the PyTorch engine's greedy tokens. Needs a CUDA GPU and a
TensorRT that runs on it; skips, saying which is missing, otherwise."""
import subprocess
import sys

import pytest
import torch

from inflight_backend.repository import write_repository
from inflight_backend.server import TritonServer, free_port
from tests.conftest import model_config
from tests.triton_helpers import grpc_generate


def _tensorrt_runtime_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device: TensorRT engines only run on a GPU"
    try:
        from inflight_backend.tensorrt.trt_module import import_trt

        trt = import_trt()
    except RuntimeError as exc:
        return str(exc)
    major, minor = torch.cuda.get_device_capability()
    if trt.__name__ == "tensorrt_rtx" and (major, minor) == (9, 0):
        return "TensorRT-RTX does not run on compute capability 9.0 (Hopper): install full TensorRT"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.server,
              pytest.mark.skipif(_tensorrt_runtime_missing() is not None, reason=str(_tensorrt_runtime_missing()))]


def test_tensorrt_engine_matches_pytorch_through_the_server(tmp_path, tiny_model, oracle_cases):
    engine_dir = tmp_path / "engine"
    subprocess.run([sys.executable, "-m", "inflight_backend.cli", "build-engine", "--checkpoint", tiny_model,
                    "--out", str(engine_dir), "--max-num-tokens", "1024", "--max-seqs", "16"], check=True)
    repo = write_repository(tmp_path / "repo", {
        "trt": model_config(tiny_model, "trt", engine="tensorrt", engine_path=engine_dir, device="cuda",
                            num_kv_blocks=1024),
        "torch": model_config(tiny_model, "torch", device="cuda", num_kv_blocks=1024)})
    with TritonServer(repo, free_port(), free_port(), free_port(), log_file=tmp_path / "log") as server:
        url = f"127.0.0.1:{server.grpc_port}"
        for ids, n in oracle_cases:
            values = {"input_ids": ids, "max_tokens": n, "stream": True}
            assert grpc_generate(url, "trt", values).ids == grpc_generate(url, "torch", values).ids

"""CUDA graphs of decode steps (runners/cuda_graphs.py): what does not need a GPU runs here. A CPU stand-in for
the capture reruns the captured call on the static buffers at each replay, so the buckets, the padding rows and
the buffer filling are checked against the eager path, step by step, logits and KV cache alike."""
import random

import torch

from inflight_backend.block_manager import BlockManager
from inflight_backend.request import Request, SamplingParams
from inflight_backend.runners.cuda_graphs import DecodeGraphs
from inflight_backend.runners.torch_runner import TorchRunner
from tests.test_model_logits import step


class Replayed:
    """Stands in for a torch.cuda.CUDAGraph: replay() reruns the captured call into the same output tensor."""

    def __init__(self, run, out: torch.Tensor) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        self.out.copy_(self.run())


def cpu_capture(graphs: DecodeGraphs):
    def capture(batch: int, context: int):
        args = graphs.graph_args(batch, context)
        with torch.inference_mode():
            out = graphs.model(*args).clone()
        return Replayed(lambda: graphs.model(*args), out), out, None
    return capture


def test_decode_steps_through_the_graph_buffers_match_eager_steps(tiny_model):
    """Five requests (one with a 600-token prompt, so its context crosses the kernel's 512-key partition),
    prefilled eagerly, then decode steps of 5, 3 and 1 sequences through the graphs (buckets of 8, 4 and 1 of
    max_batch_size 8, padded rows attending to one key and writing none): every step's logits equal the eager
    runner's, and so do both KV pools at the end."""
    runners, managers = [], []
    for _ in range(2):
        managers.append(BlockManager(num_blocks=120, block_size=16))
        runners.append(TorchRunner(tiny_model, 120, 16, attention="native"))
    graphs = DecodeGraphs(runners[1].model, runners[1].kv_caches, runners[1].attention, 8, 16, 2048, "cpu")
    graphs._capture = cpu_capture(graphs)
    runners[1].graphs = graphs
    rng = random.Random(0)
    prompts = [[rng.randrange(258) for _ in range(n)] for n in (20, 600, 7, 33, 1)]
    reqs = [[Request(str(i), list(p), SamplingParams(64)) for i, p in enumerate(prompts)] for _ in range(2)]
    for runner, bm, rs in zip(runners, managers, reqs):  # prefill, eagerly in both
        step(runner, bm, [(r, r.num_tokens) for r in rs])
    for live in ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [1, 3, 4], [1, 3, 4], [1]):
        token = rng.randrange(258)
        logits = []
        for runner, bm, rs in zip(runners, managers, reqs):
            for i in live:
                rs[i].output_ids.append(token)
            logits.append(step(runner, bm, [(rs[i], 1) for i in live]))
        assert torch.equal(logits[0], logits[1])
    assert sorted(graphs.graphs) == [(1, 1024), (4, 1024), (8, 1024)]
    for (k0, v0), (k1, v1) in zip(runners[0].kv_caches, runners[1].kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)

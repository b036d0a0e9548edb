"""The packed, paged engine computes the same logits as transformers on a mixed prefill/decode/chunk step."""
import json
import random
from pathlib import Path

import pytest
import torch

from inflight_backend.block_manager import BlockManager
from inflight_backend.runners.torch_runner import TorchRunner
from inflight_backend.make_model import TinySpec, make_model
from inflight_backend.request import Request, SamplingParams
from inflight_backend.scheduler_output import ScheduledRequest, SchedulerOutput, is_decode

ATOL = 2e-3  # fp32 logits of magnitude ~10-40; observed differences are ~1e-5


def step(runner, bm, items):
    """items: (request, num_tokens); returns logits of the requests whose tokens reach their end."""
    out = SchedulerOutput()
    for req, n in items:
        assert bm.allocate(req.req_id, req.num_computed_tokens + n)
        sample = req.num_computed_tokens + n == req.num_tokens
        out.scheduled.append(ScheduledRequest(req, n, sample, bm.block_table(req.req_id), is_decode(req)))
    logits = runner.execute(out)
    for req, n in items:
        req.num_computed_tokens += n
    return logits


def hf_last_logits(hf, ids):
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1]


@pytest.fixture(scope="module")
def llama3_rope_model(tmp_path_factory):
    """Llama 3 frequency scaling, with a short original context so the test's positions cross it."""
    path = make_model(str(tmp_path_factory.mktemp("llama3-rope")), TinySpec(seed=5))
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    config_file.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("attention, linear", [("native", "auto"), ("torch", "auto"), ("native", "torch")])
@pytest.mark.parametrize("checkpoint, block_size", [("tiny_model", 16), ("gqa_model", 1), ("tied_model", 5),
                                                    ("llama3_rope_model", 32)])
def test_mixed_step_matches_transformers(checkpoint, block_size, attention, linear, request):
    """linear auto: the native skinny GEMM and fused CPU ops where built; torch: plain torch ops."""
    from transformers import LlamaForCausalLM

    path = request.getfixturevalue(checkpoint)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    bm = BlockManager(num_blocks=400, block_size=block_size)
    rng.shuffle(bm._free)  # block tables in random physical order
    runner = TorchRunner(path, bm.num_blocks, block_size, attention=attention, linear=linear)
    assert runner.attention.name == attention
    prompt = lambda n: [rng.randrange(258) for _ in range(n)]  # noqa: E731
    a = Request("a", prompt(20), SamplingParams(8))
    c = Request("c", prompt(25), SamplingParams(8))
    step(runner, bm, [(a, 20), (c, 10)])  # a: whole prompt; c: first chunk only
    a.output_ids.append(rng.randrange(258))
    b = Request("b", prompt(30), SamplingParams(8))
    # One step: a decodes, b prefills whole, c finishes its prompt with a 15-token chunk.
    logits = step(runner, bm, [(a, 1), (b, 30), (c, 15)])
    assert logits.shape == (3, 258)
    for row, req in enumerate([a, b, c]):
        expected = hf_last_logits(hf, req.prompt_ids + req.output_ids)
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=0)
        assert logits[row].argmax() == expected.argmax()


@pytest.mark.parametrize("attention", ["native", "torch"])
@pytest.mark.parametrize("checkpoint", ["tiny_model", "gqa_model"])
def test_the_gpu_layout_matches_transformers_on_the_cpu(checkpoint, attention, request):
    """On a GPU the model keeps torch's nn.Linear with q/k/v and gate/up merged, and q and k are rotated as one
    (models/device_kernels.place): the same modules here, on the mixed step above."""
    from transformers import LlamaForCausalLM

    from inflight_backend.checkpoint import load_model
    from inflight_backend.models.llama import apply_rotary, merge_projections

    path = request.getfixturevalue(checkpoint)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bm = BlockManager(num_blocks=100, block_size=16)
    runner = TorchRunner(path, bm.num_blocks, 16, attention=attention, linear="torch")
    runner.model = load_model(path, runner.attention, torch.float32).eval()
    merge_projections(runner.model)
    attn = runner.model.model.layers[0].self_attn
    assert attn.qkv_proj is not None and attn.rotary is apply_rotary
    assert runner.model.model.layers[0].mlp.gate_up_proj is not None
    rng = random.Random(1)
    a = Request("a", [rng.randrange(258) for _ in range(20)], SamplingParams(8))
    b = Request("b", [rng.randrange(258) for _ in range(30)], SamplingParams(8))
    step(runner, bm, [(a, 20)])
    a.output_ids.append(rng.randrange(258))
    logits = step(runner, bm, [(a, 1), (b, 30)])
    for row, req in enumerate([a, b]):
        expected = hf_last_logits(hf, req.prompt_ids + req.output_ids)
        torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=0)
        assert logits[row].argmax() == expected.argmax()


def test_rotary_of_merged_heads_is_the_rotary_of_each():
    """apply_rotary on q and k that sit side by side in one merged qkv row (one set of ops, views returned)
    equals it on separate tensors, bit for bit; one token, whose row stride is arbitrary, too."""
    from inflight_backend.models.llama import _heads_follow, apply_rotary

    for tokens in (1, 7):
        qkv = torch.randn(tokens, (8 + 2 + 2) * 64)
        q, k = qkv[:, :512].view(tokens, 8, 64), qkv[:, 512:640].view(tokens, 2, 64)
        cos, sin = torch.randn(tokens, 1, 64), torch.randn(tokens, 1, 64)
        assert _heads_follow(q, k) and not _heads_follow(q.clone(), k.clone())
        got_q, got_k = apply_rotary(q, k, cos, sin)
        want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        assert got_q.shape == q.shape and got_k.shape == k.shape


def test_rotary_of_tensors_merely_side_by_side_in_memory():
    """Two tensors adjacent in memory but not views of one (as CUDA's caching allocator placed two clones on
    the H200, where a view of q reaching into k failed) are rotated apart."""
    from inflight_backend.models.llama import _heads_follow, apply_rotary

    buffer = torch.randn(640).numpy()
    q = torch.from_numpy(buffer[:512]).view(1, 8, 64)  # from_numpy: each its own storage over one buffer
    k = torch.from_numpy(buffer[512:]).view(1, 2, 64)
    assert k.data_ptr() == q.data_ptr() + 512 * 4 and not _heads_follow(q, k)
    cos, sin = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    got_q, got_k = apply_rotary(q, k, cos, sin)
    want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)

"""Native paged-attention kernels against the torch reference: random contexts, block sizes, GQA ratios,
multi-token (causal) queries, shuffled block tables, fp32 and bf16."""
import random
import shutil

import pytest
import torch

from inflight_backend.attention import NativePagedAttention, TorchPagedAttention, load_library
from inflight_backend.attention.random_batch import (CASES, TOLERANCE, WINDOW_STEP, WINDOWS, max_error,
                                                     random_batch, window_error)



def compare(backend, dtype, device, head_size, case, seed):
    err = max_error(backend, dtype, device, head_size, case, seed)
    assert not backend._use_fallback
    assert err <= TOLERANCE[dtype], f"max error {err} for {case}"


@pytest.fixture(scope="module")
def cpu_backend():
    lib = load_library("cpu")
    if lib is None:
        pytest.fail("build/lib/libinflight_pa_cpu.so is missing: run `make native`")
    return NativePagedAttention(lib, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [64, 128, 32])
@pytest.mark.parametrize("case", CASES, ids=[f"bs{c[0]}-g{c[1]}-ctx{c[2]}-q{c[3]}" for c in CASES])
def test_cpu_kernel_matches_reference(cpu_backend, dtype, head_size, case):
    compare(cpu_backend, dtype, "cpu", head_size, case, seed=hash((head_size, case)) % 1000)


MIXED_STEPS = {  # (context, queries) per sequence
    # a fused step: decodes (whole-sequence tasks) beside prompt chunks the kernel splits by KV head and block of
    # queries, the longest last as the fused policy schedules it
    "chunks-beside-decodes": [(c, 1) for c in (5, 700, 33, 1200, 64, 17, 300, 900)] + [(40, 40), (600, 200),
                                                                                        (1500, 700)],
    # one long decode among short ones: split by KV head, the short ones whole
    "long-decode-among-short": [(2000, 1), (64, 1), (64, 1), (64, 1), (16, 1)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("step", MIXED_STEPS)
def test_cpu_kernel_mixed_step_matches_reference(cpu_backend, dtype, step):
    lengths = MIXED_STEPS[step]
    q, k_cache, v_cache, meta = random_batch(random.Random(3), block_size=16, num_heads=4, num_kv_heads=2,
                                             head_size=64, dtype=dtype, lengths=lengths)
    want = TorchPagedAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    got = cpu_backend.forward(q, k_cache, v_cache, meta, 0.125)
    assert (got.float() - want).abs().max().item() <= TOLERANCE[dtype]


# Decodes of similar length, one task a sequence: every KV head of a token attended in one pass over the keys
# (4 query heads per KV head, untiled), rows scored and summed head by head within each chunk of keys.
DECODES_ALL_HEADS = [(c, 1) for c in (300, 257, 190, 64, 65, 129, 200, 311)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [64, 128, 32])
@pytest.mark.parametrize("kv_heads", [4, 3])
def test_cpu_kernel_decodes_with_every_kv_head_in_one_pass(cpu_backend, dtype, head_size, kv_heads):
    q, k_cache, v_cache, meta = random_batch(random.Random(kv_heads), block_size=16, num_heads=4 * kv_heads,
                                             num_kv_heads=kv_heads, head_size=head_size, dtype=dtype,
                                             lengths=DECODES_ALL_HEADS)
    scale = head_size ** -0.5
    want = TorchPagedAttention().forward(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    got = cpu_backend.forward(q, k_cache, v_cache, meta, scale)
    assert not cpu_backend._use_fallback
    assert (got.float() - want).abs().max().item() <= TOLERANCE[dtype]


WINDOW_DECODES = [(c, 1) for c in (1, 6, 7, 8, 16, 17, 100, 515, 2000, 33)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("step", ["fused", "decodes"])
def test_cpu_kernel_sliding_window_matches_reference(cpu_backend, dtype, window, block_size, step):
    lengths = WINDOW_STEP if step == "fused" else WINDOW_DECODES
    err = window_error(cpu_backend, dtype, "cpu", 64, window, block_size, seed=window + block_size, lengths=lengths)
    assert not cpu_backend._use_fallback
    assert err <= TOLERANCE[dtype], f"max error {err}"


@pytest.mark.parametrize("window", [1, 3, 8, 50])
def test_reference_sliding_window_is_attention_over_the_last_keys(window):
    """The reference against attention written out query by query: softmax over keys t - W + 1 .. t, through
    both of its paths (packed prompts, and the batched decode path)."""
    lengths = [(1, 1), (9, 1), (30, 1), (12, 12), (40, 7), (60, 1)]
    q, k_cache, v_cache, meta = random_batch(random.Random(window), block_size=4, num_heads=4, num_kv_heads=2,
                                             head_size=16, dtype=torch.float32, lengths=lengths)
    want = torch.empty_like(q)
    for i, (context, num_q) in enumerate(lengths):
        table = meta.block_tables[i]
        keys = k_cache[table].flatten(0, 1)[:context]  # (S, Hkv, D)
        values = v_cache[table].flatten(0, 1)[:context]
        for j in range(num_q):
            t = context - num_q + j
            seen = slice(max(0, t - window + 1), t + 1)
            for h in range(4):
                scores = keys[seen, h // 2] @ q[meta.query_start_loc[i] + j, h] * 0.25
                want[meta.query_start_loc[i] + j, h] = torch.softmax(scores, 0) @ values[seen, h // 2]
    reference = TorchPagedAttention()
    torch.testing.assert_close(reference.forward(q, k_cache, v_cache, meta, 0.25, window), want)
    decodes = [n == 1 for _, n in lengths]
    rows = [meta.query_start_loc[i] for i, d in enumerate(decodes) if d]
    q_dec, _, _, meta_dec = random_batch(random.Random(window), block_size=4, num_heads=4, num_kv_heads=2,
                                         head_size=16, dtype=torch.float32, lengths=lengths)
    meta_dec.block_tables = meta.block_tables[torch.tensor(decodes)]
    meta_dec.context_lens = [c for (c, n) in lengths if n == 1]
    meta_dec.query_start_loc = list(range(len(rows) + 1))
    meta_dec.decode_only = True
    torch.testing.assert_close(reference.forward(q[rows], k_cache, v_cache, meta_dec, 0.25, window), want[rows])


def test_cpu_write_kv_scatters_into_slots(cpu_backend):
    rng = random.Random(0)
    q, k_cache, v_cache, meta = random_batch(rng, num_seqs=3, block_size=4, num_heads=4, num_kv_heads=2,
                                             head_size=64, max_context=20, max_query=5, dtype=torch.float32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    num_tokens = q.shape[0]
    meta.slot_mapping = torch.tensor(rng.sample(range(k_cache.shape[0] * 4), num_tokens), dtype=torch.int64)
    k = torch.randn(num_tokens, 2, 64)
    v = torch.randn(num_tokens, 2, 64)
    cpu_backend.write_kv(k_cache, v_cache, k, v, meta)
    TorchPagedAttention().write_kv(k_ref, v_ref, k, v, meta)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("scale", [1.0, 5.0, 20.0])
def test_large_score_gaps_match_the_reference(cpu_backend, scale):
    """Scores that differ by more than 87 (e^-87 is below fp32's smallest normal) must weigh ~0, not NaN."""
    q, k_cache, v_cache, meta = random_batch(random.Random(3), num_seqs=3, block_size=4, num_heads=2,
                                             num_kv_heads=1, head_size=64, max_context=40, max_query=3,
                                             dtype=torch.float32)
    q = q * scale  # query norms grow the score gaps well past 87
    out = cpu_backend.forward(q, k_cache, v_cache, meta, 1.0)
    want = TorchPagedAttention().forward(q, k_cache, v_cache, meta, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_unsupported_dtype_falls_back_to_the_reference(cpu_backend):
    backend = NativePagedAttention(cpu_backend.lib, "cpu")
    q, k_cache, v_cache, meta = random_batch(random.Random(1), num_seqs=2, block_size=4, num_heads=2,
                                             num_kv_heads=1, head_size=64, max_context=9, max_query=2,
                                             dtype=torch.float16)
    out = backend.forward(q, k_cache, v_cache, meta, 0.125)
    assert backend._use_fallback
    want = TorchPagedAttention().forward(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out, want)


def test_unsupported_dtype_write_kv_falls_back_too(cpu_backend):
    """A model step writes K/V before it attends: the write must fall back as well, not fail."""
    backend = NativePagedAttention(cpu_backend.lib, "cpu")
    _, k_cache, v_cache, meta = random_batch(random.Random(2), num_seqs=2, block_size=4, num_heads=2,
                                             num_kv_heads=1, head_size=64, max_context=9, max_query=2,
                                             dtype=torch.float16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    n = len(meta.slot_mapping)
    k = torch.randn(n, 1, 64, dtype=torch.float16)
    v = torch.randn(n, 1, 64, dtype=torch.float16)
    backend.write_kv(k_cache, v_cache, k, v, meta)
    TorchPagedAttention().write_kv(k_ref, v_ref, k, v, meta)
    assert backend._use_fallback
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU kernels not run")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=[f"bs{c[0]}-g{c[1]}-ctx{c[2]}-q{c[3]}" for c in CASES])
def test_cuda_kernel_matches_reference(dtype, head_size, case):
    lib = load_library("cuda")
    assert lib is not None, "build/lib/libinflight_pa_cuda.so is missing: run `make native` with nvcc"
    compare(NativePagedAttention(lib, "cuda"), dtype, "cuda", head_size, case, seed=7)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("step", ["fused", "decodes"])
def test_cuda_kernel_sliding_window_matches_reference(dtype, window, step):
    lib = load_library("cuda")
    assert lib is not None, "build/lib/libinflight_pa_cuda.so is missing: run `make native` with nvcc"
    lengths = WINDOW_STEP if step == "fused" else WINDOW_DECODES
    err = window_error(NativePagedAttention(lib, "cuda"), dtype, "cuda", 128, window, 16, seed=window,
                       lengths=lengths)
    assert err <= TOLERANCE[dtype], f"max error {err}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: the CUDA library is not built")
def test_cuda_library_is_built_and_exports_the_abi():
    lib = load_library("cuda")  # loads without a GPU: the CUDA runtime is linked statically
    assert lib is not None, "nvcc is available but build/lib/libinflight_pa_cuda.so is missing"
    for name in ("pa_cuda_attention", "pa_cuda_write_kv", "pa_cuda_workspace_size"):
        assert hasattr(lib, name)

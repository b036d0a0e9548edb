"""Fused CPU ops (plugins/cpu_ops) against the torch code they replace: RMSNorm, rotary, SiLU-and-multiply and
greedy argmax, on odd sizes, strided rows and special values, in fp32 and (bitwise the torch module path's) in bf16;
and the model they are fused into."""
import pytest
import torch
import torch.nn.functional as F

from inflight_backend.attention import make_backend
from inflight_backend.checkpoint import load_model
from inflight_backend.models.device_kernels import place
from inflight_backend.models import cpu_ops
from inflight_backend.models.llama import RMSNorm, Rotary, apply_rotary, silu_mul


@pytest.fixture(scope="module")
def lib():
    library = cpu_ops.load_library()
    if library is None:
        pytest.fail("build/lib/libinflight_ops_cpu.so is missing: run `make native`")
    return library


@pytest.mark.parametrize("rows, n", [(1, 512), (7, 37), (33, 256), (300, 1000)])
def test_rms_norm_matches_torch(lib, rows, n):
    torch.manual_seed(rows + n)
    wide = torch.randn(rows, n + 5) * 3
    x = wide[:, 2:n + 2]  # strided rows
    weight = torch.randn(n)
    want = weight * F.rms_norm(x, (n,), eps=1e-5)
    torch.testing.assert_close(cpu_ops.rms_norm(lib, x, weight, 1e-5), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 8, 64), (5, 2, 128), (40, 3, 6)])
def test_rotary_matches_torch(lib, tokens, heads, head_dim):
    torch.manual_seed(tokens * heads)
    rotary = Rotary(type("Config", (), {"head_dim": head_dim, "rope_theta": 10000.0, "rope_scaling": None})())
    cos, sin = rotary.tables(torch.arange(tokens) * 37 + 5, torch.float32)
    q, k = torch.randn(tokens, heads, head_dim), torch.randn(tokens, 1, head_dim)
    want_q, want_k = apply_rotary(q, k, cos, sin)
    got_q, got_k = cpu_ops.rotary_(lib, q.clone(), cos, sin), cpu_ops.rotary_(lib, k.clone(), cos, sin)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, n", [(1, 512), (7, 37), (300, 1000)])
def test_add_rms_norm_adds_in_place_then_normalises(lib, rows, n):
    torch.manual_seed(rows * n)
    residual, h = torch.randn(rows, n) * 2, torch.randn(rows, n + 3)[:, 1:n + 1]  # h with strided rows
    weight = torch.randn(n)
    want_sum = residual + h
    y, out = cpu_ops.add_rms_norm_(lib, residual, h, weight, 1e-5)
    assert out is residual
    torch.testing.assert_close(residual, want_sum, atol=0, rtol=0)  # the same fp32 add as torch's
    torch.testing.assert_close(y, weight * F.rms_norm(want_sum, (n,), eps=1e-5), atol=2e-6, rtol=2e-6)


def test_native_norm_takes_the_residual_form_as_rmsnorm_does(lib):
    torch.manual_seed(3)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = torch.randn(48)
    native = cpu_ops.NativeRMSNorm(norm, lib)
    x, residual = torch.randn(5, 48), torch.randn(5, 48)
    want_h, want_residual = norm(x, residual.clone())
    got_h, got_residual = native(x, residual)
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(got_h, want_h, atol=2e-6, rtol=2e-6)


def test_silu_mul_on_the_halves_of_a_merged_projection(lib):
    torch.manual_seed(1)
    for rows in (1, 9):
        gate_up = torch.randn(rows, 2 * 37) * 3
        gate, up = gate_up[:, :37], gate_up[:, 37:]
        torch.testing.assert_close(cpu_ops.silu_mul(lib, gate, up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 6])
def test_rotary_of_adjacent_q_and_k_heads_in_one_call(lib, tokens):
    """q and k as views of a merged qkv output (k's heads right after q's in each row), a single token too
    (whose row stride torch leaves arbitrary): both rotated, v untouched."""
    torch.manual_seed(tokens)
    heads, kv_heads, dim = 4, 2, 16
    rotary = Rotary(type("Config", (), {"head_dim": dim, "rope_theta": 10000.0, "rope_scaling": None})())
    cos, sin = rotary.tables(torch.arange(tokens) * 11 + 3, torch.float32)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    got_q, got_k = cpu_ops._rotary_pair(lib, q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)


def test_silu_mul_matches_torch_including_extremes(lib):
    torch.manual_seed(0)
    gate = torch.cat([torch.randn(1001) * 4, torch.tensor([0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4])])
    up = torch.randn_like(gate)
    torch.testing.assert_close(cpu_ops.silu_mul(lib, gate, up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


def test_non_contiguous_inputs_are_taken_or_refused(lib):
    x = torch.randn(40, 24).t()  # column stride 24
    weight = torch.randn(40)
    torch.testing.assert_close(cpu_ops.rms_norm(lib, x, weight, 1e-6), weight * F.rms_norm(x, (40,), eps=1e-6),
                               atol=2e-6, rtol=2e-6)
    gate, up = torch.randn(30, 2)[:, 0], torch.randn(30, 2)[:, 1]
    torch.testing.assert_close(cpu_ops.silu_mul(lib, gate, up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)
    cos = sin = torch.ones(3, 1, 8)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_ops.rotary_(lib, torch.randn(2, 3, 8).transpose(0, 1), cos, sin)


@pytest.mark.parametrize("rows, n", [(1, 32000), (9, 17), (32, 258), (3, 1)])
def test_argmax_matches_torch(lib, rows, n):
    torch.manual_seed(rows * n)
    x = torch.randn(rows, n)
    assert cpu_ops.argmax_rows(lib, x) == x.argmax(dim=-1).tolist()


def test_argmax_ties_infinities_and_nan_follow_torch(lib):
    x = torch.zeros(5, 300)
    x[0, [7, 200]] = 2.0  # tie: the first
    x[1] = float("-inf")  # all -inf: index 0
    x[2, [10, 250]] = float("nan")  # NaN wins, the first one
    x[2, 3] = 9.0
    x[3, 299] = float("inf")
    x[4, 257] = 1.0  # past the first 256-element block
    assert cpu_ops.argmax_rows(lib, x) == x.argmax(dim=-1).tolist() == [7, 0, 10, 299, 257]
    strided = torch.randn(4, 50)[:, 5:45]
    assert cpu_ops.argmax_rows(lib, strided) == strided.argmax(dim=-1).tolist()


# bf16: each op rounds where torch's ops on bf16 tensors round (models/llama.py's modules), so the bits are theirs;
# rows of any width (a thread's fp32 copy of the row grows to fit).
@pytest.mark.parametrize("rows, n", [(1, 512), (7, 37), (33, 1000), (2, 20000)])
def test_bf16_norms_are_the_modules_bits(lib, rows, n):
    torch.manual_seed(rows + n)
    norm = RMSNorm(n, 1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.randn(n) * 0.5 + 1).to(torch.bfloat16)
    native = cpu_ops.NativeRMSNorm(norm, lib)
    x = (torch.randn(rows, n + 3) * 3).to(torch.bfloat16)[:, :n]  # strided rows
    h = torch.randn(rows, n).to(torch.bfloat16)
    assert torch.equal(native(x), norm(x))
    want, want_residual = norm(h, x.contiguous())
    got, got_residual = native(h, x.contiguous())
    assert torch.equal(got, want) and torch.equal(got_residual, want_residual)


@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 8, 64), (9, 6, 128), (40, 3, 6)])
def test_bf16_rotary_and_silu_mul_are_the_modules_bits(lib, tokens, heads, head_dim):
    torch.manual_seed(tokens * heads)
    rotary = Rotary(type("Config", (), {"head_dim": head_dim, "rope_theta": 10000.0, "rope_scaling": None})())
    cos, sin = rotary.tables(torch.arange(tokens) * 37, torch.bfloat16)
    qk = torch.randn(tokens, heads, head_dim).to(torch.bfloat16)
    q, k = qk[:, :heads - 2], qk[:, heads - 2:]  # k's heads after q's in each row: one call
    want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    got_q, got_k = cpu_ops._rotary_pair(lib, q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    gate_up = (torch.randn(tokens, 2 * heads * head_dim) * 4).to(torch.bfloat16)
    gate, up = gate_up[:, :heads * head_dim], gate_up[:, heads * head_dim:]
    assert torch.equal(cpu_ops.silu_mul(lib, gate, up), silu_mul(gate, up))


def test_only_the_native_linear_layout_fuses_the_ops(tiny_model):
    """The kernels rely on PackedLinear's contiguous outputs; the torch layout keeps torch's ops. (Both are
    checked against transformers in test_model_logits.py.)"""
    backend = make_backend("torch", torch.device("cpu"))
    plain = place(load_model(tiny_model, backend, torch.float32), "cpu", "torch")
    assert "fused" not in plain.linear_layout and not isinstance(plain.model.norm, cpu_ops.NativeRMSNorm)
    fused = place(load_model(tiny_model, backend, torch.float32), "cpu", "auto")
    if "fused CPU ops" not in fused.linear_layout:
        pytest.skip(f"no native linear layout on this machine ({fused.linear_layout})")
    layer = fused.model.layers[0]
    assert isinstance(fused.model.norm, cpu_ops.NativeRMSNorm)
    assert isinstance(layer.input_layernorm, cpu_ops.NativeRMSNorm)
    assert layer.self_attn.rotary.func is cpu_ops._rotary_pair and layer.mlp.act_mul.func is cpu_ops.silu_mul
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
    assert plain.model.layers[0].self_attn.qkv_proj is None  # the torch layout keeps nn.Linear's three GEMMs

"""CPU linear layouts: the native skinny GEMM (packed panels) and the input-major torch layout must both compute
what nn.Linear computes, for decode-sized and prefill-sized inputs, with and without bias."""
import pytest
import torch
from torch import nn

from inflight_backend.attention import make_backend
from inflight_backend.checkpoint import load_model
from inflight_backend.models.device_kernels import place
from inflight_backend.models import skinny_gemm
from inflight_backend.models.cpu_layout import InputMajorLinear, PackedLinear, convert_cpu_linears


@pytest.fixture(scope="module")
def lib():
    library = skinny_gemm.load_library()
    if library is None:
        pytest.skip("build/lib/libinflight_sgemm_cpu.so is not built with AVX-512 or AVX2+FMA on this machine")
    return library


# Output widths cover full 64-column tiles, a partial last tile and a single partial tile; input widths one chunk
# of the panel and several (chunks of 128 k rows: 300 is 128 + 128 + 44; of 1,024: 2100 is 1024 + 1024 + 52; the
# size this processor takes here, every size the library chooses in the next test); row counts cover every
# remainder of the kernel's 6-row blocks and prefill sizes.
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 300])
@pytest.mark.parametrize("in_features, out_features", [(96, 160), (64, 128), (37, 20), (300, 200), (2100, 72)])
def test_packed_linear_equals_linear(lib, bias, rows, in_features, out_features):
    torch.manual_seed(rows * 7 + in_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    torch.testing.assert_close(PackedLinear(linear, lib)(x), linear(x), atol=1e-5, rtol=1e-5)


def test_pack_reads_any_layout_in_place(lib):
    """An nn.Linear's (out, in) weight is packed through its transposed view, no input-major copy made: the same
    panels as from the contiguous copy, a partial last tile included."""
    weight = torch.randn(150, 37)
    view = weight.t()
    assert not view.is_contiguous()
    assert torch.equal(skinny_gemm.pack(lib, view), skinny_gemm.pack(lib, view.contiguous()))


# The chunk size the library loads with depends on the processor (its L1 cache), so both sizes it chooses, and
# one that divides no input width here, are checked on any machine.
@pytest.mark.parametrize("chunk", [128, 1024, 100])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("in_features", [300, 2100])
def test_packed_linear_for_every_panel_chunk_size(lib, chunk, rows, in_features):
    torch.manual_seed(rows + in_features)
    linear = nn.Linear(in_features, 72)
    x = torch.randn(rows, in_features)
    chosen = skinny_gemm.chunk_rows(lib)
    assert chosen in (128, 1024)
    try:
        assert skinny_gemm.chunk_rows(lib, chunk) == chunk
        out = PackedLinear(linear, lib)(x)
    finally:
        skinny_gemm.chunk_rows(lib, chosen)
    torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)


# A walk of one row block (up to 6 rows) fetches its weights a few rows ahead of its loads instead of the next
# chunk (skinny_gemm.stream_ahead): only the prefetches move, so both plans, and distances past a panel's end,
# give the same bits, and nn.Linear's values.
@pytest.mark.parametrize("rows", [1, 4, 6, 7])
def test_packed_linear_for_every_prefetch_plan(lib, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(300, 64 * 3 + 5)
    layer, x = PackedLinear(linear, lib), torch.randn(rows, 300)
    chosen = skinny_gemm.stream_ahead(lib)
    assert chosen > 0
    try:
        outs = [(skinny_gemm.stream_ahead(lib, ahead), layer(x))[1] for ahead in (0, chosen, 1 << 20)]
    finally:
        skinny_gemm.stream_ahead(lib, chosen)
    assert skinny_gemm.stream_ahead(lib) == chosen
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], linear(x), atol=1e-5, rtol=1e-5)


# 14 column tiles shared out over 1, 2, 3 and 5 OpenMP threads (more threads than cores: some are preempted
# and the others claim their tiles, plugins/common/include/claimed_ranges.h): every tile is computed.
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_packed_linear_is_the_same_for_any_thread_count(lib, threads):
    torch.manual_seed(threads)
    linear = nn.Linear(40, 64 * 13 + 5)
    x = torch.randn(7, 40)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = PackedLinear(linear, lib)(x)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, linear(x), atol=1e-5, rtol=1e-5)


def test_packed_linear_takes_strided_rows_and_3d_inputs(lib):
    linear = nn.Linear(48, 70)
    wide = torch.randn(9, 100)
    rows = wide[:, 10:58]  # row stride 100, unit column stride
    torch.testing.assert_close(PackedLinear(linear, lib)(rows), linear(rows), atol=1e-5, rtol=1e-5)
    batched = torch.randn(2, 3, 48)
    torch.testing.assert_close(PackedLinear(linear, lib)(batched), linear(batched), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_input_major_linear_equals_linear(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    converted = InputMajorLinear(linear)
    assert converted.weight_t.shape == (96, 160) and converted.weight_t.is_contiguous()
    torch.testing.assert_close(converted(x), linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend, kind", [("torch", InputMajorLinear), ("native", PackedLinear)])
def test_nested_linears_are_all_converted(backend, kind):
    if backend == "native" and skinny_gemm.load_library() is None:
        pytest.skip("the skinny GEMM library is not built with AVX-512 here")
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4, bias=False)))
    x = torch.randn(3, 8)
    expected = model(x)
    convert_cpu_linears(model, backend)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, kind) for m in model.modules()) == 2
    torch.testing.assert_close(model(x), expected, atol=1e-6, rtol=1e-6)


def test_native_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="fp32"):
        convert_cpu_linears(nn.Sequential(nn.Linear(4, 4)), "native", torch.float16)
    with pytest.raises(ValueError, match="linear_backend"):
        convert_cpu_linears(nn.Sequential(nn.Linear(4, 4)), "mkl")


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_cpu_checkpoint_loads_converted_and_keeps_tied_weights(tied_model, backend):
    model = place(load_model(tied_model, make_backend("torch", torch.device("cpu")), torch.float32), "cpu", backend)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    x = torch.randn(5, model.config.hidden_size)
    # tied embeddings: the LM head is the embedding matrix, transposed (the conversion made its own copy)
    torch.testing.assert_close(model.lm_head(x), x @ model.model.embed_tokens.weight.t(), atol=1e-4, rtol=1e-5)

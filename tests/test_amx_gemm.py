"""The AMX GEMM of plugins/linear (amx_gemm.h): fp32 accuracy from bf16 pieces, on every shape edge (rows, k and
columns that are not multiples of its 32-wide blocks, several k chunks, strided inputs, bias); PackedLinear and the
model use it from `amx_min_rows` rows on and only with `amx_gemm` allowing it."""
import pytest
import torch
from torch import nn

from inflight_backend.attention import make_backend
from inflight_backend.checkpoint import load_model
from inflight_backend.config import EngineConfig
from inflight_backend.models import skinny_gemm
from inflight_backend.models.cpu_layout import PackedLinear, convert_cpu_linears
from inflight_backend.models.device_kernels import place


@pytest.fixture(scope="module")
def lib():
    library = skinny_gemm.load_library()
    if library is None:
        pytest.skip("build/lib/libinflight_sgemm_cpu.so is not built with AVX-512 or AVX2+FMA on this machine")
    if not skinny_gemm.amx_available(library):
        pytest.skip("this processor (or its kernel) offers no AMX-BF16 tiles: the AMX GEMM cannot run here")
    return library


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.double() - reference).abs().max() / reference.abs().max()).item()


# Rows: one, a partial block, exactly one and several blocks (300: two passes of row blocks over the weight); k:
# a partial k block, one chunk (512), two (1,100: 18 and 17 k blocks) and three (2,100: 22, 22, 22); columns: a
# partial 32-column pair, exact pairs, a partial last pair.
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 31, 64, 300])
@pytest.mark.parametrize("k, n", [(37, 20), (512, 96), (1100, 200), (2100, 40)])
def test_amx_gemm_is_as_accurate_as_fp32(lib, bias, rows, k, n):
    torch.manual_seed(rows * 13 + k + n)
    weight_t, x = torch.randn(k, n) * 0.05, torch.randn(rows, k)
    b = torch.randn(n) if bias else None
    reference = x.double() @ weight_t.double() + (b.double() if bias else 0)
    y = skinny_gemm.amx_gemm(lib, x, skinny_gemm.amx_pack(lib, weight_t), n, b)
    fp32 = skinny_gemm.gemm(lib, x, skinny_gemm.pack(lib, weight_t), n, b)
    # bf16x6 leaves out products below fp32's rounding: its error is the fp32 GEMM's, not bf16's (~1e-3)
    assert relative_error(y, reference) <= 2 * relative_error(fp32, reference) + 1e-7


def test_amx_gemm_takes_strided_rows_and_writes_only_its_output(lib):
    weight_t = torch.randn(48, 70)
    wide = torch.randn(80, 100)
    rows = wide[:, 10:58]  # row stride 100
    out = torch.full((81, 70), 7.0)
    skinny_gemm.amx_gemm(lib, rows, skinny_gemm.amx_pack(lib, weight_t), 70, None, out[:80])
    torch.testing.assert_close(out[:80], rows @ weight_t, atol=1e-5, rtol=1e-5)
    assert torch.all(out[80] == 7.0)  # the blocks that overhang y are summed elsewhere, not past its end


def test_amx_gemm_refuses_bad_shapes(lib):
    packed, x, y = torch.zeros(lib.sg_amx_packed_size(4, 4), dtype=torch.int16), torch.zeros(2, 4), torch.zeros(2, 4)
    assert lib.sg_amx_gemm_f32(x.data_ptr(), 2, 4, 3, packed.data_ptr(), 4, None, y.data_ptr()) != 0  # ldx < K
    assert lib.sg_amx_gemm_f32(x.data_ptr(), 2, 0, 4, packed.data_ptr(), 4, None, y.data_ptr()) != 0
    assert lib.sg_amx_pack_f32(x.data_ptr(), 0, 4, packed.data_ptr()) != 0


def test_packed_linear_takes_amx_from_its_row_threshold(lib):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160)
    packed = PackedLinear(linear, lib, amx=True)
    threshold = skinny_gemm.amx_min_rows(lib)
    for rows in (1, threshold - 1, threshold, 3 * threshold + 5):
        x = torch.randn(rows, 96)
        weight_t = linear.weight.detach().t().contiguous()
        amx = rows >= threshold
        expected = (skinny_gemm.amx_gemm(lib, x, skinny_gemm.amx_pack(lib, weight_t), 160, linear.bias.detach())
                    if amx else skinny_gemm.gemm(lib, x, skinny_gemm.pack(lib, weight_t), 160, linear.bias.detach()))
        assert torch.equal(packed(x), expected), f"{rows} rows should go through the {'AMX' if amx else 'skinny'} GEMM"


def test_amx_gemm_setting_chooses_which_layers_get_the_amx_form(tied_model, lib):
    def convert(setting):
        model = load_model(tied_model, make_backend("torch", torch.device("cpu")), torch.float32)
        return place(model, "cpu", "native", setting)

    model = convert("auto")
    assert "AMX bf16x6" in model.linear_layout
    layers = [m for name, m in model.named_modules() if isinstance(m, PackedLinear) and name != "lm_head"]
    assert layers and all(m.amx_packed is not None for m in layers)
    assert model.lm_head.amx_packed is None  # it only multiplies a step's sampled rows
    assert all(m.amx_packed is None for m in convert("off").modules() if isinstance(m, PackedLinear))
    assert "AMX" not in convert("off").linear_layout


def test_amx_gemm_on_is_refused_where_it_cannot_run():
    with pytest.raises(RuntimeError, match="amx_gemm: on"):
        convert_cpu_linears(nn.Sequential(nn.Linear(4, 4)), "torch", torch.float32, "on")
    with pytest.raises(ValueError, match="amx_gemm must be one of"):
        convert_cpu_linears(nn.Sequential(nn.Linear(4, 4)), "torch", torch.float32, "yes")
    with pytest.raises(ValueError, match="amx_gemm must be one of"):
        EngineConfig(checkpoint="m", amx_gemm="bf16")

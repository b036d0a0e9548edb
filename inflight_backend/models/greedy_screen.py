"""The LM head's greedy screen on the CPU (plugins/linear/include/greedy_screen.h): greedy tokens from a bf16
pass over the head, exactly the fp32 head's.

A step whose every sampled row is greedy needs only each row's largest logit. `screen` computes all logits from
bf16 copies of the hidden rows and of the head's weight (AVX512-BF16: half the bytes and twice the products per
instruction of the fp32 GEMM), each within a proven bound of the fp32 value; after the engine masks tokens,
`refine` recomputes in fp32 every logit that could still be its row's largest, bitwise as the fp32 head would.
An argmax over the refined row is then the fp32 head's argmax, and its logit the fp32 one; the other entries are
approximations below it, so a step that needs anything else of the logits (sampling, penalties, log-probabilities,
logits returned) does not screen. Costs a bf16 copy of the head's weight (half its fp32 size). Without
AVX512-BF16, `greedy_screen: on` widens the bf16 weights to fp32 in AVX2 registers instead: as exact, and slower
than the fp32 head (kept for processors and tests without the instruction; `auto` does not take it).

A bfloat16 model's head is screened the same way one precision down (`Int8Screen`, plugins/linear/include/
int8_screen.h): int8 copies of the rows and of the weight (AVX512-VNNI: half the bf16 GEMM's bytes, twice its
products per instruction), refined bitwise as the bf16 GEMM from the weight's (vocab, hidden) rows, which the
screen keeps (for a tied head, the embedding table itself).
"""
from __future__ import annotations

import ctypes

import torch

from ..config import GREEDY_SCREEN
from . import skinny_gemm

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


HARDWARE, WIDENED = 2, 1  # screen paths (gs_available): AVX512-BF16 dot products; bf16 widened to fp32 (AVX2)


def _declare_int8(lib: ctypes.CDLL) -> bool:
    """Whether this process can screen a bf16 head with `lib` (AVX512-VNNI and AVX512-BF16)."""
    if not hasattr(lib, "gq_available"):
        return False
    lib.gq_available.restype = ctypes.c_int
    lib.gq_packed_size.restype = _I64
    lib.gq_packed_size.argtypes = [_I64, _I64]
    lib.gq_pack.restype = ctypes.c_int
    lib.gq_pack.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR]
    lib.gq_screen.restype = ctypes.c_int
    lib.gq_screen.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR]
    lib.gq_refine.restype = _I64
    lib.gq_refine.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR]
    lib.gq_bounds.restype = ctypes.c_int
    lib.gq_bounds.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, ctypes.c_double, _PTR]
    return bool(lib.gq_available())


def int8_available(lib: ctypes.CDLL | None) -> bool:
    """Whether a bf16 head can be screened here (the library built with the code, the processor with AVX512-VNNI
    and AVX512-BF16)."""
    return lib is not None and _declare_int8(lib)


def _declare(lib: ctypes.CDLL) -> int:
    """The screen path this process would take with `lib` (a build of the skinny-GEMM library), 0 for none."""
    if not hasattr(lib, "gs_available"):
        return 0
    lib.gs_available.restype = ctypes.c_int
    lib.gs_widen_only.restype = ctypes.c_int
    lib.gs_widen_only.argtypes = [ctypes.c_int]
    lib.gs_packed_size.restype = _I64
    lib.gs_packed_size.argtypes = [_I64, _I64]
    lib.gs_pack.restype = ctypes.c_int
    lib.gs_pack.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]
    lib.gs_screen.restype = ctypes.c_int
    lib.gs_screen.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR]
    lib.gs_refine.restype = _I64
    lib.gs_refine.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR]
    return int(lib.gs_available())


def path(lib: ctypes.CDLL | None) -> int:
    """HARDWARE where the processor has AVX512-BF16; WIDENED where it has AVX2+FMA only (correct, and slower than
    the fp32 head from 8 rows: `greedy_screen: on` only); 0 where the library has no screen."""
    return 0 if lib is None else _declare(lib)


def available(lib: ctypes.CDLL | None) -> bool:
    return path(lib) > 0


class HeadScreen:
    """What both screens share: `screen(x)` keeps x until `refine` makes the logits it returned exact where an
    argmax can land, and counts the logits refines recompute, so that a screen whose bound is too loose for its
    checkpoint stops (`worthwhile`)."""

    label = ""  # how the model's description names the screen

    def __init__(self, lib: ctypes.CDLL, out_features: int, in_features: int, most_per_row: float) -> None:
        self.out_features, self.in_features = out_features, in_features
        self.most_per_row = most_per_row
        self.recomputed = 0  # logits refine has computed exactly, in all (a benchmark's figure)
        self._per_row = 0.0  # recomputed logits a row, a moving average
        self._lib = lib
        self._x: torch.Tensor | None = None

    def screen(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, hidden) -> (M, vocab) fp32 logits, each within the bound of the head's (exact for rows that
        are not safe to approximate)."""
        x = self._rows(x)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        status = self._screen(x, y)
        if status != skinny_gemm.SG_OK:
            raise RuntimeError(f"greedy screen failed with status {status}")
        self._x = x
        return y

    def refine(self, logits: torch.Tensor) -> None:
        """In place, after masks (-inf): every logit that could be its row's largest becomes the head's."""
        x, self._x = self._x, None
        if x is None or logits.shape != (x.shape[0], self.out_features) or not logits.is_contiguous():
            raise RuntimeError("greedy screen: refine needs the logits of the last screen, contiguous")
        count = self._refine(x, logits)
        if count < 0:
            raise RuntimeError(f"greedy screen: refine failed with status {-count}")
        self.recomputed += count
        if x.shape[0]:
            self._per_row += 0.125 * (count / x.shape[0] - self._per_row)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the screen holds (some may be the model's own: the head's panels, a tied embedding)."""
        raise NotImplementedError

    @property
    def worthwhile(self) -> bool:
        """Whether screening still pays: False once refines recompute more than `most_per_row` logits a row on
        average (then it stays off: nothing screens to bring the average down)."""
        return self._per_row <= self.most_per_row

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _screen(self, x: torch.Tensor, y: torch.Tensor) -> int:
        raise NotImplementedError

    def _refine(self, x: torch.Tensor, logits: torch.Tensor) -> int:
        raise NotImplementedError


class GreedyScreen(HeadScreen):
    """Screens an fp32 LM head (a PackedLinear without bias) in bf16."""

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, packed_f32: torch.Tensor) -> None:
        """weight: the head's (vocab, hidden) fp32 weight; packed_f32: the PackedLinear's panels of it."""
        if not available(lib):
            raise RuntimeError("greedy screen: the library has no screen, or this processor has neither AVX512-BF16 "
                               "nor AVX2+FMA")
        weight = weight.detach().float()  # (vocab, hidden), read in place: a real head's fp32 copy is gigabytes
        # Each recomputed logit reads a cache line per weight (a column of the packed panels), 16x the bytes of
        # streaming it: past vocab / 64 a row the refine costs a quarter of the fp32 head. The bound is loose
        # where ||x|| ||w_j|| dwarfs the logits' spread.
        super().__init__(lib, weight.shape[0], weight.shape[1], weight.shape[0] / 64)
        self.label = "bf16" + (" (AVX2, widened)" if path(lib) == WIDENED else "")
        self.packed = torch.empty(lib.gs_packed_size(self.in_features, self.out_features), dtype=torch.int16)
        self.norms = torch.empty(3, dtype=torch.float64)  # the bound's largest column norms (greedy_screen.h)
        if lib.gs_pack(weight.data_ptr(), self.in_features, self.out_features, weight.stride(1), weight.stride(0),
                       self.packed.data_ptr(), self.norms.data_ptr()) != skinny_gemm.SG_OK:
            raise ValueError("greedy_screen: the LM head's weight has a non-finite value")
        self.packed_f32 = packed_f32

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.norms, self.packed_f32]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, self.in_features).float().contiguous()

    def _screen(self, x: torch.Tensor, y: torch.Tensor) -> int:
        return self._lib.gs_screen(x.data_ptr(), x.shape[0], self.in_features, self.in_features,
                                   self.packed.data_ptr(), self.packed_f32.data_ptr(), self.norms.data_ptr(),
                                   self.out_features, y.data_ptr())

    def _refine(self, x: torch.Tensor, logits: torch.Tensor) -> int:
        return self._lib.gs_refine(x.data_ptr(), x.shape[0], self.in_features, self.in_features,
                                   self.packed_f32.data_ptr(), self.norms.data_ptr(), self.out_features,
                                   logits.data_ptr())


class Int8Screen(HeadScreen):
    """Screens a bfloat16 LM head (a PackedBf16Linear without bias) in int8; its refine is bitwise the bf16
    GEMM's, from the weight's rows."""

    label = "int8"

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, packed_bf16: torch.Tensor) -> None:
        """weight: the head's (vocab, hidden) bf16 weight, kept (the refine reads its rows); packed_bf16: the
        PackedBf16Linear's panels of it."""
        if not int8_available(lib):
            raise RuntimeError("greedy screen: the library has no int8 screen, or this processor lacks AVX512-VNNI "
                               "or AVX512-BF16")
        weight = weight.detach()
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        vocab, hidden = weight.shape
        # A recomputed logit reads its row (hidden bf16 values, contiguous, from memory): on the large bench head
        # at 32 rows ~50 a row cost 0.6 ms beside the screen's 3.1 and the bf16 GEMM's 5.7; past vocab / 256 (125
        # there) screen and refine would take about as long as the GEMM.
        super().__init__(lib, vocab, hidden, vocab / 256)
        self.rows = weight
        self.packed = torch.empty(lib.gq_packed_size(hidden, vocab), dtype=torch.int8)
        self.scales = torch.empty(vocab, dtype=torch.float32)
        self.sums = torch.empty(vocab, dtype=torch.int32)
        self.norms = torch.empty(3, dtype=torch.float64)  # the bound's largest column norms (int8_screen.h)
        self.col_norms = torch.empty(2 * vocab, dtype=torch.float32)  # and each column's
        if lib.gq_pack(weight.data_ptr(), hidden, vocab, 1, weight.stride(0), self.packed.data_ptr(),
                       self.scales.data_ptr(), self.sums.data_ptr(), self.norms.data_ptr(),
                       self.col_norms.data_ptr()) != skinny_gemm.SG_OK:
            raise ValueError("greedy_screen: the LM head's weight has a non-finite value, or is wider than 65,536")
        self.packed_bf16 = packed_bf16

    def bounds(self, x_row: torch.Tensor, largest: float) -> torch.Tensor | None:
        """The screen's bound on each logit of one bf16 row of x whose logits' largest finite magnitude is
        `largest` (None for a row it computes exactly)."""
        x_row = x_row.reshape(-1).to(torch.bfloat16).contiguous()
        out = torch.empty(self.out_features, dtype=torch.float32)
        status = self._lib.gq_bounds(x_row.data_ptr(), self.in_features, self.norms.data_ptr(),
                                     self.col_norms.data_ptr(), self.out_features, largest, out.data_ptr())
        return out if status == skinny_gemm.SG_OK else None

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales, self.sums, self.norms, self.col_norms, self.rows, self.packed_bf16]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()

    def _screen(self, x: torch.Tensor, y: torch.Tensor) -> int:
        return self._lib.gq_screen(x.data_ptr(), x.shape[0], self.in_features, self.in_features,
                                   self.packed.data_ptr(), self.scales.data_ptr(), self.sums.data_ptr(),
                                   self.packed_bf16.data_ptr(), self.norms.data_ptr(), self.out_features,
                                   y.data_ptr())

    def _refine(self, x: torch.Tensor, logits: torch.Tensor) -> int:
        return self._lib.gq_refine(x.data_ptr(), x.shape[0], self.in_features, self.in_features,
                                   self.rows.data_ptr(), self.rows.stride(0), self.norms.data_ptr(),
                                   self.col_norms.data_ptr(), self.out_features, logits.data_ptr())


def build(lib: ctypes.CDLL | None, weight: torch.Tensor, head, mode: str) -> HeadScreen | None:
    """The screen for an LM head as `mode` (config.GREEDY_SCREEN) asks, or None. weight: the head's weight as
    loaded (fp32: screened in bf16; bf16: in int8); head: what the model computes it with (a screen needs the
    native layout's PackedLinear or PackedBf16Linear)."""
    if mode not in GREEDY_SCREEN:
        raise ValueError(f"greedy_screen must be one of {GREEDY_SCREEN}, got {mode!r}")
    native = isinstance(getattr(head, "packed", None), torch.Tensor) and head.bias is None
    if weight.dtype == torch.bfloat16:
        usable = native and int8_available(lib)
        if mode == "on" and not usable:
            raise RuntimeError("greedy_screen: on needs, for a bfloat16 model, the native bf16 GEMM, an LM head "
                               "without bias and a processor with AVX512-VNNI and AVX512-BF16 "
                               "(build/lib/libinflight_sgemm_cpu.so built on it); use auto or off")
        return Int8Screen(lib, weight, head.packed) if usable and lib is not None and mode != "off" else None
    usable = path(lib) > 0 and native and weight.dtype == torch.float32
    if mode == "on" and not usable:
        raise RuntimeError("greedy_screen: on needs the native linear layout (fp32 or bf16), an LM head without bias "
                           "and a processor with AVX512-BF16 or AVX2+FMA (build/lib/libinflight_sgemm_cpu.so built "
                           "on it); use auto or off")
    if mode == "off" or not usable or lib is None or (mode == "auto" and path(lib) != HARDWARE):
        return None
    return GreedyScreen(lib, weight, head.packed)

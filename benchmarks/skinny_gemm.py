"""CPU linear layers side by side: torch (MKL) on input-major weights, the native skinny GEMM on packed panels and,
on processors with AMX, the AMX GEMM (bf16x6 pieces, fp32 accuracy) that prefill-sized inputs take.

    .venv/bin/python benchmarks/skinny_gemm.py [--checkpoint build/models/bench-medium] [--rows 1 4 8 16 32 64 2048]
                                               [--repeat 5] [--baseline-lib OLD.so]

Shapes are the checkpoint's linear layers (q, k/v, o, gate/up, down, LM head). Every figure is the best of
--repeat timings of a loop over the same call, so weights may sit in cache; the end-to-end effect is in
decode_roofline.py and serve_bench.py (`--linear-backend torch|native`). `--baseline-lib OLD.so`: another build
of libinflight_sgemm_cpu.so (an older commit's) packs the same weights and is timed beside this one, the two
alternating call loop by call loop; its columns replace torch's and AMX's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inflight_backend.checkpoint import load_config  # noqa: E402
from inflight_backend.models import skinny_gemm  # noqa: E402


def best_ms(*fns, repeat: int, calls: int = 10) -> list[float]:
    """Each of `fns`' best time (ms) over `repeat` loops of `calls` calls, the functions taking turns loop by loop."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls)
    return [b * 1e3 for b in best]


def layer_shapes(checkpoint: str) -> dict[str, tuple[int, int]]:
    """The checkpoint's linear layers, name -> (K, N)."""
    cfg = load_config(checkpoint)
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    return {"q/o": (h, h), "k/v": (h, kv), "gate/up": (h, cfg.intermediate_size),
            "down": (cfg.intermediate_size, h), "lm_head": (h, cfg.vocab_size)}


def compare_builds(lib, args) -> None:
    """The packed GEMM of this build and of `args.baseline_lib` on the same weights and inputs, alternating."""
    old = skinny_gemm.load_library(args.baseline_lib.resolve())
    if old is None:
        raise SystemExit(f"{args.baseline_lib} is missing or was built without AVX-512 or AVX2+FMA")
    print(f"{torch.get_num_threads()} threads; best of {args.repeat}; ms per call; baseline {args.baseline_lib}")
    print("| layer (K x N) | rows | baseline | this build | GFLOP/s | this / baseline |\n"
          "|---|---:|---:|---:|---:|---:|")
    for name, (k, n) in layer_shapes(args.checkpoint).items():
        weight_t = torch.randn(k, n)
        packed, old_packed = skinny_gemm.pack(lib, weight_t), skinny_gemm.pack(old, weight_t)
        for rows in args.rows:
            x = torch.randn(rows, k)
            torch.testing.assert_close(skinny_gemm.gemm(lib, x, packed, n, None), x @ weight_t, atol=1e-3, rtol=1e-4)
            torch.testing.assert_close(skinny_gemm.gemm(old, x, old_packed, n, None), x @ weight_t, atol=1e-3,
                                       rtol=1e-4)
            before, now = best_ms(lambda: skinny_gemm.gemm(old, x, old_packed, n, None),
                                  lambda: skinny_gemm.gemm(lib, x, packed, n, None), repeat=args.repeat)
            print(f"| {name} ({k} x {n}) | {rows} | {before:.3f} | {now:.3f} | {2 * rows * k * n / now / 1e6:.0f} | "
                  f"{now / before:.3f} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="build/models/bench-medium")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 2048])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline-lib", type=Path, metavar="SO", help="another build of the library, timed beside")
    args = parser.parse_args(argv)
    lib = skinny_gemm.load_library()
    if lib is None:
        raise SystemExit("build/lib/libinflight_sgemm_cpu.so is missing or built without AVX-512: `make native`")
    if args.baseline_lib is not None:
        return compare_builds(lib, args)
    shapes = layer_shapes(args.checkpoint)
    amx = skinny_gemm.amx_available(lib)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.repeat}; ms per call; "
          + ("AMX GEMM measured" if amx else "no AMX on this processor"))
    print("| layer (K x N) | rows | torch input-major | native packed | speed-up | AMX | AMX / packed |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, (k, n) in shapes.items():
        weight_t = torch.randn(k, n)
        packed = skinny_gemm.pack(lib, weight_t)
        amx_packed = skinny_gemm.amx_pack(lib, weight_t) if amx else None
        for rows in args.rows:
            x = torch.randn(rows, k)
            torch.testing.assert_close(skinny_gemm.gemm(lib, x, packed, n, None), x @ weight_t, atol=1e-3, rtol=1e-4)
            mkl, native = best_ms(lambda: x @ weight_t, lambda: skinny_gemm.gemm(lib, x, packed, n, None),
                                  repeat=args.repeat)
            row = f"| {name} ({k} x {n}) | {rows} | {mkl:.3f} | {native:.3f} | {mkl / native:.2f}x |"
            if amx_packed is not None:
                torch.testing.assert_close(skinny_gemm.amx_gemm(lib, x, amx_packed, n, None), x @ weight_t,
                                           atol=1e-3, rtol=1e-4)
                tiles, = best_ms(lambda: skinny_gemm.amx_gemm(lib, x, amx_packed, n, None), repeat=args.repeat)
                row += f" {tiles:.3f} | {native / tiles:.2f}x |"
            else:
                row += " | |"
            print(row, flush=True)


if __name__ == "__main__":
    main()

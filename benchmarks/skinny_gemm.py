"""CPU linear layers side by side: torch (MKL) on input-major weights, the native skinny GEMM on packed panels and,
on processors with AMX, the AMX GEMM (bf16x6 pieces, fp32 accuracy) that prefill-sized inputs take.

    .venv/bin/python benchmarks/skinny_gemm.py [--checkpoint build/models/bench-medium] [--rows 1 4 8 16 32 64 2048]
                                               [--repeat 5] [--baseline-lib OLD.so] [--chunk-rows 128 1024]
                                               [--stream-ahead 0 1024] [--dtype bfloat16]

Shapes are the checkpoint's linear layers (q, k/v, o, gate/up, down, LM head). Every figure is the best of
--repeat timings of a loop over the same call, so weights may sit in cache; the end-to-end effect is in
decode_roofline.py and serve_bench.py (`--linear-backend torch|native`). `--baseline-lib OLD.so`: another build
of libinflight_sgemm_cpu.so (an older commit's) packs the same weights and is timed beside this one, the two
alternating call loop by call loop, each calling the GEMM the engine takes at that row count (the AMX GEMM from its
row threshold on, where both builds have it; else the packed GEMM); its columns replace torch's and AMX's.
`--chunk-rows A B ...`: this build's GEMM walking its panels in chunks of A, B, ... k rows (`skinny_gemm.chunk_rows`;
the first is the baseline of the ratios), with each layer's weights read from memory as in a model's step: a ring of
copies of the layer, more than `--ring-mb` in all, each call taking the next copy, the chunk sizes alternating ring
pass by ring pass. `--stream-ahead A B ...`: the same for how far ahead of its loads (bytes) a GEMM of at most 6 rows
fetches the weights (`skinny_gemm.stream_ahead`; 0: the next chunk, as with more rows). `--dtype bfloat16`: a bf16
model's layers, torch's bf16 GEMM (or with `--baseline-lib` the older build's bf16 GEMM) against the bf16 GEMM
(bf16_gemm.h), weights read from memory the same way.
"""
from __future__ import annotations

import argparse
import functools
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
    """The GEMM the engine calls at each row count (the AMX GEMM from its threshold on, where both builds can run
    it; else the packed GEMM) of this build and of `args.baseline_lib`, same weights and inputs, alternating."""
    old = skinny_gemm.load_library(args.baseline_lib.resolve())
    if old is None:
        raise SystemExit(f"{args.baseline_lib} is missing or was built without AVX-512 or AVX2+FMA")
    amx = skinny_gemm.amx_available(lib) and skinny_gemm.amx_available(old)
    print(f"{torch.get_num_threads()} threads; best of {args.repeat}; ms per call; baseline {args.baseline_lib}; "
          + (f"the AMX GEMM from {skinny_gemm.amx_min_rows(lib)} rows" if amx else "no AMX GEMM"))
    print("| layer (K x N) | rows | GEMM | baseline | this build | GFLOP/s | this / baseline |\n"
          "|---|---:|---|---:|---:|---:|---:|")
    for name, (k, n) in layer_shapes(args.checkpoint).items():
        weight_t = torch.randn(k, n)
        forms = {}  # library -> (packed GEMM's panels, AMX pieces or None)
        for library in (old, lib):
            forms[library] = (skinny_gemm.pack(library, weight_t),
                              skinny_gemm.amx_pack(library, weight_t) if amx else None)
        for rows in args.rows:
            x = torch.randn(rows, k)
            tiles = amx and rows >= skinny_gemm.amx_min_rows(lib)
            calls = []
            for library in (old, lib):
                packed, pieces = forms[library]
                call = (functools.partial(skinny_gemm.amx_gemm, library, x, pieces, n, None) if tiles
                        else functools.partial(skinny_gemm.gemm, library, x, packed, n, None))
                torch.testing.assert_close(call(), x @ weight_t, atol=1e-3, rtol=1e-4)
                calls.append(call)
            before, now = best_ms(*calls, repeat=args.repeat)
            print(f"| {name} ({k} x {n}) | {rows} | {'AMX' if tiles else 'packed'} | {before:.3f} | {now:.3f} | "
                  f"{2 * rows * k * n / now / 1e6:.0f} | {now / before:.3f} |", flush=True)


def ring_walk(lib, ring: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, setting):
    """A call of the GEMM on every packed weight of `ring` in turn, with `setting(lib)` applied first, into `y`."""
    def run():
        setting(lib)
        for packed in ring:
            skinny_gemm.gemm(lib, x, packed, y.shape[1], None, y)
    return run


def compare_settings(lib, args) -> None:
    """This build's GEMM at each of `args.chunk_rows` (panel chunk sizes) or `args.stream_ahead` (prefetch
    distances of walks of few rows), weights read from memory (a ring of copies per layer)."""
    chunk, ahead = skinny_gemm.chunk_rows(lib), skinny_gemm.stream_ahead(lib)
    if args.chunk_rows:
        labels = [f"{c} rows" for c in args.chunk_rows]
        settings = [lambda lib, c=c: skinny_gemm.chunk_rows(lib, c) for c in args.chunk_rows]
    else:
        labels = [f"{b} bytes ahead" for b in args.stream_ahead]
        settings = [lambda lib, b=b: skinny_gemm.stream_ahead(lib, b) for b in args.stream_ahead]
    print(f"{torch.get_num_threads()} threads; best of {args.repeat} ring passes; ms per call, weights from memory "
          f"(rings of > {args.ring_mb} MB); chosen here: chunks of {chunk} rows, few rows fetched {ahead} bytes ahead")
    print("| layer (K x N) | rows | " + " | ".join(f"{c} (ms)" for c in labels) + " | "
          + " | ".join(f"{c} / {labels[0]}" for c in labels[1:]) + " |\n|---|---:|" + "---:|" * (2 * len(labels) - 1))
    try:
        for name, (k, n) in layer_shapes(args.checkpoint).items():
            weight_t = torch.randn(k, n)
            copies = max(2, -(-args.ring_mb * 2**20 // (k * n * 4)))
            ring = [skinny_gemm.pack(lib, weight_t) for _ in range(copies)]
            for rows in args.rows:
                x, y = torch.randn(rows, k), torch.empty(rows, n)
                for setting in settings:
                    setting(lib)
                    torch.testing.assert_close(skinny_gemm.gemm(lib, x, ring[0], n, None), x @ weight_t, atol=1e-3,
                                               rtol=1e-4)
                walks = [ring_walk(lib, ring, x, y, setting) for setting in settings]
                ms = [t / copies for t in best_ms(*walks, repeat=args.repeat, calls=1)]
                print(f"| {name} ({k} x {n}) | {rows} | " + " | ".join(f"{t:.3f}" for t in ms) + " | "
                      + " | ".join(f"{t / ms[0]:.3f}" for t in ms[1:]) + " |", flush=True)
            del ring
    finally:
        skinny_gemm.chunk_rows(lib, chunk)
        skinny_gemm.stream_ahead(lib, ahead)


def bf16_ring_call(library, ring: list[torch.Tensor], x: torch.Tensor, weight_t: torch.Tensor):
    """A call of `library`'s bf16 GEMM on every packed weight of `ring` in turn (torch's `x @ w` on each weight where
    `library` is None), first checked against torch."""
    n = weight_t.shape[1]
    if library is None:
        return lambda: [x @ w for w in ring]
    torch.testing.assert_close(skinny_gemm.bf16_gemm(library, x, ring[0], n, None), x @ weight_t, atol=0.1, rtol=0.02)
    return lambda: [skinny_gemm.bf16_gemm(library, x, p, n, None) for p in ring]


def compare_bf16(lib, args) -> None:
    """A bfloat16 model's layers: torch's bf16 GEMM on input-major weights (the `torch` layout), or with
    `args.baseline_lib` that build's bf16 GEMM, against this build's bf16 GEMM on packed panels, each call taking the
    next of a ring of copies of the layer (more than `args.ring_mb` MB: weights read from memory, as in a step), the
    two alternating ring pass by ring pass."""
    old = None
    if args.baseline_lib is not None:
        old = skinny_gemm.load_library(args.baseline_lib.resolve())
        if old is None or not skinny_gemm.bf16_available(old):
            raise SystemExit(f"{args.baseline_lib} is missing or has no bf16 GEMM")
    if not skinny_gemm.bf16_available(lib):
        raise SystemExit("no bf16 GEMM here: the processor has no AVX512-BF16")
    before = "torch input-major" if old is None else "baseline bf16"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bf16; best of {args.repeat} ring passes; "
          f"ms per call, weights from memory (rings of > {args.ring_mb} MB)"
          + ("" if old is None else f"; baseline {args.baseline_lib}"))
    print(f"| layer (K x N) | rows | {before} | native bf16 | speed-up | native GFLOP/s |\n"
          "|---|---:|---:|---:|---:|---:|")
    for name, (k, n) in layer_shapes(args.checkpoint).items():
        weight_t = torch.randn(k, n).to(torch.bfloat16)
        copies = max(2, -(-args.ring_mb * 2**20 // (k * n * 2)))
        before_ring = [weight_t.clone() if old is None else skinny_gemm.bf16_pack(old, weight_t)
                       for _ in range(copies)]
        native_ring = [skinny_gemm.bf16_pack(lib, weight_t) for _ in range(copies)]
        for rows in args.rows:
            x = torch.randn(rows, k).to(torch.bfloat16)
            calls = [bf16_ring_call(library, ring, x, weight_t)
                     for library, ring in ((old, before_ring), (lib, native_ring))]
            ms = [t / copies for t in best_ms(*calls, repeat=args.repeat, calls=1)]
            print(f"| {name} ({k} x {n}) | {rows} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[0] / ms[1]:.2f}x | "
                  f"{2 * rows * k * n / ms[1] / 1e6:.0f} |", flush=True)
        before_ring.clear(), native_ring.clear()  # (freed before the next layer's rings)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="build/models/bench-medium")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 2048])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--baseline-lib", type=Path, metavar="SO", help="another build of the library, timed beside")
    parser.add_argument("--chunk-rows", type=int, nargs="+", metavar="K",
                        help="compare these panel chunk sizes of this build, weights read from memory")
    parser.add_argument("--stream-ahead", type=int, nargs="+", metavar="BYTES",
                        help="compare these prefetch distances of walks of up to 6 rows (0: the next chunk), "
                             "weights read from memory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16: torch's bf16 GEMM against the bf16 GEMM, weights read from memory")
    parser.add_argument("--ring-mb", type=int, default=1024,
                        help="with --chunk-rows, --stream-ahead or --dtype bfloat16: each layer's ring of copies")
    args = parser.parse_args(argv)
    if args.dtype == "bfloat16" and (args.chunk_rows or args.stream_ahead):
        parser.error("--chunk-rows and --stream-ahead set the float32 GEMM's walk; not with --dtype bfloat16")
    lib = skinny_gemm.load_library()
    if lib is None:
        raise SystemExit("build/lib/libinflight_sgemm_cpu.so is missing or built without AVX-512: `make native`")
    if args.dtype == "bfloat16":
        return compare_bf16(lib, args)
    if args.baseline_lib is not None:
        return compare_builds(lib, args)
    if args.chunk_rows or args.stream_ahead:
        return compare_settings(lib, args)
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

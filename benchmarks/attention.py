"""Decode paged attention: torch reference vs native CPU kernel, side by side in one run.

    .venv/bin/python benchmarks/attention.py [--batches 1 8 32 64] [--contexts 128 512 2048] [--repeat 7]
                                             [--device cpu|cuda] [--dtype float32|bfloat16|float16]

Head size 64, 8 query heads / 2 KV heads, block size 16, fp32, block tables in random physical order. The
memory-bandwidth floor is the bytes of K and V one decode step reads divided by the copy bandwidth measured
here (STREAM convention: bytes read + bytes written per second by a large tensor copy). Every figure is the
best of --repeat runs (the least disturbed by other load on a shared machine), bandwidth included.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inflight_backend.attention import NativePagedAttention, TorchPagedAttention, load_library  # noqa: E402
from inflight_backend.attention.base import AttentionMetadata  # noqa: E402

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode_batch(batch: int, context: int, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    rng = random.Random(seed)
    per_seq = -(-context // BLOCK_SIZE)
    physical = list(range(batch * per_seq))
    rng.shuffle(physical)
    tables = [physical[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    shape = (batch * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    q = torch.randn(batch, HEADS, HEAD_SIZE, device=device, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_start_loc=list(range(batch + 1)), context_lens=[context] * batch, decode_only=True,
        query_start_loc_tensor=torch.arange(batch + 1, dtype=torch.int32, device=device),
        context_lens_tensor=torch.full((batch,), context, dtype=torch.int32, device=device))
    return q, k_cache, v_cache, meta


def seconds(fn, repeat: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()  # warm up
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(num_bytes: int = 512 << 20, repeat: int = 9, device: str = "cpu") -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * num_bytes / seconds(lambda: dst.copy_(src), repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    args = parser.parse_args()
    lib = load_library(args.device)
    if lib is None:
        sys.exit(f"the {args.device} kernel library is missing: run `make native` first")
    dtype = DTYPES[args.dtype]
    native, reference = NativePagedAttention(lib, args.device), TorchPagedAttention()
    bandwidth = copy_bandwidth(device=args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"torch {torch.__version__}, {where}, {args.dtype}; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| batch | context | torch ref (ms) | native (ms) | speed-up | KV bytes | floor (ms) | native / floor |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    scale = HEAD_SIZE ** -0.5
    for batch in args.batches:
        for context in args.contexts:
            q, k_cache, v_cache, meta = decode_batch(batch, context, device=args.device, dtype=dtype)
            t_ref = seconds(lambda: reference.forward(q, k_cache, v_cache, meta, scale), args.repeat)
            t_nat = seconds(lambda: native.forward(q, k_cache, v_cache, meta, scale), args.repeat)
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_SIZE * k_cache.element_size()
            floor = kv_bytes / bandwidth
            print(f"| {batch} | {context} | {t_ref * 1e3:.3f} | {t_nat * 1e3:.3f} | {t_ref / t_nat:.1f}x | "
                  f"{kv_bytes / 1e6:.1f} MB | {floor * 1e3:.3f} | {t_nat / floor:.2f} |")


if __name__ == "__main__":
    main()

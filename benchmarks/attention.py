"""Paged attention: torch reference vs native kernel, side by side in one run; decode, or prefill chunks.

    .venv/bin/python benchmarks/attention.py [--batches 1 8 32 64] [--contexts 128 512 2048] [--repeat 7]
                                             [--device cpu|cuda] [--dtype float32|bfloat16|float16]
    .venv/bin/python benchmarks/attention.py --prefill 512x512 512x2048 2048x2048
    .venv/bin/python benchmarks/attention.py --mixed 256x2000+15 2000x2000+15

`--prefill QxC`: one sequence whose last Q of C context tokens are new queries (a prompt chunk; Q = C is a whole
prompt), causal; beside the reference it times torch's own fused attention (`scaled_dot_product_attention` on
K/V gathered from the blocks, with the causal mask) as the peer a hand-written kernel should reach.
`--shape 32 8 128 --calls 20 --baseline-lib OLD.so`: the model's heads, back-to-back calls per timing (decode
tables; on a GPU the kernel's time, not the launch's), and an older build of the kernel library timed beside
this one in the same run (benchmarks/gpu_check.sh builds the parent commit's CUDA kernel that way). `--shape`
and `--baseline-lib` apply to `--prefill` too (`--shape 16 4 64`: the large bench model's heads).
`--layers N` (decode tables): N caches, one a layer, each timing one call per layer in turn, so every call reads
its K and V from memory as in a model's step (the caches together larger than the last-level cache), against the
read bandwidth (a large tensor's sum) as well as the copy bandwidth.
`--kv-pages small`: the decode caches in torch's own allocations instead of the engine's pool mappings.
`--mixed QxC+B`: a fused step, B decodes over C keys each and that prompt chunk last, timed as one call and as
the chunk and the decodes in two calls: a mixed call should cost no more than the two.

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
from inflight_backend.attention.random_batch import random_batch  # noqa: E402
from inflight_backend.runners import kv_pool  # noqa: E402

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 2, 64, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode_batch(batch: int, context: int, seed: int = 0, device: str = "cpu", dtype=torch.float32,
                 heads: int = HEADS, kv_heads: int = KV_HEADS, head_size: int = HEAD_SIZE):
    rng = random.Random(seed)
    per_seq = -(-context // BLOCK_SIZE)
    physical = list(range(batch * per_seq))
    rng.shuffle(physical)
    tables = [physical[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    shape = (batch * per_seq, BLOCK_SIZE, kv_heads, head_size)
    k_cache, v_cache = (_pool(shape, dtype, device).copy_(torch.randn(shape, device=device, dtype=dtype))
                        for _ in range(2))
    q = torch.randn(batch, heads, head_size, device=device, dtype=dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_start_loc=list(range(batch + 1)), context_lens=[context] * batch, decode_only=True,
        query_start_loc_tensor=torch.arange(batch + 1, dtype=torch.int32, device=device),
        context_lens_tensor=torch.full((batch,), context, dtype=torch.int32, device=device))
    return q, k_cache, v_cache, meta


def _pool(shape, dtype, device) -> torch.Tensor:
    """A cache tensor as the engine's KV pool allocates it (runners/kv_pool.py), or with --kv-pages small as
    torch does."""
    if SMALL_PAGES:
        return torch.empty(shape, dtype=dtype, device=device)
    return kv_pool.zeros(shape, dtype, torch.device(device))


SMALL_PAGES = False


def prefill_chunk(num_queries: int, context: int, seed: int = 0, device: str = "cpu", dtype=torch.float32,
                  heads: int = HEADS, kv_heads: int = KV_HEADS, head_size: int = HEAD_SIZE):
    """One sequence: `num_queries` new tokens at the end of a `context`-token context, blocks shuffled."""
    q, k_cache, v_cache, meta = decode_batch(1, context, seed, device, dtype, heads, kv_heads, head_size)
    q = torch.randn(num_queries, heads, head_size, device=device, dtype=dtype)
    meta.query_start_loc, meta.decode_only = [0, num_queries], False
    meta.query_start_loc_tensor = torch.tensor([0, num_queries], dtype=torch.int32, device=device)
    return q, k_cache, v_cache, meta


def mixed_table(native, specs: list[str], repeat: int, device: str, dtype) -> None:
    print("| queries | context | decodes | mixed call (ms) | chunk alone (ms) | decodes alone (ms) | "
          "mixed / (chunk + decodes) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    scale = HEAD_SIZE ** -0.5
    for spec in specs:
        chunk, _, decodes = spec.lower().partition("+")
        num_queries, context = (int(x) for x in chunk.split("x"))
        calls = []
        for lengths in ([(context, 1)] * int(decodes) + [(context, num_queries)], [(context, num_queries)],
                        [(context, 1)] * int(decodes)):
            q, k_cache, v_cache, meta = random_batch(
                random.Random(0), block_size=BLOCK_SIZE, num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                dtype=dtype, device=device, lengths=lengths)
            calls.append(seconds(lambda: native.forward(q, k_cache, v_cache, meta, scale), repeat))
        mixed, alone, dec = calls
        print(f"| {num_queries} | {context} | {decodes} | {mixed * 1e3:.2f} | {alone * 1e3:.2f} | {dec * 1e3:.2f} | "
              f"{mixed / (alone + dec):.2f} |")


def fused_sdpa(q, k_cache, v_cache, meta, scale):
    """torch's fused attention on one sequence's gathered K/V (the gather is part of the cost, as for the
    reference), causal with the queries at the end of the context."""
    context, num_queries = meta.context_lens[0], q.shape[0]
    blocks = meta.block_tables[0, : -(-context // k_cache.shape[1])]
    k = k_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)
    v = v_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)
    positions = torch.arange(context, device=q.device)
    mask = positions.unsqueeze(0) <= positions[context - num_queries:].unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=True)
    return out.transpose(0, 1)


def prefill_table(native, reference, specs: list[str], repeat: int, device: str, dtype,
                  shape: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_SIZE), baseline=None) -> None:
    """One row per QxC spec; with `baseline` (another build of the library) its time and native / baseline,
    the two timed alternately."""
    heads, kv_heads, head_size = shape
    extra = ("baseline (ms) | native / baseline | ", "---:|---:|") if baseline else ("", "")
    print("| queries | context | torch ref (ms) | torch SDPA (ms) | native (ms) | native GFLOP/s | "
          f"{extra[0]}ref / native | SDPA / native |")
    print(f"|---:|---:|---:|---:|---:|---:|{extra[1]}---:|---:|")
    scale = head_size ** -0.5
    for spec in specs:
        num_queries, context = (int(x) for x in spec.lower().split("x"))
        q, k_cache, v_cache, meta = prefill_chunk(num_queries, context, device=device, dtype=dtype, heads=heads,
                                                  kv_heads=kv_heads, head_size=head_size)
        t_ref = seconds(lambda: reference.forward(q, k_cache, v_cache, meta, scale), repeat)
        t_sdpa = seconds(lambda: fused_sdpa(q, k_cache, v_cache, meta, scale), repeat)
        t_nat, t_base = float("inf"), float("inf")
        for _ in range(repeat):  # alternating, so a slow phase of the machine hits both builds
            t_nat = min(t_nat, seconds(lambda: native.forward(q, k_cache, v_cache, meta, scale), 1))
            if baseline:
                t_base = min(t_base, seconds(lambda: baseline.forward(q, k_cache, v_cache, meta, scale), 1))
        keys_seen = num_queries * (context - num_queries) + num_queries * (num_queries + 1) / 2
        flops = 4 * heads * head_size * keys_seen  # QK^T and PV, multiply-add = 2
        side = f"{t_base * 1e3:.2f} | {t_nat / t_base:.2f} | " if baseline else ""
        print(f"| {num_queries} | {context} | {t_ref * 1e3:.2f} | {t_sdpa * 1e3:.2f} | {t_nat * 1e3:.2f} | "
              f"{flops / t_nat / 1e9:.0f} | {side}{t_ref / t_nat:.2f} | {t_sdpa / t_nat:.2f} |")


def seconds(fn, repeat: int, calls: int = 1) -> float:
    """Best of `repeat` timings of `calls` back-to-back calls (on a GPU: launched without waiting, then one
    synchronisation), per call."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()  # warm up
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def copy_bandwidth(num_bytes: int = 512 << 20, repeat: int = 9, device: str = "cpu") -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * num_bytes / seconds(lambda: dst.copy_(src), repeat)


def read_bandwidth(num_bytes: int = 512 << 20, repeat: int = 9, device: str = "cpu") -> float:
    """Bytes read per second by the sum of a large tensor (the floor of a kernel that only reads)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    return num_bytes / seconds(x.sum, repeat)


def decode_table(native, reference, args, dtype, baseline=None) -> None:
    """One row per (batch, context) of --batches x --contexts: a decode step's call, with --shape, --calls,
    --layers (cold caches, against the read bandwidth) and `baseline` (another build of the library) as asked."""
    bandwidth = copy_bandwidth(device=args.device)
    reads = read_bandwidth(device=args.device) if args.layers > 1 else None
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} CPU threads"
    heads, kv_heads, head_size = args.shape
    print(f"torch {torch.__version__}, {where}, {args.dtype}, {heads} heads / {kv_heads} KV heads, head size "
          f"{head_size}, {args.calls} call(s) a timing; copy bandwidth {bandwidth / 1e9:.1f} GB/s"
          + ("" if reads is None else f"; {args.layers} layers, a call each, cold caches: read bandwidth "
                                      f"{reads / 1e9:.1f} GB/s"))
    extra = ("| baseline (ms) | native / baseline ", "---:|") if baseline else ("", "")
    cold = ("| read floor (ms) | native / read floor ", "---:|---:|") if reads else ("", "")
    print(f"| batch | context | torch ref (ms) | native (ms) {extra[0]}| speed-up | KV bytes | floor (ms) | "
          f"native / floor {cold[0]}|")
    print(f"|---:|---:|---:|---:|{extra[1] * 2 if baseline else ''}---:|---:|---:|---:|{cold[1]}")
    scale = head_size ** -0.5
    for batch in args.batches:
        for context in args.contexts:
            q, k_cache, v_cache, meta = decode_batch(batch, context, device=args.device, dtype=dtype, heads=heads,
                                                     kv_heads=kv_heads, head_size=head_size)
            caches = [(k_cache, v_cache)] + [decode_batch(batch, context, seed=layer, device=args.device, dtype=dtype,
                                                          heads=heads, kv_heads=kv_heads, head_size=head_size)[1:3]
                                             for layer in range(1, args.layers)]
            t_ref = seconds(lambda: reference.forward(q, k_cache, v_cache, meta, scale), args.repeat)
            t_nat = seconds(_each_layer(native, q, caches, meta, scale), args.repeat, args.calls * args.layers)
            side = ""
            if baseline:
                t_base = seconds(_each_layer(baseline, q, caches, meta, scale), args.repeat,
                                 args.calls * args.layers)
                side = f"{t_base * 1e3:.3f} | {t_nat / t_base:.2f} | "
            kv_bytes = 2 * batch * context * kv_heads * head_size * k_cache.element_size()
            floor = kv_bytes / bandwidth
            read_floor = "" if reads is None else f" {kv_bytes / reads * 1e3:.3f} | {t_nat * reads / kv_bytes:.2f} |"
            print(f"| {batch} | {context} | {t_ref * 1e3:.3f} | {t_nat * 1e3:.3f} | {side}{t_ref / t_nat:.1f}x | "
                  f"{kv_bytes / 1e6:.1f} MB | {floor * 1e3:.3f} | {t_nat / floor:.2f} |{read_floor}")
            del caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--prefill", nargs="+", metavar="QxC", help="time prompt chunks instead of decode")
    parser.add_argument("--mixed", nargs="+", metavar="QxC+B", help="time a prompt chunk beside B decodes")
    parser.add_argument("--shape", type=int, nargs=3, metavar=("HEADS", "KV_HEADS", "HEAD_SIZE"),
                        default=[HEADS, KV_HEADS, HEAD_SIZE],
                        help="decode and prefill tables: e.g. 32 8 128 (Llama 3 8B)")
    parser.add_argument("--calls", type=int, default=1,
                        help="decode tables: back-to-back calls per timing (on a GPU, 20 or so hide the launch)")
    parser.add_argument("--layers", type=int, default=1,
                        help="decode tables: one cache a layer, each timing one call per layer (cold caches)")
    parser.add_argument("--kv-pages", choices=["pool", "small"], default="pool",
                        help="decode tables: caches in the engine's pool mappings (2 MiB pages where Linux has "
                             "them, runners/kv_pool.py) or in torch's own allocations (4 KiB pages)")
    parser.add_argument("--baseline-lib", type=Path, metavar="SO",
                        help="decode and prefill tables: another build of the kernel library (an older "
                             "commit's), timed beside this one in the same run")
    args = parser.parse_args()
    global SMALL_PAGES
    SMALL_PAGES = args.kv_pages == "small"
    lib = load_library(args.device)
    if lib is None:
        sys.exit(f"the {args.device} kernel library is missing: run `make native` first")
    baseline = None
    if args.baseline_lib is not None:
        baseline = NativePagedAttention(load_library(args.device, args.baseline_lib), args.device)
    dtype = DTYPES[args.dtype]
    native, reference = NativePagedAttention(lib, args.device), TorchPagedAttention()
    if args.prefill or args.mixed:
        heads, kv_heads, head_size = args.shape if args.prefill else (HEADS, KV_HEADS, HEAD_SIZE)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {args.dtype}, "
              f"{heads} heads / {kv_heads} KV heads, head size {head_size}")
        if args.prefill:
            return prefill_table(native, reference, args.prefill, args.repeat, args.device, dtype,
                                 (heads, kv_heads, head_size), baseline)
        return mixed_table(native, args.mixed, args.repeat, args.device, dtype)
    decode_table(native, reference, args, dtype, baseline)


def _each_layer(kernel, q, caches, meta, scale):
    """A call that attends over the next layer's cache each time it is called (the layers in turn)."""
    turn = iter(range(1 << 62))

    def call():
        k_cache, v_cache = caches[next(turn) % len(caches)]
        return kernel.forward(q, k_cache, v_cache, meta, scale)
    return call


if __name__ == "__main__":
    main()

"""The TensorRT plugin's argument mapping (descriptors and pointers to the kernel's C ABI), driven on the CPU with
host buffers into the CPU kernel, against the torch reference."""
import random

import numpy as np
import pytest
import torch

from inflight_backend.attention import TorchPagedAttention, load_library
from inflight_backend.tensorrt.kernel_args import PluginFields, launch
from inflight_backend.attention.random_batch import random_batch


@pytest.mark.parametrize("window", [0, 5])
def test_plugin_mapping_drives_the_cpu_kernel_like_the_reference(window):
    lib = load_library("cpu")
    assert lib is not None, "build/lib/libinflight_pa_cpu.so is missing: run `make native`"
    layers, layer, heads, kv_heads, d, bs = 3, 1, 8, 2, 64, 16
    q, k_cache, v_cache, meta = random_batch(random.Random(0), num_seqs=4, block_size=bs, num_heads=heads,
                                             num_kv_heads=kv_heads, head_size=d, max_context=90, max_query=7,
                                             dtype=torch.float32)
    num_tokens, num_blocks = q.shape[0], k_cache.shape[0]
    # New tokens' K/V go to the last positions of each sequence, as the engine would place them.
    slots = []
    for i, ctx in enumerate(meta.context_lens):
        for pos in range(ctx - (meta.query_start_loc[i + 1] - meta.query_start_loc[i]), ctx):
            slots.append(int(meta.block_tables[i, pos // bs]) * bs + pos % bs)
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    k_new, v_new = torch.randn(num_tokens, kv_heads, d), torch.randn(num_tokens, kv_heads, d)
    pool = torch.randn(layers, 2, num_blocks, bs, kv_heads, d)
    pool[layer, 0], pool[layer, 1] = k_cache, v_cache

    reference = TorchPagedAttention()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(k_ref, v_ref, k_new, v_new, meta)
    want = reference.forward(q, k_ref, v_ref, meta, d ** -0.5, window)

    arrays = [q.numpy(), k_new.numpy(), v_new.numpy(), pool.numpy(), meta.block_tables.numpy(),
              meta.context_lens_tensor.numpy(), meta.query_start_loc_tensor.numpy(), meta.slot_mapping.numpy()]
    out = np.empty_like(arrays[0])
    fields = PluginFields(layer, heads, kv_heads, d, bs, d ** -0.5, sliding_window=window)
    others = pool.clone()
    status = launch(lib, "cpu", fields, [a.shape for a in arrays], 0, [a.ctypes.data for a in arrays],
                    out.ctypes.data)
    assert status == 0
    assert np.abs(out - want.numpy()).max() < 2e-5
    assert torch.equal(pool[layer, 0], k_ref) and torch.equal(pool[layer, 1], v_ref)  # written in place
    untouched = [i for i in range(layers) if i != layer]
    assert torch.equal(pool[untouched], others[untouched])  # other layers' caches are left alone

"""Evaluating the exported ONNX graph on the CPU: onnx's ReferenceEvaluator with `PagedAttention` implemented by
our native CPU kernel (the torch reference when the library is not built)."""
from __future__ import annotations

import numpy as np
import torch
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from ..attention import AttentionMetadata, make_backend
from .onnx_export import DOMAIN


class PagedAttention(OpRun):
    op_domain = DOMAIN

    def _run(self, q, k, v, kv_pool, block_tables, context_lens, query_start_loc, slot_mapping, layer=None,
             num_heads=None, num_kv_heads=None, head_size=None, block_size=None, scale=None, sliding_window=0):
        pool = torch.from_numpy(kv_pool.copy())  # a node's output must not alias its input here
        k_cache, v_cache = pool[layer, 0], pool[layer, 1]
        qsl = query_start_loc.tolist()
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)),
            block_tables=torch.from_numpy(block_tables.astype(np.int32)), query_start_loc=qsl,
            context_lens=context_lens.tolist(), decode_only=qsl[-1] == len(qsl) - 1,
            query_start_loc_tensor=torch.from_numpy(query_start_loc.astype(np.int32)),
            context_lens_tensor=torch.from_numpy(context_lens.astype(np.int32)))
        backend = make_backend("auto", "cpu")
        backend.write_kv(k_cache, v_cache, torch.from_numpy(np.ascontiguousarray(k)),
                         torch.from_numpy(np.ascontiguousarray(v)), meta)
        out = backend.forward(torch.from_numpy(np.ascontiguousarray(q)), k_cache, v_cache, meta, scale,
                              sliding_window or 0)
        return out.numpy(), pool.numpy()


def evaluator(model) -> ReferenceEvaluator:
    return ReferenceEvaluator(model, new_ops=[PagedAttention])  # type: ignore[list-item]  # (classes, as documented)

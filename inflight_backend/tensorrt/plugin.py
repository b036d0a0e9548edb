"""The PagedAttention TensorRT plugin: a Python IPluginV3 whose enqueue launches the CUDA kernels of
plugins/paged_attention (no TensorRT headers exist on our machines, so no C++ plugin).

Outputs: the attention output (like q) and the KV pool, aliased to the pool input (updated in place; needs the
preview feature ALIASED_PLUGIN_IO_10_03).
"""
from __future__ import annotations

import numpy as np

from ..attention import kernel_abi as abi
from . import kernel_args
from .kernel_args import PluginFields
from .trt_module import import_trt

trt = import_trt()
PLUGIN_NAME, PLUGIN_VERSION = "PagedAttention", "1"
INT_FIELDS = ("layer", "num_heads", "num_kv_heads", "head_size", "block_size", "sliding_window")
PA_DTYPE = {trt.DataType.FLOAT: abi.PA_FLOAT32, trt.DataType.BF16: abi.PA_BFLOAT16,
            trt.DataType.HALF: abi.PA_FLOAT16}
INDEX_TYPES = {kernel_args.BLOCK_TABLES: trt.DataType.INT32, kernel_args.CONTEXT_LENS: trt.DataType.INT32,
               kernel_args.QUERY_START_LOC: trt.DataType.INT32, kernel_args.SLOT_MAPPING: trt.DataType.INT64}


class PagedAttentionPlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuildV2, trt.IPluginV3OneRuntime):
    def __init__(self, fields: PluginFields) -> None:
        trt.IPluginV3.__init__(self)
        trt.IPluginV3OneCore.__init__(self)
        trt.IPluginV3OneBuildV2.__init__(self)
        trt.IPluginV3OneRuntime.__init__(self)
        self.fields = fields
        self.num_outputs = 2
        self.plugin_namespace = ""
        self.plugin_name = PLUGIN_NAME
        self.plugin_version = PLUGIN_VERSION
        self.timing_cache_id = ""
        self._lib = None

    def get_capability_interface(self, kind):
        return self

    def clone(self):
        return PagedAttentionPlugin(self.fields)

    def get_fields_to_serialize(self):
        f = self.fields
        values = [trt.PluginField(n, np.array([getattr(f, n)], dtype=np.int32), trt.PluginFieldType.INT32)
                  for n in INT_FIELDS]
        values.append(trt.PluginField("scale", np.array([f.scale], dtype=np.float32), trt.PluginFieldType.FLOAT32))
        return trt.PluginFieldCollection(values)

    # Build: types, shapes, formats, aliasing, workspace.
    def get_output_data_types(self, input_types):
        return [input_types[kernel_args.Q], input_types[kernel_args.POOL]]

    def get_output_shapes(self, inputs, shape_inputs, expr_builder):
        return [trt.DimsExprs(inputs[kernel_args.Q]), trt.DimsExprs(inputs[kernel_args.POOL])]

    def get_aliased_input(self, output_index):
        return kernel_args.POOL if output_index == 1 else -1

    def supports_format_combination(self, pos, in_out, num_inputs):
        desc = in_out[pos].desc
        if desc.format != trt.TensorFormat.LINEAR:
            return False
        if pos in INDEX_TYPES:
            return desc.type == INDEX_TYPES[pos]
        if pos == kernel_args.Q:
            return desc.type in PA_DTYPE
        return desc.type == in_out[kernel_args.Q].desc.type  # k, v, pool and both outputs: q's type

    def configure_plugin(self, inputs, outputs):
        pass

    def get_workspace_size(self, inputs, outputs):
        dims = [tuple(d.max) for d in inputs]
        return kernel_args.workspace_size(self._cuda_lib(), self.fields, dims, PA_DTYPE[inputs[0].desc.type])

    def get_valid_tactics(self):
        return []

    # Runtime.
    def on_shape_change(self, inputs, outputs):
        pass

    def set_tactic(self, tactic):
        pass

    def attach_to_context(self, context):
        return self.clone()

    def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
        dims = [tuple(d.dims) for d in input_desc]
        pa_dtype = PA_DTYPE[input_desc[0].type]
        size = kernel_args.workspace_size(self._cuda_lib(), self.fields, dims, pa_dtype)
        status = kernel_args.launch(self._cuda_lib(), "cuda", self.fields, dims, pa_dtype, list(inputs), outputs[0],
                                    workspace, size, stream)
        if status != 0:
            raise RuntimeError(f"PagedAttention kernels failed with status {status}")

    def _cuda_lib(self):
        if self._lib is None:
            self._lib = abi.load_library("cuda")
            if self._lib is None:
                raise RuntimeError("build/lib/libinflight_pa_cuda.so is missing: run `make native` where nvcc is")
        return self._lib


class PagedAttentionCreator(trt.IPluginCreatorV3One):
    def __init__(self) -> None:
        trt.IPluginCreatorV3One.__init__(self)
        self.name = PLUGIN_NAME
        self.plugin_namespace = ""
        self.plugin_version = PLUGIN_VERSION
        fields = [trt.PluginField(n, np.array([], dtype=np.int32), trt.PluginFieldType.INT32) for n in INT_FIELDS]
        fields.append(trt.PluginField("scale", np.array([], dtype=np.float32), trt.PluginFieldType.FLOAT32))
        self.field_names = trt.PluginFieldCollection(fields)

    def create_plugin(self, name, field_collection, phase):
        values = {f.name: f.data for f in field_collection}
        ints = {n: int(np.asarray(values[n]).reshape(-1)[0]) for n in INT_FIELDS if n in values}  # engines
        # built before sliding_window existed have none: PluginFields' default (no window)
        return PagedAttentionPlugin(PluginFields(**ints, scale=float(np.asarray(values["scale"]).reshape(-1)[0])))


_registered = False


def register() -> None:
    """Register the creator with TensorRT's plugin registry (once per process)."""
    global _registered
    if not _registered:
        trt.get_plugin_registry().register_creator(PagedAttentionCreator(), "")
        _registered = True

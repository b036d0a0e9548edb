"""Typed, validated engine configuration, read from a model's config.pbtxt parameters."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

ENGINES = ("pytorch", "tensorrt", "null")  # null: computes nothing (serving-path benchmarks)
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "native", "torch")
LINEAR_BACKENDS = ("auto", "native", "torch")
AMX_GEMM = ("auto", "on", "off")
GREEDY_SCREEN = ("auto", "on", "off")
CUDA_FUSED_OPS = ("auto", "on", "off")
BATCHING_POLICIES = ("static", "prefill_first", "fused")
CAPACITY_POLICIES = ("guaranteed_no_evict", "max_utilization")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the in-flight batch manager and its engine need to start.

    Attributes mirror the `parameters` of `model_repository/llm/config.pbtxt`; README documents each.
    """

    checkpoint: str
    engine: str = "pytorch"
    engine_path: str = ""  # engine: tensorrt: the directory `inflight build-engine --out` wrote
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"  # native kernels when built, else the torch reference
    linear_backend: str = "auto"  # CPU linear layers: native skinny GEMM (fp32, AVX-512 or AVX2) when built, else torch
    amx_gemm: str = "auto"  # native layout: prefill-sized GEMMs through AMX (bf16x6, fp32 accuracy) where available
    greedy_screen: str = "auto"  # native layout: all-greedy steps' LM head screened (fp32 in bf16, bf16 in int8)
    block_size: int = 16
    num_kv_blocks: int = 512  # KV pool size in blocks; 0 sizes it to fit every sequence at full context
    max_batch_size: int = 64  # running sequences per iteration
    max_num_tokens: int = 1024  # packed tokens per iteration (prefill + decode)
    enable_chunked_prefill: bool = False
    cuda_graphs: bool = False  # pytorch engine on CUDA: decode steps replayed as CUDA graphs (runners/cuda_graphs.py)
    cuda_fused_ops: str = "off"  # pytorch engine on CUDA: residual add + RMSNorm, rotary, SiLU-mul as one kernel each
    enable_kv_cache_reuse: bool = True  # prefix caching: full blocks of computed prefixes are reused by later requests
    cache_aware_admission_ms: float = 0.0  # > 0: admit longest cached prefix first, none passed over longer; 0: off
    max_chunk_tokens: int = 0  # chunked prefill: most prompt tokens one request computes per step; 0: the budget
    step_time_target_ms: float = 0.0  # > 0 (fused, chunked): each step's budget sized to run in this long; 0: off
    batching_policy: str = "fused"  # static | prefill_first | fused
    capacity_policy: str = "guaranteed_no_evict"  # guaranteed_no_evict | max_utilization
    max_queue_delay_ms: float = 0.0  # static: how long a partial batch waits to fill
    max_queue_size: int = 0  # waiting requests beyond this get "queue full" at once; 0: unlimited
    priority_aging_s: float = 10.0  # waiting requests gain one priority level per this many seconds
    default_max_tokens: int = 64  # when a request gives no max_tokens
    cancel_check_interval_ms: float = 50.0  # how often every open stream is asked whether its client has gone
    cancel_check_max_share: float = 0.1  # the most of the time those asks may take (longer sweeps: later ticks)
    max_prompt_bytes: int = 0  # text_input larger than this is refused before tokenizing; 0: 32 x model context
    max_prompt_tokens: int = 0  # 0: the model's context - 1
    seed: int = 0  # engine-wide seed for sampled requests that give none
    cpu_threads: int = 0  # threads a step computes on; 0: torch's default, shared among the model's instances

    def __post_init__(self) -> None:
        _check(self.engine in ENGINES, f"engine must be one of {ENGINES}, got {self.engine!r}")
        _check(not self.cuda_graphs or self.engine == "pytorch", "cuda_graphs: true applies to engine: pytorch")
        _check(self.cuda_fused_ops != "on" or self.engine == "pytorch", "cuda_fused_ops: on applies to engine: pytorch")
        _check(self.engine != "tensorrt" or bool(self.engine_path),
               "engine: tensorrt needs engine_path (the output directory of `inflight build-engine`)")
        _check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _check(self.linear_backend in LINEAR_BACKENDS,
               f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}")
        _check(self.amx_gemm in AMX_GEMM, f"amx_gemm must be one of {AMX_GEMM}, got {self.amx_gemm!r}")
        _check(self.greedy_screen in GREEDY_SCREEN,
               f"greedy_screen must be one of {GREEDY_SCREEN}, got {self.greedy_screen!r}")
        _check(self.cuda_fused_ops in CUDA_FUSED_OPS,
               f"cuda_fused_ops must be one of {CUDA_FUSED_OPS}, got {self.cuda_fused_ops!r}")
        _check(1 <= self.block_size <= 1024, f"block_size must be in [1, 1024], got {self.block_size}")
        _check(self.num_kv_blocks >= 0, f"num_kv_blocks must be >= 0, got {self.num_kv_blocks}")
        _check(self.max_batch_size >= 1, f"max_batch_size must be >= 1, got {self.max_batch_size}")
        _check(self.max_num_tokens >= self.max_batch_size,
               f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size ({self.max_batch_size})")
        _check(self.max_chunk_tokens >= 0, f"max_chunk_tokens must be >= 0, got {self.max_chunk_tokens}")
        _check(self.step_time_target_ms >= 0, f"step_time_target_ms must be >= 0, got {self.step_time_target_ms}")
        _check(not self.step_time_target_ms or (self.enable_chunked_prefill and self.batching_policy == "fused"),
               "step_time_target_ms applies to batching_policy fused with enable_chunked_prefill: true (it sizes "
               "each step's prompt chunks)")
        _check(self.default_max_tokens >= 1, "default_max_tokens must be >= 1")
        _check(self.cancel_check_interval_ms > 0, "cancel_check_interval_ms must be > 0")
        _check(self.cpu_threads >= 0, "cpu_threads must be >= 0 (0: torch's default, shared among the instances)")
        _check(0 < self.cancel_check_max_share <= 1, "cancel_check_max_share must be in (0, 1]")
        _check(self.max_prompt_bytes >= 0, "max_prompt_bytes must be >= 0")
        _check(self.max_prompt_tokens >= 0, "max_prompt_tokens must be >= 0")
        check_policies(self.batching_policy, self.capacity_policy)
        _check(self.max_queue_delay_ms >= 0, "max_queue_delay_ms must be >= 0")
        _check(self.max_queue_size >= 0, "max_queue_size must be >= 0")
        _check(self.priority_aging_s > 0, "priority_aging_s must be > 0")
        _check(self.cache_aware_admission_ms >= 0, "cache_aware_admission_ms must be >= 0")

    @classmethod
    def from_parameters(cls, params: dict[str, str], base_dir: str = ".") -> EngineConfig:
        """Build from string parameters (config.pbtxt); a relative checkpoint path is taken from `base_dir`."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - set(fields))
        _check(not unknown, f"unknown parameters: {unknown}; known: {sorted(fields)}")
        _check("checkpoint" in params, "parameter 'checkpoint' (a Hugging Face model directory) is required")
        values = {name: _parse(fields[name], raw) for name, raw in params.items()}
        path = os.path.expandvars(os.path.expanduser(values["checkpoint"]))
        values["checkpoint"] = os.path.normpath(os.path.join(base_dir, path))
        if values.get("engine_path"):
            engine_path = os.path.expandvars(os.path.expanduser(values["engine_path"]))
            values["engine_path"] = os.path.normpath(os.path.join(base_dir, engine_path))
        return cls(**values)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _parse(field: dataclasses.Field, raw: str):
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    text = str(raw).strip()
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ValueError(f"parameter {field.name!r}: expected {kind}, got {raw!r}") from None
    return text


def check_policies(batching_policy: str, capacity_policy: str) -> None:
    """The policy names, checked here for a model's configuration and for the scheduler's own (SchedulerConfig)."""
    _check(batching_policy in BATCHING_POLICIES,
           f"batching_policy must be one of {BATCHING_POLICIES}, got {batching_policy!r}")
    _check(capacity_policy in CAPACITY_POLICIES,
           f"capacity_policy must be one of {CAPACITY_POLICIES}, got {capacity_policy!r}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def instance_count(model_config: dict) -> int:
    """How many instances of a model Triton starts (each a stub process with its own engine), from its model
    configuration as `initialize()` gets it (`instance_group`; none given: one)."""
    groups = model_config.get("instance_group") or [{"count": 1}]
    return sum(max(int(group.get("count", 1)), 1) for group in groups)

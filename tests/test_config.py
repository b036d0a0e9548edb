import pytest

from inflight_backend.config import EngineConfig


def test_parameters_are_typed_and_paths_resolved(tmp_path):
    cfg = EngineConfig.from_parameters({"checkpoint": "../m", "block_size": "32", "enable_chunked_prefill": "true",
                                        "max_chunk_tokens": "256"}, base_dir=str(tmp_path / "repo" / "llm"))
    assert cfg.block_size == 32 and cfg.enable_chunked_prefill is True and cfg.max_chunk_tokens == 256
    assert cfg.checkpoint == str(tmp_path / "repo" / "m")


@pytest.mark.parametrize("params, message", [
    ({}, "checkpoint"),
    ({"checkpoint": "m", "blok_size": "4"}, "unknown parameters"),
    ({"checkpoint": "m", "block_size": "x"}, "expected int"),
    ({"checkpoint": "m", "device": "tpu"}, "device"),
    ({"checkpoint": "m", "linear_backend": "mkl"}, "linear_backend must be one of"),
    ({"checkpoint": "m", "attention_backend": "flash"}, "attention_backend must be one of"),
    ({"checkpoint": "m", "max_batch_size": "8", "max_num_tokens": "4"}, "max_num_tokens"),
    ({"checkpoint": "m", "max_chunk_tokens": "-1"}, "max_chunk_tokens must be >= 0"),
    ({"checkpoint": "m", "batching_policy": "orca"}, "batching_policy must be one of"),
    ({"checkpoint": "m", "capacity_policy": "evict"}, "capacity_policy must be one of"),
    ({"checkpoint": "m", "step_time_target_ms": "-5"}, "step_time_target_ms must be >= 0"),
    ({"checkpoint": "m", "step_time_target_ms": "150"}, "step_time_target_ms applies to .* enable_chunked_prefill"),
    ({"checkpoint": "m", "step_time_target_ms": "150", "enable_chunked_prefill": "true",
      "batching_policy": "prefill_first"}, "step_time_target_ms applies to batching_policy fused"),
])
def test_invalid_parameters_are_rejected_with_the_reason(params, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_parameters(params)


@pytest.mark.parametrize("fields, message", [({"policy": "orca"}, "batching_policy must be one of"),
                                             ({"capacity_policy": "evict"}, "capacity_policy must be one of")])
def test_the_schedulers_own_config_rejects_unknown_policies(fields, message):
    from inflight_backend.scheduler import SchedulerConfig

    with pytest.raises(ValueError, match=message):
        SchedulerConfig(4, 64, **fields)
    assert SchedulerConfig(4, 64).policy == "fused"


def test_serve_preflight_names_a_missing_checkpoint(tmp_path, tiny_model):
    from inflight_backend.repository import check_repository, model_config, write_repository

    write_repository(tmp_path, {"good": model_config(tiny_model, "good"),
                                "bad": model_config(str(tmp_path / "nowhere"), "bad"),
                                "typo": model_config(tiny_model, "typo", blok_size=4)})
    problems = check_repository(tmp_path)
    assert len(problems) == 2
    assert any("model bad: checkpoint" in p and "no config.json" in p for p in problems)
    assert any("model typo: unknown parameters" in p for p in problems)
    assert check_repository(tmp_path / "missing") == [f"model repository {tmp_path / 'missing'} does not exist"]


def test_cuda_graphs_are_refused_where_they_cannot_run(tiny_model):
    """cuda_graphs: true on the CPU or with another engine is an error naming it, not a setting ignored."""
    from inflight_backend.engine import InflightEngine

    with pytest.raises(RuntimeError, match="cuda_graphs: true applies to CUDA devices"):
        InflightEngine(EngineConfig(checkpoint=tiny_model, device="cpu", cuda_graphs=True))
    with pytest.raises(ValueError, match="cuda_graphs: true applies to engine: pytorch"):
        EngineConfig(checkpoint=tiny_model, engine="null", cuda_graphs=True)


def test_cuda_graph_buckets_cover_every_batch_and_context():
    """Each decode step is padded to the smallest captured batch holding it, and its longest context to a
    power-of-two number of the attention kernel's 512-key partitions, capped by what the graphs cover."""
    from inflight_backend.runners.cuda_graphs import PARTITION, batch_buckets, context_bucket

    assert batch_buckets(1) == [1] and batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert PARTITION == 512
    assert [context_bucket(n, 8192) for n in (1, 512, 513, 1024, 1025, 2048, 2049, 8192)] == \
        [512, 512, 1024, 1024, 2048, 2048, 4096, 8192]
    assert context_bucket(2500, 3000) == 3000 and context_bucket(100, 300) == 300

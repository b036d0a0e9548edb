"""Model families beyond Llama, each a tiny random checkpoint written through transformers' own config and model
classes: greedy tokens equal transformers' generate, requests arriving at different steps, chunked and not."""
import pytest
import torch

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.make_model import byte_level_tokenizer
from inflight_backend.request import SamplingParams

FAMILIES = {  # name: (model_type, config values)
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=2)),  # q/k/v biases, tied, GQA
    # q/k norms, head_dim != hidden / heads
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, num_key_value_heads=4, head_dim=48)),
    # a sliding window shorter than most prompts, not a multiple of the KV block (16)
    "mistral": ("mistral", dict(tie_word_embeddings=False, num_key_value_heads=2, sliding_window=12)),
    # Qwen's per-layer windows: layer 0 full, layer 1 windowed (from max_window_layers)
    "qwen2_window": ("qwen2", dict(tie_word_embeddings=False, num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=6, max_window_layers=1)),
}


def make_family_checkpoint(path, family, seed=0):
    import transformers

    model_type, values = FAMILIES[family]
    config_class = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                    "mistral": transformers.MistralConfig}[model_type]
    model_class = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                   "mistral": transformers.MistralForCausalLM}[model_type]
    config = config_class(vocab_size=258, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
                          bos_token_id=256, eos_token_id=257, **values)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # biases and norms away from their init, so a missing one shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.5)
    model.save_pretrained(path, safe_serialization=True)
    byte_level_tokenizer().save(f"{path}/tokenizer.json")
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("attention", ["native", "torch"])
def test_greedy_tokens_equal_transformers(tmp_path, oracle_cases, family, chunked, attention):
    if attention == "torch" and not FAMILIES[family][1].get("sliding_window"):
        pytest.skip("the torch reference attention is checked on the sliding-window families only")
    model = make_family_checkpoint(str(tmp_path / family), family)
    engine = InflightEngine(EngineConfig(checkpoint=str(tmp_path / family), num_kv_blocks=256, max_batch_size=8,
                                         enable_chunked_prefill=chunked, max_chunk_tokens=32 if chunked else 0,
                                         dtype="float32", attention_backend=attention))
    cases = [(ids, min(n, 16)) for ids, n in oracle_cases[:8] if len(ids) < 900]
    got = {str(i): [] for i in range(len(cases))}
    step = 0
    while step < 2 * len(cases) or engine.has_unfinished():
        if step % 2 == 0 and step // 2 < len(cases):
            i = step // 2
            engine.add_request(str(i), cases[i][0], SamplingParams(max_tokens=cases[i][1]))
        for out in engine.step():
            got[out.req_id] += out.token_ids
        step += 1
    for i, (ids, n) in enumerate(cases):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        want = out[:out.index(257) + 1] if 257 in out else out
        assert got[str(i)] == want, f"{family} request {i}"


@pytest.mark.parametrize("family", [name for name, (_, values) in FAMILIES.items() if values.get("sliding_window")])
@pytest.mark.parametrize("chunk", [0, 16])
def test_sliding_window_logits_equal_transformers_over_long_prompts(tmp_path, oracle_cases, family, chunk):
    """Every prompt position's logits (return_context_logits) equal transformers' within 1e-4 for prompts up
    to 25x the window, whole or in chunks longer than the window: each layer keeps its own window."""
    model = make_family_checkpoint(str(tmp_path / family), family, seed=1)
    engine = InflightEngine(EngineConfig(checkpoint=str(tmp_path / family), num_kv_blocks=256, max_batch_size=8,
                                         enable_chunked_prefill=bool(chunk), max_chunk_tokens=chunk,
                                         dtype="float32"))
    prompts = [ids for ids, _ in oracle_cases if 40 <= len(ids) <= 150]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=1, return_context_logits=True))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.context_logits is not None:
                got[int(out.req_id)] = torch.from_numpy(out.context_logits)
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            want = model(torch.tensor([ids])).logits[0]
        assert torch.allclose(got[i], want, atol=1e-4), (family, len(ids), (got[i] - want).abs().max())


def test_the_tensorrt_export_refuses_families_it_does_not_cover(tmp_path):
    pytest.importorskip("onnx")
    from inflight_backend.tensorrt.onnx_export import export

    make_family_checkpoint(str(tmp_path / "q3"), "qwen3")
    with pytest.raises(ValueError, match="qk_norm"):
        export(str(tmp_path / "q3"), 16)


@pytest.mark.server
def test_families_through_the_server_one_at_a_time_and_16_concurrent(tmp_path_factory, oracle_cases, tiny_model,
                                                                      tied_model):
    """Six configurations (Llama; Llama with tied embeddings; Qwen2, tied and GQA; Qwen3; Mistral, GQA, with a
    sliding window shorter than most prompts; Qwen2 with a window on one layer) served at once, chunked prefill
    on for half of them: each request's ids equal transformers', sent alone and with 16 concurrent."""
    import threading

    from transformers import AutoModelForCausalLM

    from tests.conftest import free_port, model_config, write_repository
    from tests.triton_helpers import grpc_generate
    from inflight_backend.server import TritonServer

    root = tmp_path_factory.mktemp("families")
    paths = {"llama": tiny_model, "llama_tied": tied_model}
    for family in FAMILIES:
        paths[family] = str(root / family)
        make_family_checkpoint(paths[family], family, seed=3)
    chunked = {"llama": "true", "qwen2": "true", "mistral": "true", "qwen3": "false", "llama_tied": "true",
               "qwen2_window": "false"}
    repo = write_repository(root / "repo", {name: model_config(path, name, enable_chunked_prefill=chunked[name],
                                                                 max_chunk_tokens=32)
                                            for name, path in paths.items()})
    cases = [(ids, min(n, 12)) for ids, n in oracle_cases[:16]]
    server = TritonServer(repo, free_port(), free_port(), free_port(), log_file=root / "tritonserver.log").start()
    try:
        url = f"127.0.0.1:{server.grpc_port}"
        for name, path in paths.items():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            wants = []
            for ids, n in cases:
                with torch.inference_mode():
                    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
                wants.append(out[:out.index(257) + 1] if 257 in out else out)
            alone = grpc_generate(url, name, {"input_ids": cases[0][0], "max_tokens": cases[0][1], "stream": True})
            assert alone.error is None and alone.ids == wants[0], name
            results = [None] * len(cases)

            def send(i):
                ids, n = cases[i]
                results[i] = grpc_generate(url, name, {"input_ids": ids, "max_tokens": n, "stream": True})

            threads = [threading.Thread(target=send, args=(i,)) for i in range(len(cases))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert [r.ids for r in results] == wants, name
    finally:
        code = server.stop()
        assert code == 0, f"tritonserver exited with {code}{server.log_excerpt()}"

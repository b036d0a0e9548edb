"""Model families beyond Llama, each a tiny random checkpoint written through transformers' own config and model
classes: greedy tokens equal transformers' generate, requests arriving at different steps, chunked and not."""
import pytest
import torch

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.make_model import byte_level_tokenizer
from inflight_backend.request import SamplingParams

FAMILIES = {
    "qwen2": dict(tie_word_embeddings=True, num_key_value_heads=2),  # q/k/v biases, tied, GQA
    "qwen3": dict(tie_word_embeddings=False, num_key_value_heads=4, head_dim=48),  # q/k norms, head_dim != h/heads
    "mistral": dict(tie_word_embeddings=False, num_key_value_heads=2, sliding_window=None),
}


def make_family_checkpoint(path, family, seed=0):
    import transformers

    config_class = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                    "mistral": transformers.MistralConfig}[family]
    model_class = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                   "mistral": transformers.MistralForCausalLM}[family]
    config = config_class(vocab_size=258, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
                          bos_token_id=256, eos_token_id=257, **FAMILIES[family])
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
def test_greedy_tokens_equal_transformers(tmp_path, oracle_cases, family, chunked):
    model = make_family_checkpoint(str(tmp_path / family), family)
    engine = InflightEngine(EngineConfig(checkpoint=str(tmp_path / family), num_kv_blocks=256, max_batch_size=8,
                                         enable_chunked_prefill=chunked, max_chunk_tokens=32 if chunked else 0,
                                         dtype="float32"))
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


def test_the_tensorrt_export_refuses_families_it_does_not_cover(tmp_path):
    pytest.importorskip("onnx")
    from inflight_backend.tensorrt.onnx_export import export

    make_family_checkpoint(str(tmp_path / "q3"), "qwen3")
    with pytest.raises(ValueError, match="qk_norm"):
        export(str(tmp_path / "q3"), 16)

"""Shared fixtures: tiny checkpoints, the Hugging Face oracle, and a real tritonserver on free loopback ports."""
from __future__ import annotations

import os
import random
import warnings

import pytest
import torch
from hypothesis import settings

from inflight_backend.make_model import TinySpec, make_model
from inflight_backend.repository import model_config as _model_config
from inflight_backend.repository import write_repository  # noqa: F401 (re-exported for the tests)
from inflight_backend.server import TritonServer, free_port  # noqa: F401 (free_port re-exported)

# `make test` must pass on every fresh clone, so the property tests draw the same examples on every run (seeded
# from each test's source, no example database). HYPOTHESIS_PROFILE=explore draws new ones each run, to look for
# counterexamples; one found becomes a test of its own (test_detokenizer.py has one).
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# The second checkpoint differs in every size, uses grouped-query attention and is sharded.
GQA_SPEC = TinySpec(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=6,
                    num_key_value_heads=2, rope_theta=500000.0, seed=7, num_shards=2)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("tiny-llama")), TinySpec())


LONG_CONTEXT = 1 << 16
LONG_STREAM = 8000  # llm_long's streams: thousands of steps, each longer than the last, that a test cancels


@pytest.fixture(scope="session")
def long_model(tmp_path_factory) -> str:
    """The default tiny model (the same weights: transformers' tokens are tiny_model's) with a 65,536-token
    context, for requests that hold a slot while a test looks at them, cancels them or kills the server: held
    for tens of thousands of steps, each longer than the last (the attention grows), rather than the 2,000 that
    take a fraction of a second on a fast machine, they are still running when the test acts."""
    return make_model(str(tmp_path_factory.mktemp("long-llama")), TinySpec(max_position_embeddings=LONG_CONTEXT))


@pytest.fixture(scope="session")
def gqa_model(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("gqa-llama")), GQA_SPEC)


@pytest.fixture(scope="session")
def tied_model(tmp_path_factory) -> str:
    return make_model(str(tmp_path_factory.mktemp("tied-llama")), TinySpec(tie_word_embeddings=True, seed=3))


class Oracle:
    """Greedy continuations from transformers' LlamaForCausalLM.generate on the same checkpoint."""

    def __init__(self, path: str) -> None:
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, min_new_tokens: int = 0,
                 repetition_penalty: float = 1.0, bad_words_ids: list[list[int]] | None = None, **more) -> list[int]:
        """`more`: further arguments of generate (sequence_bias, logits_processor)."""
        ids = torch.tensor([prompt_ids])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  min_new_tokens=min_new_tokens, repetition_penalty=repetition_penalty,
                                  bad_words_ids=bad_words_ids, do_sample=False, pad_token_id=0, **more)
        generated = out[0, len(prompt_ids):].tolist()
        eos = self.model.config.eos_token_id
        return generated[: generated.index(eos) + 1] if eos in generated else generated


    @torch.inference_mode()
    def logprobs(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """log_softmax of the raw logits that chose each of `output_ids` after `prompt_ids`: [len(output), vocab]."""
        logits = self.model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
        return torch.log_softmax(logits[len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1], dim=-1)

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """The raw logits at every position of `ids`: [len(ids), vocab]."""
        return self.model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="session")
def oracle_cases():
    """16+ (prompt_ids, max_new_tokens): prompt lengths 1..300 tokens, 1..64 new tokens, multi-byte text."""
    rng = random.Random(1234)
    words = ["hello", "wörld", "naïve", "日本語", "καλημέρα", "🙂", "data", "über", "straße", "x"]
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 150, 200, 233, 270, 300]
    new_tokens = [1, 64, 7, 33, 2, 64, 16, 5, 48, 64, 3, 24, 9, 40, 64, 12]
    cases = []
    for n, m in zip(lengths, new_tokens):
        text = " ".join(rng.choice(words) for _ in range(n)).encode()[: max(n - 1, 0)]
        ids = [256] + list(text)  # BOS + bytes: the byte-level tokenizer's encoding, cut at any byte
        cases.append((ids, m))
    return cases


def model_config(checkpoint: str, name: str, **params) -> str:
    """Test models run in float32, so they match transformers' fp32 reference."""
    return _model_config(checkpoint, name, **{"dtype": "float32", **params})


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_model, gqa_model, long_model):
    """One tritonserver for the end-to-end tests, serving:
    llm (default tiny model, native attention kernels), llm_gqa (second checkpoint, torch reference attention),
    llm_long (long_model, with room for 8 streams of LONG_STREAM tokens),
    llm_small_pool (8 KV blocks of 16 tokens), llm_two (the default model in two instances), ensemble and
    tensorrt_llm (the default model in TensorRT-LLM's batched layout, decoupled and not, with Triton's dynamic
    batcher as shipped), llm_dynamic (the same layout, decoupled, its dynamic batcher holding requests up to 0.5 s
    until 4 are queued)."""
    root = tmp_path_factory.mktemp("repo")
    write_repository(root, {
        "llm": model_config(tiny_model, "llm"),
        "llm_gqa": model_config(gqa_model, "llm_gqa", block_size=8, max_num_tokens=512, attention_backend="torch"),
        "llm_long": model_config(long_model, "llm_long", num_kv_blocks=8 * (LONG_STREAM // 16 + 2)),
        "llm_small_pool": model_config(tiny_model, "llm_small_pool", num_kv_blocks=8, max_batch_size=4),
        "llm_two": model_config(tiny_model, "llm_two", instances=2),
        "ensemble": model_config(tiny_model, "ensemble", triton_max_batch_size=64, dynamic_batching=""),
        "tensorrt_llm": model_config(tiny_model, "tensorrt_llm", triton_max_batch_size=64, decoupled=False,
                                     dynamic_batching=""),
        "llm_dynamic": model_config(tiny_model, "llm_dynamic", triton_max_batch_size=8, dynamic_batching=(
            "preferred_batch_size: [4] max_queue_delay_microseconds: 500000")),
    })
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    srv = TritonServer(root, free_port(), free_port(), free_port(), log_file=log)
    srv.start()
    yield srv
    assert_stopped_cleanly(srv, srv.stop(), ["llm", "llm_gqa", "llm_long", "llm_small_pool", "llm_two", "ensemble",
                                            "tensorrt_llm", "llm_dynamic"])


def assert_stopped_cleanly(srv: TritonServer, code: int | None, models: list[str]) -> None:
    """tritonserver exited 0, or every model of ours did its part: each ended every stream, and each that Triton
    finalized finished finalizing. Then a model Triton never finalized before its exit timeout was held by Triton
    itself (an idle client stream does that; seen once in CI with no client left, on the session server's `llm`):
    a warning with the log, not a failure, as `inflight serve` kills such a server once every stream ended."""
    if code == 0:
        return
    log = srv.log_file.read_text(errors="replace")
    ours = [m for m in models if f"inflight: {m}: every stream ended" not in log or
            f"inflight: {m}: finalizing" in log and f"inflight: {m}: finalized" not in log]
    assert not ours and "Exit timeout expired" in log, (
        f"tritonserver exited with {code}; models that did not end their streams or finish finalizing: {ours}; "
        f"log: {srv.log_file}{srv.log_excerpt()}")
    warnings.warn(f"tritonserver exited with {code}: Triton held a model past its exit timeout after every stream "
                  f"had ended{srv.log_excerpt()}")

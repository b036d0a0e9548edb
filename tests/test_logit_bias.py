"""Logit bias, allowed tokens and min_p: read from TensorRT-LLM's and vLLM's inputs, checked against transformers
(sequence_bias, a logits processor) on the same weights in a batch of requests arriving at different steps, and
min_p's draws against its definition."""
import json

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.protocol import parse_request
from inflight_backend.request import PromptLimits, Request, RequestError, SamplingParams
from inflight_backend.sampler import Sampler
from inflight_backend.vllm_protocol import sampling_parameters
from tests.conftest import Oracle
from tests.test_engine_request_features import long_cases, run_batch, tokens  # noqa: F401 (a fixture)
from tests.test_server_trtllm import TOKENIZER, ensemble_inputs, stream, tensor, url
from tests.triton_helpers import http_post

LIMITS = PromptLimits(max_bytes=1 << 20, max_tokens=4096)


def parse(sampling=None, encode=lambda text: [ord(c) for c in text], **inputs):
    return parse_request(lambda name: inputs.get(name), encode, 16, LIMITS, sampling, encode_word=encode)


@pytest.fixture(scope="module")
def oracle(tiny_model):
    return Oracle(tiny_model)


def test_every_clients_bias_is_read_and_biases_given_several_ways_add_up():
    """TensorRT-LLM's dense embedding_bias (its zeros are no bias), its ensemble's words and weights (each word
    tokenized as a prompt, every token of it weighted), vLLM's logit_bias (ids as strings or numbers)."""
    dense = np.zeros(300, np.float32)
    dense[[7, 104]] = [1.5, -2.0]
    sampling = sampling_parameters('{"logit_bias": {"7": 0.5, "9": -100}, "allowed_token_ids": [9, 3, 9]}', "{}")
    p = parse(text_input=np.array([b"hi"], dtype=object), embedding_bias=dense,
              embedding_bias_words=np.array([b"hh", b"i"], dtype=object),
              embedding_bias_weights=np.array([0.25, 3.0], np.float32), sampling=sampling).params
    assert p.logit_bias == ((7, 2.0), (9, -100.0), (104, -1.5), (105, 3.0))  # "hh": 104 twice, 0.25 each
    assert p.allowed_token_ids == (3, 9) and p.biased and p.needs_all_logits and p.greedy
    plain = parse(text_input=np.array([b"hi"], dtype=object), embedding_bias=np.zeros(300, np.float32),
                  embedding_bias_words=np.array([], dtype=object), embedding_bias_weights=np.array([], np.float32))
    assert plain.params.logit_bias == () and not plain.params.biased
    assert parse(text_input=np.array([b"hi"], dtype=object),
                 sampling=sampling_parameters('{"min_p": "0.05", "temperature": 1}', "{}")).params.min_p == 0.05


@pytest.mark.parametrize("inputs, message", [
    ({"embedding_bias_words": np.array([b"a", b"b"], dtype=object),
      "embedding_bias_weights": np.array([1.0], np.float32)}, r"embedding_bias_words \(2\) and embedding_bias_weights"),
    ({"embedding_bias": np.array([0.0, np.nan], np.float32)}, "'embedding_bias' must hold finite numbers"),
    ({"embedding_bias": np.array([1, 2], np.int32)}, "'embedding_bias' must be FP32"),
    ({"embedding_bias_words": np.array([b"a"], dtype=object),
      "embedding_bias_weights": np.array([np.inf], np.float32)}, "'embedding_bias_weights' must hold finite"),
    ({"sampling": {"min_p": 1.5}}, r"min_p must be in \[0, 1\], got 1.5"),
    ({"embedding_bias_words": np.array([b"\xff"], dtype=object),
      "embedding_bias_weights": np.array([1.0], np.float32)}, "'embedding_bias_words' is not valid UTF-8"),
])
def test_bad_biases_are_errors_naming_the_input(inputs, message):
    with pytest.raises(RequestError, match=message):
        parse(text_input=np.array([b"hi"], dtype=object), **inputs)


def test_token_ids_outside_the_vocabulary_are_refused(tiny_model):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=64))
    vocab = engine.runner.vocab_size
    with pytest.raises(RequestError, match=f"logit bias .*token id {vocab} is outside the vocabulary"):
        engine.validate([5, 6], SamplingParams(max_tokens=2, logit_bias=((3, 1.0), (vocab, 1.0))))
    with pytest.raises(RequestError, match="allowed_token_ids: a token id is outside the vocabulary"):
        engine.validate([5, 6], SamplingParams(max_tokens=2, allowed_token_ids=(-1, 4)))


class Allowed:
    """A transformers logits processor keeping only `ids` (vLLM's allowed_token_ids)."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, input_ids, scores):
        kept = torch.full_like(scores, float("-inf"))
        kept[:, self.ids] = scores[:, self.ids]
        return kept


def test_bias_and_allowed_tokens_match_transformers_in_a_batch(tiny_model, oracle, long_cases):  # noqa: F811
    """Each request's own rule, others in the same steps unbiased: a bias that removes the greedy choice at
    step 2 and one that promotes another token (transformers' sequence_bias), allowed tokens (a logits
    processor), and a plain request, all equal to transformers' greedy tokens."""
    from transformers import LogitsProcessorList

    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    requests, wants = [], []
    for k, (ids, out) in enumerate(long_cases):
        if k % 4 == 0:
            bias = {out[2]: -50.0, 70: 4.0}
            requests.append((ids, SamplingParams(max_tokens=16, logit_bias=tuple(sorted(bias.items())))))
            wants.append(oracle.generate(ids, 16, sequence_bias={(t,): b for t, b in bias.items()}))
        elif k % 4 == 1:
            allowed = sorted({out[0], out[4], 65, 101, 257})
            requests.append((ids, SamplingParams(max_tokens=16, allowed_token_ids=tuple(allowed))))
            wants.append(oracle.generate(ids, 16, logits_processor=LogitsProcessorList([Allowed(allowed)])))
            assert set(wants[-1]) <= set(allowed)
        else:
            requests.append((ids, SamplingParams(max_tokens=16)))
            wants.append(out)
    got = run_batch(engine, requests)
    for i, want in enumerate(wants):
        assert tokens(got[i]) == want
    assert any(want != out for want, (_, out) in zip(wants, long_cases))
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    """After the temperature, as vLLM: e^(logit - best) >= min_p stays. Rows with min_p and rows without share a
    step; each draws what it draws alone (its own seeded stream)."""
    row = torch.tensor([0.0, -1.0, -1.5, -3.0, -3.5])  # e^-1.5 = 0.22, e^-3 = 0.050, e^-3.5 = 0.030
    logits = torch.full((1, 64), -30.0)
    logits[0, :5] = row
    sampler = Sampler()
    # (min_p, temperature): the tokens 400 seeds draw; at T = 2, e^(-3/2) = 0.22 stays above 0.2
    for (min_p, temperature), want in {(0.2, 1.0): {0, 1, 2}, (0.04, 1.0): {0, 1, 2, 3},
                                       (0.0, 1.0): {0, 1, 2, 3, 4}, (0.2, 2.0): {0, 1, 2, 3}}.items():
        p = [SamplingParams(max_tokens=1, temperature=temperature, seed=seed, min_p=min_p) for seed in range(400)]
        seen = {sampler.sample(logits.clone(), [f"{min_p}-{temperature}-{seed}"], [p[seed]])[0][0]
                for seed in range(400)}
        assert seen == want, (min_p, temperature, seen)
    hot = SamplingParams(max_tokens=1, temperature=2.0, seed=5, min_p=0.2)
    batch = torch.cat([logits, logits, logits])
    params = [SamplingParams(max_tokens=1, temperature=1.0, seed=11), hot,
              SamplingParams(max_tokens=1, temperature=1.0, seed=12, min_p=0.9)]
    together, _ = Sampler().sample(batch.clone(), ["a", "b", "c"], params)
    alone = [Sampler().sample(logits.clone(), [name], [p])[0][0] for name, p in zip("abc", params)]
    assert together == alone and together[2] == 0


@pytest.mark.server
def test_each_clients_bias_acts_through_the_server(server, tiny_model):
    """TensorRT-LLM's batched layout: two rows, each with its own embedding_bias [vocab] (streamed, greedy), and
    its ensemble's words and weights; vLLM's logit_bias, allowed_token_ids and min_p in sampling_parameters
    over HTTP /generate. A bias of 100 decides every token. vLLM's bad_words too."""

    ids = TOKENIZER.encode("Logit bias: a row each").ids
    vocab = 258
    bias = np.zeros((2, vocab), np.float32)
    bias[0, 66], bias[1, 67] = 100.0, 100.0
    two = {"input_ids": np.array([ids, ids], np.int32), "input_lengths": np.array([[len(ids)]] * 2, np.int32),
           "request_output_len": np.array([[6]] * 2, np.int32)}
    rows = [tensor(grpcclient, name, value, "INT32") for name, value in two.items()]
    rows.append(tensor(grpcclient, "streaming", np.array([[True]] * 2), "BOOL"))
    got, error = stream(url(server), "ensemble", rows + [tensor(grpcclient, "embedding_bias", bias, "FP32")])
    assert error is None
    out = {0: [], 1: []}
    for r in got:
        out[int(r.as_numpy("batch_index")[0][0])] += list(r.as_numpy("output_ids")[0][0])
    assert out == {0: [66] * 6, 1: [67] * 6}
    words = {"embedding_bias_words": ([[b"Z"]], "BYTES"), "embedding_bias_weights": ([[100.0]], "FP32")}
    got, error = stream(url(server), "ensemble", ensemble_inputs("Words: ", 5, True, temperature=0.0, **words))
    assert error is None
    assert {t for r in got for t in r.as_numpy("output_ids")[0][0]} <= set(TOKENIZER.encode("Z").ids)
    body = {"text_input": "vLLM's bias", "max_tokens": 5, "exclude_input_in_output": True}
    for params, check in [({"logit_bias": {"70": 100}}, lambda t: t == [70] * 5),
                          ({"allowed_token_ids": [71, 72]}, lambda t: set(t) <= {71, 72}),
                          ({"min_p": 1.0, "temperature": 5, "seed": 3, "logit_bias": {"73": 100}},
                           lambda t: t == [73] * 5)]:
        status, text = http_post(server.http_port, "/v2/models/llm/generate",
                                 {**body, "sampling_parameters": json.dumps(params)})
        assert status == 200 and check(json.loads(text)["output_ids"]), (params, text)
    status, text = http_post(server.http_port, "/v2/models/llm/generate", {**body, "max_tokens": 12})
    free = json.loads(text)["output_ids"]
    word = next(chr(t) for t in free if 32 < t < 127)  # a one-byte token of the free run, as a bad word
    status, text = http_post(server.http_port, "/v2/models/llm/generate", {
        **body, "max_tokens": 12, "sampling_parameters": json.dumps({"bad_words": [word]})})
    assert status == 200 and ord(word) not in json.loads(text)["output_ids"], text
    status, text = http_post(server.http_port, "/v2/models/llm/generate",
                             {**body, "sampling_parameters": json.dumps({"logit_bias": {str(vocab): 1}})})
    assert "error" in text and f"token id {vocab} is outside the vocabulary" in text



def test_the_torch_path_biases_as_the_numpy_one():
    """CPU fp32 logits are changed through numpy's view, others (a GPU's) through torch: the same rows result."""
    from inflight_backend.token_rules import apply_bias

    params = [SamplingParams(max_tokens=1, logit_bias=((1, 2.5), (6, -1.0))),
              SamplingParams(max_tokens=1, allowed_token_ids=(0, 3), logit_bias=((3, 0.5), (4, 9.0)))]
    base = torch.randn(3, 8)
    fast, other = base.clone(), base.clone().double()
    requests = [Request(str(i), [1, 2], p) for i, p in enumerate(params)]
    apply_bias(fast, [0, 2], requests)
    apply_bias(other, [0, 2], requests)  # (the arrays made by the first call, kept on the requests)
    assert all(r.bias is not None for r in requests)
    want = base.clone()
    want[0, 1] += 2.5
    want[0, 6] -= 1.0
    want[2] = torch.tensor([base[2, 0], *[float("-inf")] * 2, base[2, 3] + 0.5, *[float("-inf")] * 4])
    assert torch.equal(fast, want) and torch.allclose(other.float(), want)


def test_vllm_bad_words_are_tokenized_with_and_without_a_leading_space():
    """vLLM's rule: the word (leading spaces stripped) and, where it is another first token in as many tokens,
    the word after a space; a word of no tokens bans nothing."""
    from tests.tokenizer_fixtures import byte_level_bpe_tokenizer
    from inflight_backend.vllm_protocol import bad_word_sequences

    tok = byte_level_bpe_tokenizer("llama3")

    def encode(word):
        return tok.encode(word, add_special_tokens=False).ids

    seqs = bad_word_sequences(("hello", "  fox", "xyzzy", " "), encode)
    assert seqs == (tuple(encode("hello")), tuple(encode(" hello")), tuple(encode("fox")), tuple(encode(" fox")),
                    tuple(encode("xyzzy")), tuple(encode(" xyzzy")))
    assert len(encode("hello")) == 1 and encode("hello") != encode(" hello")
    p = parse(text_input=np.array([b"hi"], dtype=object), sampling=sampling_parameters('{"bad_words": ["ab"]}', "{}"))
    assert p.params.bad_output_seqs == ((97, 98),) and p.params.bad_token_seqs == ()  # " ab": 3 tokens here
    with pytest.raises(RequestError, match="'bad_words' must be a list of strings"):
        sampling_parameters('{"bad_words": "ab"}', "{}")


class OutputBadWords:
    """A transformers logits processor with vLLM's bad-word rule: `word`'s last token is masked where its other
    tokens end the output (the tokens past the prompt's `prompt_len`)."""

    def __init__(self, prompt_len, word):
        self.prompt_len, self.word = prompt_len, list(word)

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_len:].tolist()
        head = self.word[:-1]
        if len(out) >= len(head) and out[len(out) - len(head):] == head:
            scores[:, self.word[-1]] = float("-inf")
        return scores


def test_vllm_bad_words_are_matched_within_the_output_alone(tiny_model, oracle, long_cases):  # noqa: F811
    """A one-token word is never generated (as transformers' bad_words_ids); a two-token word whose first token
    ends the prompt does not ban its second at the first step (vLLM matches the output only), where TensorRT-LLM's
    bad_words (over prompt and output, as transformers) does."""
    from transformers import LogitsProcessorList

    from inflight_backend.token_rules import banned_in_output

    assert banned_in_output([], ((5,), (6, 7))) == [5]
    assert banned_in_output([1, 6], ((5,), (6, 7), (1, 6, 8), (2, 6, 9))) == [5, 7, 8]
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    requests, wants = [], []
    for k, (ids, out) in enumerate(long_cases):
        if k % 2:
            requests.append((ids, SamplingParams(max_tokens=16, bad_output_seqs=((out[2],),))))
            wants.append(oracle.generate(ids, 16, bad_words_ids=[[out[2]]]))
        else:
            across = (ids[-1], out[0])  # the prompt's last token, then the first output token
            requests.append((ids, SamplingParams(max_tokens=16, bad_output_seqs=(across,))))
            rule = LogitsProcessorList([OutputBadWords(len(ids), across)])
            wants.append(oracle.generate(ids, 16, logits_processor=rule))
            assert wants[-1][0] == out[0]  # not banned at the first step
    got = run_batch(engine, requests)
    for i, want in enumerate(wants):
        assert tokens(got[i]) == want
    ids, out = long_cases[0]
    assert oracle.generate(ids, 16, bad_words_ids=[[ids[-1], out[0]]]) != out  # where the prompt counts

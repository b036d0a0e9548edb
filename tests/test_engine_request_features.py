"""Request features checked against transformers on the same weights: bad words, stop token sequences,
log-probabilities and raw logits, in a batch of requests that arrive at different steps."""
import pytest
import torch

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.request import SamplingParams
from tests.conftest import Oracle

EOS = 257


@pytest.fixture(scope="module")
def oracle(tiny_model):
    return Oracle(tiny_model)


@pytest.fixture(scope="module")
def long_cases(oracle, oracle_cases):
    """Cases whose greedy continuation runs at least 12 tokens without EOS, with that continuation."""
    cases = []
    for ids, _ in oracle_cases:
        out = oracle.generate(ids, 16)
        if len(out) >= 12 and EOS not in out:
            cases.append((ids, out))
    assert len(cases) >= 4, "too few oracle cases run 12 tokens"
    return cases


def run_batch(engine, requests, stagger=2):
    """requests: [(prompt_ids, SamplingParams)]; request i joins at step i * stagger. Returns {i: [outputs]}."""
    got = {i: [] for i in range(len(requests))}
    step = 0
    while step < len(requests) * stagger or engine.has_unfinished():
        if step % stagger == 0 and step // stagger < len(requests):
            i = step // stagger
            engine.add_request(str(i), *requests[i])
        for out in engine.step():
            got[int(out.req_id)].append(out)
        step += 1
    return got


def tokens(outputs):
    return [t for out in outputs for t in out.token_ids]


def test_bad_words_match_transformers_no_bad_words_processor(tiny_model, oracle, long_cases):
    """A single-token bad word is never generated; a two-token one never completes (its first token may be)."""
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    requests, bad = [], []
    for ids, out in long_cases:
        words = [[out[2]], [out[5], out[6]]]
        bad.append(words)
        requests.append((ids, SamplingParams(max_tokens=16, bad_token_seqs=tuple(map(tuple, words)))))
    got = run_batch(engine, requests)
    changed = 0
    for i, ((ids, out), words) in enumerate(zip(long_cases, bad)):
        want = oracle.generate(ids, 16, bad_words_ids=words)
        assert tokens(got[i]) == want
        assert out[2] not in want
        changed += want != out
    assert changed == len(long_cases)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_stop_token_sequences_end_the_request_after_the_sequence(tiny_model, long_cases):
    """A one-token and a multi-token stop sequence taken from the greedy continuation: the output is that
    continuation cut right after the sequence's first occurrence; finish reason stop."""
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    requests, wants = [], []
    for k, (ids, out) in enumerate(long_cases):
        seq = (out[7],) if k % 2 else (out[4], out[5], out[6])
        first = next(j for j in range(len(out)) if tuple(out[j:j + len(seq)]) == seq)
        wants.append(out[:first + len(seq)])
        requests.append((ids, SamplingParams(max_tokens=16, stop_token_seqs=(seq, (255, 255, 255, 255)))))
    got = run_batch(engine, requests)
    for i, want in enumerate(wants):
        assert tokens(got[i]) == want
        assert got[i][-1].finish_reason == "stop"


def test_stop_sequences_wait_for_min_tokens(tiny_model, long_cases):
    ids, out = long_cases[0]
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    got = run_batch(engine, [(ids, SamplingParams(max_tokens=16, stop_token_seqs=((out[1],),), min_tokens=10))])
    assert tokens(got[0]) == out[:10 + out[10:].index(out[1]) + 1] if out[1] in out[10:] else out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_log_softmax_of_transformers_logits(tiny_model, oracle, oracle_cases, temperature):
    """Every generated token's log-probability, its top-5 and its raw logits equal transformers' on the same
    prompt + output, within 1e-4, greedy and sampled (log-probabilities of the raw logits, before the temperature);
    penalties do not change them."""
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256, max_batch_size=8))
    requests = [(ids, SamplingParams(max_tokens=min(n, 20), temperature=temperature, seed=i, logprobs=5,
                                     return_generation_logits=True, repetition_penalty=1.2 if i % 2 else 1.0))
                for i, (ids, n) in enumerate(oracle_cases[:8])]
    got = run_batch(engine, requests)
    for i, (ids, _) in enumerate(requests):
        outs = got[i]
        generated = tokens(outs)
        want = oracle.logprobs(ids, generated)
        mine = torch.tensor([out.token_info.logprob for out in outs])
        chosen = want[torch.arange(len(generated)), torch.tensor(generated)]
        assert torch.allclose(mine, chosen, atol=1e-4)
        for row, out in enumerate(outs):
            top_ids = [t for t, _ in out.token_info.top]
            values, expected_ids = torch.topk(want[row], 5)
            assert torch.allclose(torch.tensor([v for _, v in out.token_info.top]), values, atol=1e-4)
            assert set(top_ids) == set(expected_ids.tolist()) or len(set(values.tolist())) < 5
            logits = oracle.logits(ids + generated)[len(ids) - 1 + row]
            assert torch.allclose(torch.from_numpy(out.token_info.logits), logits, atol=1e-4)


def test_no_logprobs_unless_asked(tiny_model, oracle_cases):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    ids, n = oracle_cases[0]
    got = run_batch(engine, [(ids, SamplingParams(max_tokens=4))])
    assert all(out.token_info is None for out in got[0])


@pytest.mark.parametrize("include", [True, False])
def test_stop_strings_are_cut_from_the_text_unless_included(tiny_model, oracle_cases, include):
    """vLLM's include_stop_str_in_output: False (its default) ends the text right before the stop string; the
    streamed deltas never carry any of it (text that could begin it is held back). True keeps it."""
    from inflight_backend.make_model import byte_level_tokenizer

    tok = byte_level_tokenizer()
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256))
    checked = 0
    for ids, _ in oracle_cases:
        free = tokens(run_batch(engine, [(ids, SamplingParams(max_tokens=24))])[0])
        text = tok.decode(free)
        word = text[6:9]
        if len(word) < 3 or "\ufffd" in word:
            continue
        outs = run_batch(engine, [(ids, SamplingParams(max_tokens=24, stop_words=(word,),
                                                       include_stop_str_in_output=include))])[0]
        streamed = "".join(out.text for out in outs)
        first = text.index(word)
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == word
        if include:
            assert streamed.startswith(text[:first + len(word)]) and text.startswith(streamed)
        else:
            assert streamed == text[:first]
        checked += 1
    assert checked >= 3
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("chunked", [False, True])
def test_sequences_of_one_prompt_share_its_blocks_and_each_equals_its_request_alone(tiny_model, oracle_cases,
                                                                                      chunked):
    """num_return_sequences: sequences 1..n-1 take the full prompt blocks of sequence 0 once it has computed them
    (reference counts, no copy; at least one prompt token each to compute) and each still equals the same
    request run alone with its seed; the pool holds fewer blocks than without sharing, and all come back."""
    config = EngineConfig(checkpoint=tiny_model, num_kv_blocks=256, block_size=8, enable_chunked_prefill=chunked,
                          max_chunk_tokens=48 if chunked else 0)
    ids = max((ids for ids, _ in oracle_cases), key=len)  # the longest prompt: many full blocks
    n = 4
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=40 + s) for s in range(n)]
    alone = []
    for p in params:
        engine = InflightEngine(config)
        alone.append(tokens(run_batch(engine, [(ids, p)])[0]))
    engine = InflightEngine(config)
    for s, p in enumerate(params):
        engine.add_request(str(s), ids, p, share_prompt_with="0" if s else None)
    got, peak, finals = {str(s): [] for s in range(n)}, 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.req_id] += out.token_ids
            if out.finished:
                finals[out.req_id] = out
        engine.blocks.check_integrity()
        peak = max(peak, engine.blocks.num_used_blocks)
    assert [got[str(s)] for s in range(n)] == alone
    shared = (len(ids) - 1) // 8
    assert all(finals[str(s)].num_shared_blocks == shared for s in range(1, n)) and shared >= 10
    assert peak <= n * -(-(len(ids) + 12) // 8) - (n - 1) * shared
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("chunk", [0, 40])
def test_context_logits_equal_transformers_logits_over_the_prompt(tiny_model, oracle, oracle_cases, chunk):
    """return_context_logits: the first output carries [prompt tokens, vocab] fp32 logits equal to transformers'
    within 1e-4, whole prompts or in chunks, beside requests that do not ask (their steps are unchanged)."""
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=256, max_batch_size=8,
                                         enable_chunked_prefill=bool(chunk), max_chunk_tokens=chunk))
    cases = oracle_cases[:6]
    requests = [(ids, SamplingParams(max_tokens=min(n, 8), return_context_logits=i % 2 == 0))
                for i, (ids, n) in enumerate(cases)]
    got = run_batch(engine, requests)
    for i, (ids, n) in enumerate(cases):
        outs = got[i]
        assert tokens(outs) == oracle.generate(ids, min(n, 8))
        if i % 2:
            assert all(out.context_logits is None for out in outs)
            continue
        first = next(out for out in outs if out.token_ids)
        assert first.context_logits is not None, (i, len(ids), [o.context_logits is None for o in outs])
        assert first.context_logits.shape == (len(ids), 258)
        assert torch.allclose(torch.from_numpy(first.context_logits), oracle.logits(ids), atol=1e-4)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks

"""The null engine (engine: null): a serving-path benchmark's runner, chosen only by name."""
import pytest

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.request import SamplingParams


def test_the_null_engine_runs_only_when_named(tiny_model):
    assert EngineConfig(checkpoint=tiny_model).engine == "pytorch"  # the default computes
    for name in ("Null", "none", "", "auto"):
        with pytest.raises(ValueError, match="engine must be one of"):
            EngineConfig(checkpoint=tiny_model, engine=name)
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, engine="null", num_kv_blocks=64))
    assert engine.runner.describe().startswith("null (computes nothing")
    assert not hasattr(engine.runner, "model")  # no weights loaded


def test_the_null_engine_streams_one_token_through_the_whole_serving_path(tiny_model):
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, engine="null", num_kv_blocks=64))
    token = engine.runner.token
    assert token not in engine.eos_ids
    for i in range(3):
        engine.add_request(str(i), [256, 104, 105], SamplingParams(max_tokens=5 + i, temperature=0.7, seed=i))
    got = {str(i): [] for i in range(3)}
    text = {str(i): "" for i in range(3)}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.req_id] += out.token_ids
            text[out.req_id] += out.text
    for i in range(3):
        assert got[str(i)] == [token] * (5 + i)  # sampled too: the fixed logits leave one likely token
        assert text[str(i)] == engine.tokenizer.decode([token] * (5 + i))
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_request_without_text_gets_the_same_ids_and_no_decoding(tiny_model):
    """detokenize=False (a client that asked for ids only): same ids, empty text; stop strings still need text,
    so a request with them is decoded anyway and stops where the decoded one does."""
    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=64))

    def run(**params):
        engine.add_request("r", [256] + list(b"the quick"), SamplingParams(max_tokens=24, **params))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs), outs[-1].finish_reason

    ids, text, _ = run()
    assert text and run(detokenize=False) == (ids, "", "length")
    word = text[3:5]
    assert run(stop_words=(word,), detokenize=False) == run(stop_words=(word,))
    assert run(stop_words=(word,))[2] == "stop"

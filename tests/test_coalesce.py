"""Coalescing: a stream that fell behind gets its waiting tokens in one response, with exactly the tokens and
text of one response per token; stream_interval holds a stream's tokens until it has that many."""
import random
import threading

from inflight_backend.batch_loop import BatchLoop
from inflight_backend.calls import Call, Sequence, held_back
from inflight_backend.coalesce import Coalescer, coalesce
from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.outputs import RequestOutput
from inflight_backend.outbox import Outbox
from inflight_backend.request import SamplingParams
from inflight_backend.token_rules import TokenInfo


def out(req, ids, text, finish=None, **kw):
    return RequestOutput(req, list(ids), text, finish, 3, 0, **kw)


def test_each_requests_run_merges_in_order_and_the_rest_stay_apart():
    info = TokenInfo(logprob=-0.5, top=(), logits=None)
    outputs = [out("a", [1], "x", token_time=1.0), out("b", [7], "p"), out("a", [2], "y", token_time=2.0),
               out("c", [9], "", token_info=info), out("c", [8], "", token_info=info), out("b", [6], "q", "length"),
               out("a", [3], "z"), out("b", [], "", error="late")]
    merged = coalesce(outputs)
    assert [(o.req_id, o.token_ids, o.text) for o in merged] == [
        ("a", [1, 2, 3], "xyz"), ("b", [7, 6], "pq"), ("c", [9], ""), ("c", [8], ""), ("b", [], "")]
    assert merged[0].token_time == 1.0  # the first token's time: what time to first token measures
    assert merged[1].finish_reason == "length" and merged[-1].error == "late"
    assert outputs[0].token_ids == [1]  # the engine's outputs are not changed


def test_a_slow_responder_gets_every_token_once_in_fewer_outputs(tiny_model):
    """The responder blocks on its first turn while the engine runs on: the waiting steps come merged, one output
    per stream per turn, and the tokens and text concatenate to what an engine-only run gives."""
    config = EngineConfig(checkpoint=tiny_model, num_kv_blocks=128)
    prompts = [[256] + list(b"coalesce %d" % i) for i in range(4)]
    params = [SamplingParams(max_tokens=20 + i) for i in range(4)]

    reference = InflightEngine(config)
    want = {str(i): ([], []) for i in range(4)}
    for i, ids in enumerate(prompts):
        reference.add_request(str(i), ids, params[i])
    while reference.has_unfinished():
        for o in reference.step():
            want[o.req_id][0].extend(o.token_ids)
            want[o.req_id][1].append(o.text)

    got = {str(i): ([], []) for i in range(4)}
    finals, counts, release, done = [], [], threading.Event(), threading.Event()

    def emit(outputs, stats):
        release.wait(60)  # the first turn holds the responder until every step has run
        counts.append(len(outputs))
        for o in outputs:
            got[o.req_id][0].extend(o.token_ids)
            got[o.req_id][1].append(o.text)
            if o.finished:
                finals.append(o.req_id)
        if len(finals) == 4:
            done.set()

    engine = InflightEngine(config)
    loop = BatchLoop(engine, emit)
    for i, ids in enumerate(prompts):
        loop.submit(str(i), ids, params[i])
    while engine.has_unfinished() or engine.stats.num_steps == 0:
        threading.Event().wait(0.01)
    release.set()
    assert done.wait(60)
    loop.stop()
    assert sorted(finals) == ["0", "1", "2", "3"]  # each request's final output once
    assert {k: (v[0], "".join(v[1])) for k, v in got.items()} == {k: (v[0], "".join(v[1])) for k, v in want.items()}
    assert sum(counts) < sum(len(v[0]) for v in want.values())  # merged: fewer outputs than tokens
    assert max(counts) <= 4  # the waiting steps' outputs: one per stream


def test_stream_interval_holds_a_stream_until_it_has_that_many_tokens():
    seq = Sequence(Call("1", None, True, False, False, None), 0, 0, "", [], 0.0, frozenset(), False, 3,
                   stream_interval=3)
    sent = [held_back(seq, out("r", [t], chr(96 + t))) for t in range(1, 8)]
    sent.append(held_back(seq, out("r", [8], "h", "length")))
    assert [(o.token_ids, o.text) for o in sent if o is not None] == [([1, 2, 3], "abc"), ([4, 5, 6], "def"),
                                                                      ([7, 8], "gh")]
    assert seq.pending is None


def _random_outputs(rng, n):
    """Outputs of 4 requests in a random order: tokens, some with per-token info, errors, finals."""
    info = TokenInfo(logprob=-0.5, top=(), logits=None)
    outs = []
    for i in range(n):
        req = rng.choice("abcd")
        kind = rng.random()
        outs.append(out(req, [i], f"<{i}>", "length" if kind < 0.1 else None, token_time=float(i),
                        token_info=info if 0.1 <= kind < 0.25 else None, error="x" if 0.25 <= kind < 0.3 else None))
    return outs


def test_outputs_merged_as_they_arrive_equal_the_whole_backlog_merged_at_once():
    rng = random.Random(5)
    for _ in range(200):
        outputs = _random_outputs(rng, rng.randint(0, 40))
        runs = Coalescer()
        at = 0
        while at < len(outputs):  # in steps of any size
            n = rng.randint(1, 6)
            runs.add(outputs[at:at + n])
            at += n
        got, want = runs.take(), coalesce(outputs)
        assert [(o.req_id, o.token_ids, o.text, o.token_time, o.finish_reason, o.error, o.token_info)
                for o in got] == [(o.req_id, o.token_ids, o.text, o.token_time, o.finish_reason, o.error,
                                   o.token_info) for o in want]
        assert not runs and runs.take() == []


def test_the_outbox_holds_one_output_per_stream_however_many_steps_wait():
    outbox = Outbox()
    assert outbox.take(0.01) is None  # nothing came
    stats = object()
    for step in range(100):
        outbox.put([out(r, [step], str(step)) for r in "abc"], stats)
    outputs, got_stats, closed = outbox.take(0.01)
    assert [(o.req_id, o.token_ids, o.text) for o in outputs] == [
        (r, list(range(100)), "".join(map(str, range(100)))) for r in "abc"]
    assert got_stats is stats and not closed
    outbox.put([out("a", [100], "!", "length")], stats)
    outbox.close()
    assert [(o.req_id, o.token_ids, o.finish_reason) for o in outbox.take(0.01)[0]] == [("a", [100], "length")]
    assert outbox.take(0.01) == ([], stats, True)  # closed: the responder stops at once

"""Text exactly as the tokenizer writes it, through the engine, with each family's tokenizer structure
(SentencePiece-style as Llama 2 and Mistral; byte-level BPE as Llama 3 and Qwen2): prompt ids are what
transformers' AutoTokenizer gives for the checkpoint, streamed deltas are decode(prompt + output) -
decode(prompt), the first generated word keeps its leading space, a stop word on that first word matches, and
chat messages are the ids of transformers' apply_chat_template."""
import pytest

from inflight_backend.config import EngineConfig
from inflight_backend.engine import InflightEngine
from inflight_backend.request import SamplingParams
from tests.tokenizer_fixtures import byte_level_checkpoint, sentencepiece_checkpoint

PROMPTS = ["hello world", "the quick brown fox", "naïve café", "日本語 Grüße", "emoji 🙂", "tab\there", "a\r\nb",
           "  indented", "hello world momentum", "I'm 12345 привет 👍🏽", "👨‍👩‍👧 x = f(y);\n\n    return"]


@pytest.fixture(scope="module", params=["sentencepiece", "llama3", "qwen2"])
def checkpoint(tmp_path_factory, request):
    out = str(tmp_path_factory.mktemp(request.param))
    if request.param == "sentencepiece":
        return sentencepiece_checkpoint(out)
    return byte_level_checkpoint(out, request.param)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return InflightEngine(EngineConfig(checkpoint=checkpoint, num_kv_blocks=128))


def test_prompt_ids_equal_transformers_autotokenizer(engine, checkpoint):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(checkpoint)
    assert [engine.encode(p) for p in PROMPTS + [" hello"]] == [hf(p)["input_ids"] for p in PROMPTS + [" hello"]]


def test_chat_messages_are_transformers_apply_chat_template(engine, checkpoint):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(checkpoint)
    if hf.chat_template is None:
        pytest.skip("this fixture ships no chat template")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve café 🙂?"},
                {"role": "assistant", "content": " 12345 "}, {"role": "user", "content": "again\n"}]
    text, ids = engine.encode_chat(messages)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)


def generate(engine, prompt_ids, **params):
    engine.add_request("x", prompt_ids, SamplingParams(max_tokens=params.pop("max_tokens", 16), **params))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_streamed_text_is_the_whole_decode_minus_the_prompts(engine):
    tok = engine.tokenizer
    checked = 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        outs = generate(engine, ids)
        output_ids = [t for out in outs for t in out.token_ids]
        whole, head = tok.decode(ids + output_ids), tok.decode(ids)
        if not whole.startswith(head):  # the prompt ends in byte tokens the output's continue: no such split
            continue
        assert "".join(out.text for out in outs) == whole[len(head):]
        checked += 1
    assert checked >= len(PROMPTS) - 2


def test_a_stop_word_on_the_first_generated_word_matches(engine):
    """The first word's leading space is part of the output text, so a stop word that includes it matches; so
    does one made of the output's first characters whatever they are."""
    matched = spaced = 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        text = "".join(out.text for out in generate(engine, ids))
        if text.startswith(" ") and len(text.split(" ")[1]) >= 2:
            word = " " + text.split(" ")[1][:2]
            spaced += 1
        elif len(text) >= 2 and not text[:2].isspace():
            word = text[:2]
        else:
            continue
        if "\ufffd" in word:  # the decode's stand-in for invalid bytes: no client's stop string
            continue
        outs = generate(engine, ids, stop_words=(word,))
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == word
        matched += 1
    assert matched >= 3
    if engine.tokenizer.decoder.__class__.__name__ == "Sequence":  # SentencePiece's decoder strips a space
        assert spaced >= 1


def test_generation_config_end_ids_stop_requests_as_transformers_generate_does(tiny_model, tmp_path):
    """generation_config.json's eos_token_id (a list, as Llama 3 has) is what transformers' generate stops at."""
    import json
    import shutil

    from tests.conftest import Oracle

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_model, path)
    ids = [256] + list(b"the quick brown fox")
    free = Oracle(str(path)).generate(ids, 24)
    extra = next(t for t in free[2:] if t != 257)  # a token it generates: now an end token too
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, extra]}))
    engine = InflightEngine(EngineConfig(checkpoint=str(path), num_kv_blocks=64))
    assert set(engine.eos_ids) == {257, extra}
    got = [t for out in generate(engine, ids, max_tokens=24) for t in out.token_ids]
    assert got == free[:free.index(extra) + 1]
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    want = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=0)[0, len(ids):]
    assert got == want.tolist()[:len(got)] and (len(want) == len(got) or want[len(got):].eq(0).all())


def test_a_llama_tokenizer_class_encodes_as_transformers_does(tmp_path):
    """tokenizer_config.json names LlamaTokenizer (legacy false): transformers 5 rebuilds that class's pipeline, so
    leading spaces encode differently from tokenizer.json as written; ours follows transformers, and the streamed
    text is still decode(prompt + output) - decode(prompt) with that tokenizer."""
    import json

    from transformers import AutoTokenizer

    path = sentencepiece_checkpoint(str(tmp_path / "llama2-like"))
    (tmp_path / "llama2-like" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True, "bos_token": "<s>",
         "eos_token": "</s>", "unk_token": "<unk>"}))
    hf = AutoTokenizer.from_pretrained(path)
    engine = InflightEngine(EngineConfig(checkpoint=path, num_kv_blocks=128))
    texts = [" hello", "  indented", "hello world", "naïve café", "emoji 🙂", "a\r\nb"]
    assert [engine.encode(t) for t in texts] == [hf(t)["input_ids"] for t in texts]
    from tokenizers import Tokenizer

    as_written = Tokenizer.from_file(f"{path}/tokenizer.json")
    assert as_written.encode(" hello").ids != hf(" hello")["input_ids"]  # the difference this test is about
    for text in texts:
        ids = engine.encode(text)
        outs = generate(engine, ids)
        output_ids = [t for out in outs for t in out.token_ids]
        whole, head = hf.decode(ids + output_ids, skip_special_tokens=True), hf.decode(ids, skip_special_tokens=True)
        if whole.startswith(head):
            assert "".join(out.text for out in outs) == whole[len(head):]

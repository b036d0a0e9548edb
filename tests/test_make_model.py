"""The tiny checkpoint is one that clients given --tokenizer-dir can use: transformers' AutoTokenizer reads it
and tokenizes exactly as the backend does."""
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from inflight_backend.checkpoint import load_tokenizer

TEXTS = ["hi", " Hello world", "naïve café — 日本語 🙂", "tabs\tand\r\nnewlines", "   leading spaces"]


@pytest.mark.parametrize("text", TEXTS)
def test_auto_tokenizer_matches_the_backends_tokenizer(tiny_model, text):
    auto, ours = AutoTokenizer.from_pretrained(tiny_model), load_tokenizer(tiny_model)
    ids = ours.encode(text).ids
    assert auto.encode(text) == ids
    assert auto.decode(ids, skip_special_tokens=True) == ours.decode(ids) == text


def test_special_tokens_and_chat_template(tiny_model):
    auto = AutoTokenizer.from_pretrained(tiny_model)
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    assert (auto.bos_token_id, auto.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    prompt = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "user: hi\nassistant: "

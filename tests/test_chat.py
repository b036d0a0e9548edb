"""Chat requests: messages rendered with the checkpoint's chat template exactly as transformers'
apply_chat_template renders them, tokenized without extra special tokens, through the engine and the server."""
import json

import numpy as np
import pytest

from inflight_backend.chat import ChatTemplate, parse_messages
from inflight_backend.protocol import PromptLimits, parse_request
from inflight_backend.request import RequestError

# Llama 3's template shape: bos_token, loop.first, trimming, a generation prompt, raise_exception.
LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{{ '<|eot_id|>' }}\n{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "user", "content": "naïve café 🙂?"}]


@pytest.mark.parametrize("template", [None, LLAMA3_LIKE])
def test_rendering_equals_transformers_apply_chat_template(tiny_model, tmp_path, template):
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_model, path)
    if template is not None:
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = ChatTemplate.from_checkpoint(str(path)).render(parse_messages(json.dumps(MESSAGES)))
    hf = AutoTokenizer.from_pretrained(str(path))
    plain = [{**m, "content": "Hello"} if isinstance(m["content"], list) else m for m in MESSAGES]
    assert ours == hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    if template is not None:
        with pytest.raises(RequestError, match="unknown role tool"):
            ChatTemplate.from_checkpoint(str(path)).render([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("raw, message", [
    ("not json", "not valid JSON"), ("{}", "JSON list"), ("[]", "JSON list"), ('[{"content": "x"}]', "'role'"),
    ('[{"role": "user", "content": 5}]', "'content' must be"),
    ('[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]', "only text parts"),
])
def test_bad_messages_are_refused_by_name(raw, message):
    with pytest.raises(RequestError, match=message):
        parse_messages(raw)


def test_a_messages_request_is_its_rendered_prompt(tiny_model):
    from inflight_backend.config import EngineConfig
    from inflight_backend.engine import InflightEngine

    engine = InflightEngine(EngineConfig(checkpoint=tiny_model, num_kv_blocks=32))
    get = {"messages": np.array([json.dumps(MESSAGES[:2]).encode()], dtype=object)}.get
    parsed = parse_request(get, engine.encode, 16, PromptLimits(10_000, 1000), chat=engine.encode_chat)
    text = "system: Be brief. \nuser: Hi there\nassistant: "
    assert parsed.prompt_text == text and parsed.prompt_ids == list(text.encode())  # no BOS added: no template BOS
    with pytest.raises(RequestError, match="one of text_input, input_ids and messages"):
        parse_request({**{"text_input": np.array([b"x"], dtype=object)}, "messages": get("messages")}.get,
                      engine.encode, 16, PromptLimits(10_000, 1000), chat=engine.encode_chat)


@pytest.mark.server
def test_messages_through_the_server(server):
    from tests.triton_helpers import grpc_generate, http_post

    url = f"127.0.0.1:{server.grpc_port}"
    text = "system: Be brief. \nuser: Hi there\nassistant: "
    chat = grpc_generate(url, "llm", {"messages": json.dumps(MESSAGES[:2]), "max_tokens": 8, "stream": True})
    plain = grpc_generate(url, "llm", {"input_ids": list(text.encode()), "max_tokens": 8, "stream": True})
    assert chat.error is None and chat.ids == plain.ids
    status, body = http_post(server.http_port, "/v2/models/llm/generate",
                             {"messages": json.dumps(MESSAGES[:2]), "max_tokens": 4})
    assert status == 200 and json.loads(body)["text_output"].startswith(text)

from inflight_backend.detokenizer import IncrementalDetokenizer, byte_fallback_ids, special_ids
from inflight_backend.make_model import byte_level_tokenizer


def deltas(ids, tok=None):
    tok = tok or byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok, special_ids(tok))
    parts = [detok.add(i) for i in ids]
    parts.append(detok.flush())
    return parts, tok.decode(ids)


def test_multibyte_characters_are_never_split():
    ids = list("aé日🙂b".encode())
    parts, full = deltas(ids)
    assert "".join(parts) == full == "aé日🙂b"
    assert all("\ufffd" not in p for p in parts)
    assert "日" in parts and "🙂" in parts  # each released whole, on its last byte


def test_invalid_bytes_and_special_tokens_still_concatenate_to_the_full_decode():
    ids = [0xFF, 65, 0xE6, 0x97, 257, 66, 0xE6, 256]
    parts, full = deltas(ids)
    assert "".join(parts) == full
    assert "\ufffd" in full


def test_runs_of_special_tokens_do_not_grow_the_decoded_window():
    tok = byte_level_tokenizer()
    tok.add_special_tokens([f"<extra_{i}>" for i in range(4)])  # ids 258..261, as the bench models have
    decoded = []
    real_decode = tok.decode

    class Counting:  # the Rust tokenizer's methods are read-only: wrap it
        def decode(self, ids, **kwargs):
            decoded.append(len(ids))
            return real_decode(ids, **kwargs)

        def get_added_tokens_decoder(self):
            return tok.get_added_tokens_decoder()

    ids = [72, 105] + [258, 259, 260, 261] * 50 + [0xE6, 0x97, 0xA5, 33]
    detok = IncrementalDetokenizer(Counting(), special_ids(tok))
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == real_decode(ids) == "Hi日!"
    assert max(decoded) <= 4  # never the run of 200 special tokens
    assert special_ids(tok) == {256, 257, 258, 259, 260, 261}


# Real families' structures: SentencePiece-style (Llama 2, Mistral: byte fallback, `▁` for spaces, one leading
# space stripped per decode) and byte-level BPE (Llama 3 and Qwen2: GPT-2's byte alphabet, split regexes).
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.tokenizer_fixtures import byte_level_bpe_tokenizer, sentencepiece_style_tokenizer  # noqa: E402

SP = sentencepiece_style_tokenizer()
TOKENIZERS = {"sentencepiece": SP, "llama3": byte_level_bpe_tokenizer("llama3"),
              "qwen2": byte_level_bpe_tokenizer("qwen2")}


def stream(tok, prompt_ids, output_ids):
    detok = IncrementalDetokenizer(tok, special_ids(tok), prompt_ids, byte_fallback_ids(tok))
    parts = [detok.add(i) for i in output_ids]
    parts.append(detok.flush())
    return parts


def test_the_first_generated_word_keeps_its_leading_space():
    """Llama 2's bug: decoding the output alone strips the space before its first word."""
    prompt = SP.encode("hello world").ids
    output = SP.encode(" momentum fox", add_special_tokens=False).ids[1:]  # the words' tokens, no extra `▁`
    whole = SP.decode(prompt + output)
    assert whole.startswith(SP.decode(prompt)) and not SP.decode(output).startswith(" ")
    parts = stream(SP, prompt, output)
    assert "".join(parts) == whole[len(SP.decode(prompt)):]
    assert parts[0].startswith(" ") or "".join(parts).startswith(" ")


def test_a_byte_run_goes_on_across_a_special_token_in_the_prompt():
    """`decode` drops special tokens before it joins byte tokens into runs, so a run that an <unk> splits in the
    prompt is one run, here not valid UTF-8 (it starts with a continuation byte): every byte of it, the output's
    too, is a replacement character (hypothesis found it: the prompt's context had stopped at the <unk>)."""
    byte = {b: SP.token_to_id(f"<0x{b:02X}>") for b in (0x00, 0x80, 0xC2, 0x5B, 0x5D, 0x5C, 0x0D)}
    prompt = [byte[0x80], SP.token_to_id("<unk>"), byte[0xC2], byte[0x80], byte[0x5B], byte[0x5D], byte[0x5C],
              byte[0x0D]]
    output = [byte[0x00]]
    whole, head = SP.decode(prompt + output), SP.decode(prompt)
    assert whole.startswith(head) and whole[len(head):] == "\ufffd"
    assert "".join(stream(SP, prompt, output)) == "\ufffd"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_deltas_are_the_decode_of_prompt_and_output_minus_the_prompts(name):
    """For any ids (invalid byte runs, characters split across tokens, special tokens): the streamed deltas
    concatenate to decode(prompt + output) - decode(prompt) whenever the prompt's text is a prefix of the whole
    text (a character whose bytes straddle the two has no such split), and never hold a replacement character
    the whole decode lacks. 1,000 examples per tokenizer."""
    tok = TOKENIZERS[name]
    ids = st.integers(0, tok.get_vocab_size() - 1)

    @given(prompt=st.lists(ids, min_size=1, max_size=20), output=st.lists(ids, max_size=40))
    @settings(max_examples=1000, deadline=None)
    def check(prompt, output):
        whole, head = tok.decode(prompt + output), tok.decode(prompt)
        text = "".join(stream(tok, prompt, output))
        if whole.startswith(head):
            assert text == whole[len(head):]
        assert text.count("\ufffd") <= whole.count("\ufffd")

    check()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_without_a_prompt_the_deltas_are_the_decode(name):
    tok = TOKENIZERS[name]

    @given(output=st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=40))
    @settings(max_examples=300, deadline=None)
    def check(output):
        assert "".join(stream(tok, [], output)) == tok.decode(output)

    check()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_real_text_streams_exactly(name):
    """Text in many scripts, encoded as the tokenizer does and streamed token by token after its first half."""
    tok = TOKENIZERS[name]
    texts = ["hello world", "I'm 12345 привет 👍🏽", "日本語 Grüße\r\nnaïve", "👨‍👩‍👧 family", "  indented\tx",
             "x = f(y) + 2;\n\n    return"]
    for text in texts:
        ids = tok.encode(text).ids
        for cut in range(1, len(ids)):
            prompt, output = ids[:cut], ids[cut:]
            whole, head = tok.decode(prompt + output), tok.decode(prompt)
            if whole.startswith(head):
                assert "".join(stream(tok, prompt, output)) == whole[len(head):], (name, text, cut)

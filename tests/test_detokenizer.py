from inflight_backend.detokenizer import IncrementalDetokenizer
from inflight_backend.make_model import byte_level_tokenizer


def deltas(ids):
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok)
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

from inflight_backend.detokenizer import IncrementalDetokenizer, special_ids
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

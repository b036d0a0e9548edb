"""Incremental detokenization: the new text of each token, never half a UTF-8 character."""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


def byte_fallback_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback tokens (<0x00>..<0xFF>, as Llama 2 and Mistral have). Their decoder turns
    a whole run of them into text at once (one replacement character per byte if the run is not valid UTF-8), so
    a run's text is final only once a token of another kind ends it."""
    vocab = tokenizer.get_vocab()
    ids = [i for b in range(256) if (i := vocab.get(f"<0x{b:02X}>")) is not None]
    return frozenset(ids) if len(ids) == 256 else frozenset()


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens, which `decode` skips: they never contribute text."""
    return frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)


class IncrementalDetokenizer:
    """Decodes a growing list of output ids a few tokens at a time.

    Text is released only once it no longer ends in a replacement character (nor, with byte fallback, in a byte
    token), so a multi-byte character split over several tokens comes out whole; `flush()` releases whatever is
    left when the request ends. The concatenation of every delta equals `tokenizer.decode(all ids)`; given the
    prompt's ids, it equals decode(prompt + output) minus decode(prompt), the first word's leading space included.
    Special tokens (`skip`, from `special_ids`) are dropped on arrival, as `decode` drops them: kept, a run of
    them produces no text, so nothing is released and every further token would decode the whole growing run.
    """

    def __init__(self, tokenizer: Tokenizer, skip: frozenset[int] = frozenset(), prompt_ids: Sequence[int] = (),
                 byte_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip
        self._bytes = byte_ids  # from byte_fallback_ids: text ending in one of them may still change
        # The prompt's last tokens, decoded with the first new ones and never released: a SentencePiece decoder
        # strips the leading space of whatever comes first in a decode, and a byte-level one may merge across.
        self._ids: list[int] = _context(prompt_ids, skip, byte_ids)
        self._prefix_offset = 0  # ids before this are fully released and not needed for context
        self._read_offset = len(self._ids)  # ids before this have had their text released
        self._released: list[str] = []  # the deltas so far (joined only when asked: no per-token copy)

    @property
    def text(self) -> str:
        """Everything released so far (its cost grows with the text: for stop strings, not every token)."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def add(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        ids = self._ids
        if not final and ids[-1] in self._bytes:  # a byte run's text is known once the run ends
            return ""
        prefix = self._tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        full = self._tokenizer.decode(ids[self._prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self._released.append(delta)
        return delta


class NoText:
    """IncrementalDetokenizer's place for a request whose client reads ids only: no decoding per token."""

    text = ""

    def add(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


_CONTEXT_TOKENS = 6  # vLLM decodes the first new token with 5 prompt tokens before it


def _context(prompt_ids, skip: frozenset[int], byte_ids: frozenset[int]) -> list[int]:
    """The prompt's last few tokens that decode as text; one that falls inside a run of byte tokens takes the
    whole run (its text depends on all of it). Special tokens are left out, as `decode` leaves them out before
    it joins bytes into runs: a run goes on across them."""
    context: list[int] = []
    i = len(prompt_ids)
    while i > 0 and (len(context) < _CONTEXT_TOKENS or context[-1] in byte_ids):  # short, or in a byte run
        i -= 1
        token = prompt_ids[i]
        if token in skip:
            continue
        if len(context) >= _CONTEXT_TOKENS and token not in byte_ids:  # the run began after this token
            break
        context.append(token)
    return context[::-1]

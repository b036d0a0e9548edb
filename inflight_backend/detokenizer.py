"""Incremental detokenization: the new text of each token, never half a UTF-8 character."""
from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens, which `decode` skips: they never contribute text."""
    return frozenset(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special)


class IncrementalDetokenizer:
    """Decodes a growing list of output ids a few tokens at a time.

    Text is released only once it no longer ends in a replacement character, so a multi-byte character split
    over several tokens comes out whole; `flush()` releases whatever is left when the request ends. The
    concatenation of every delta equals `tokenizer.decode(all ids)`. Special tokens (`skip`, from
    `special_ids`) are dropped on arrival, as `decode` drops them: kept, a run of them produces no text, so
    nothing is released and every further token would decode the whole growing run again.
    """

    def __init__(self, tokenizer: Tokenizer, skip: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip
        self._ids: list[int] = []
        self._prefix_offset = 0  # ids before this are fully released and not needed for context
        self._read_offset = 0  # ids before this have had their text released
        self.text = ""

    def add(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        ids = self._ids
        prefix = self._tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        full = self._tokenizer.decode(ids[self._prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        self.text += delta
        return delta

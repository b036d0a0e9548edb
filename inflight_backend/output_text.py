"""One request's output text as it streams: the text of each new token, and its stop strings.

Where a request's stop strings are cut from its output (`include_stop_str_in_output` false), the last characters
that could still begin one are held back until they cannot: each step releases only what is certain to stay.
"""
from __future__ import annotations

from .detokenizer import IncrementalDetokenizer, NoText
from .request import RequestStatus


class OutputText:
    """`detok` decodes the request's tokens (NoText where nothing needs text): the engine calls its `add(token)`
    for each new token's text; `stop_words` are the request's stop strings; `cut`: they are removed from the
    output, so text that could begin one waits (`holds`)."""

    __slots__ = ("detok", "holds", "_stop_words", "_longest", "_sent", "_hold")

    def __init__(self, detok: IncrementalDetokenizer | NoText, stop_words: tuple[str, ...] = (),
                 cut: bool = False) -> None:
        self.detok = detok
        self._stop_words = stop_words
        self._longest = max((len(w) for w in stop_words), default=0)
        self.holds = bool(cut and stop_words)  # text waits here (release) rather than leaving as it is decoded
        self._sent: int | None = 0 if self.holds else None  # how much of detok.text went out
        self._hold = self._longest - 1  # characters held back while no stop string has come

    def stop_string(self, delta: str) -> tuple[int, str] | None:
        """After a token that added `delta`: (where in the text it starts, the stop string) for the first stop
        string now in the text, or None. Only the window `delta` can have completed is searched."""
        text = self.detok.text
        window = max(len(text) - self._longest - len(delta), 0)
        found = [(k, w) for w in self._stop_words if (k := text.find(w, window)) >= 0]
        return min(found) if found else None

    def release(self, stop: int | None) -> str:
        """For text that waits (`holds`): what can go out now. `stop`: None (the request goes on), -1 (stopped by
        a token: all of it goes) or where the stop string starts (the text before it goes)."""
        assert self._sent is not None
        text, sent = self.detok.text, self._sent
        if stop is None:
            end = max(len(text) - self._hold, sent)
        else:
            end = len(text) if stop < 0 else stop
        self._sent = end
        return text[sent:end]

    def rest(self, status: RequestStatus, flush: bool) -> str:
        """The text still owed when the request ends with `status`: what was held back if it ran to its length,
        then the detokenizer's last characters (not for an error, nor when `flush` is false: after a cut)."""
        text = self.detok.text[self._sent:] if status == RequestStatus.FINISHED_LENGTH and self._sent is not None \
            else ""
        if status != RequestStatus.FINISHED_ERROR and flush:
            text += self.detok.flush()
        return text

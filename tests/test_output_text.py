"""A request's streamed text (`output_text.py`): stop strings found where a token completes them, and the text
that could begin one held back until it cannot, when stop strings are cut from the output."""
from inflight_backend.output_text import OutputText
from inflight_backend.request import RequestStatus


class Chars:
    """A detokenizer whose token t is the character chr(t), with one character always pending until flush."""

    def __init__(self) -> None:
        self.text, self._pending = "", ""

    def add(self, token: int) -> str:
        out, self._pending = self._pending, chr(token)
        self.text += out
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        self.text += out
        return out


def feed(text: OutputText, chars: str):
    """(released text, stop) for each character fed; stops at the first stop string."""
    released = []
    for c in chars:
        delta = text.detok.add(ord(c))
        stop = text.stop_string(delta) if delta else None
        released.append(text.release(stop and stop[0]) if text.holds else delta)
        if stop is not None:
            return "".join(released), stop
    return "".join(released), None


def test_a_cut_stop_string_never_leaves_and_what_precedes_it_does():
    text = OutputText(Chars(), ("END",), cut=True)
    out, stop = feed(text, "abcENDxy")
    assert stop == (3, "END") and out == "abc"  # "D" completed it a token late: one pending character


def test_held_text_that_turns_out_not_to_stop_is_released():
    text = OutputText(Chars(), ("END",), cut=True)
    out, stop = feed(text, "abENxyz")
    assert stop is None and out == "abEN"  # "xy" held (they could begin "END"), "z" pending in the detokenizer
    assert text.rest(RequestStatus.FINISHED_LENGTH, flush=True) == "xyz"


def test_uncut_stop_strings_stream_as_decoded():
    text = OutputText(Chars(), ("END",), cut=False)
    assert not text.holds
    out, stop = feed(text, "aENDb")
    assert stop == (1, "END") and out == "aEND"
    assert text.rest(RequestStatus.FINISHED_STOPPED, flush=True) == "b"


def test_an_error_owes_no_text():
    text = OutputText(Chars(), ("END",), cut=True)
    feed(text, "abcd")
    assert text.rest(RequestStatus.FINISHED_ERROR, flush=True) == ""


def test_the_earliest_of_several_stop_strings_wins():
    text = OutputText(Chars(), ("xyz", "yz"), cut=True)
    out, stop = feed(text, "axyzb")
    assert stop == (1, "xyz") and out == "a"

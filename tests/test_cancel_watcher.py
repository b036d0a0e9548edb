"""The thread that asks Triton about cancelled clients, and the stop signal from `inflight serve`."""
import os
import subprocess
import sys
import threading
import time

from inflight_backend.cancel_watcher import CancelWatcher
from inflight_backend.stop_signal import StopSignal


class Sender:
    def __init__(self, cancelled: bool) -> None:
        self.cancelled, self.asked = cancelled, 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancelled


def test_every_open_stream_is_asked_each_tick_and_cancelled_once():
    senders = {str(i): Sender(cancelled=i % 3 == 0) for i in range(64)}
    cancelled, ticks, swept = [], [], threading.Event()

    def open_senders():
        if len(ticks) >= 3:
            swept.set()
        return [(req_id, sender.is_cancelled) for req_id, sender in senders.items()]

    watcher = CancelWatcher(open_senders, cancelled.append, lambda: ticks.append(1), tick=0.001)
    assert swept.wait(30)
    watcher.stop()
    assert sorted(cancelled, key=int) == [str(i) for i in range(0, 64, 3)]  # each once, though asked every tick
    assert all(s.asked >= 3 for s in senders.values() if not s.cancelled)


def test_long_sweeps_space_the_ticks_out():
    """A tick whose round trips take 20 ms, due every 1 ms, waits (1 / max_share - 1) times as long as it took."""
    starts = []

    def open_senders():
        starts.append(time.monotonic())
        time.sleep(0.02)
        return []

    began = time.monotonic()
    watcher = CancelWatcher(open_senders, lambda req_id: None, lambda: None, tick=0.001, max_share=0.1)
    time.sleep(0.5)
    watcher.stop()
    elapsed = time.monotonic() - began  # more than 0.5 s on a loaded machine: the bound follows it
    assert 1 <= len(starts) <= 1 + elapsed / (0.02 * 10 * 0.9)  # unbounded: ~24 ticks in 0.5 s
    assert all(b - a >= 0.02 * 10 * 0.9 for a, b in zip(starts, starts[1:]))


def test_a_failing_sender_does_not_stop_the_watching():
    class Broken(Sender):
        def is_cancelled(self):
            raise RuntimeError("Cannot communicate with parent service")

    calls, done = [], threading.Event()

    def open_senders():
        calls.append(1)
        if len(calls) > 3:
            done.set()
        return [("a", Broken(False).is_cancelled)]

    watcher = CancelWatcher(open_senders, lambda req_id: None, lambda: None, tick=0.001)
    assert done.wait(30)
    watcher.stop()


def test_the_stop_signal_is_a_file_or_the_supervisor_gone(tmp_path):
    assert not StopSignal().is_set()
    signal = StopSignal(str(tmp_path / "stop"), supervisor_pid=os.getpid(), server_pid=_child_pid())
    assert not signal.is_set()  # the "supervisor" (this process) is the "server's" parent
    (tmp_path / "stop").touch()
    assert signal.is_set()
    assert StopSignal(None, supervisor_pid=os.getpid() + 10**6, server_pid=os.getpid()).is_set()  # not our parent


def _child_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _children.append(child)
    return child.pid


_children: list = []


def teardown_module():
    for child in _children:
        child.kill()
        child.wait()

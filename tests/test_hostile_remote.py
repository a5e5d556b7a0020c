"""A dataset served over HTTP is checked as strictly as one on disk: percent-encoded traversal
in its manifest is refused before any request (against a server that decodes and normalises
paths as nginx does), and an endless ``index.json`` stops at the manifest bound."""

from __future__ import annotations

import copy
import http.server
import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from helpers import write_dataset
from http_server import serving

import shardloader as sl
from shardloader import manifest as manifest_module
from shardloader.errors import ManifestError
from shardloader.manifest import Manifest


@dataclass
class Server:
    url: str = ""
    paths: list[str] = field(default_factory=list)  # as requested, before decoding
    headers: list[dict[str, str]] = field(default_factory=list)
    sent: int = 0  # bytes of the endless body written


def _handler(root: Path, server: Server) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:
            server.paths.append(self.path)
            server.headers.append(dict(self.headers.items()))
            if self.path == "/endless/index.json":  # whitespace, chunked, until 64 MiB
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b" " * 65536
                try:
                    while server.sent < 64 << 20:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        server.sent += len(chunk)
                    self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass
                return
            # decode, then normalise: what nginx does before it maps a URL to a file
            path = posixpath.normpath(unquote(self.path.split("?", 1)[0]))
            file = root / path.lstrip("/")
            if not file.is_file():
                self.send_error(404)
                return
            data = file.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.fixture
def www(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    root = tmp_path / "www"
    root.mkdir()
    state = Server()
    with serving(_handler(root, state)) as url:
        state.url = url
        yield state, root


def _read(url: str, tmp_path: Path) -> list[dict[str, Any]]:
    read = sl.ReadOptions(
        storage_options={"headers": {"Authorization": "Bearer s3cret"}},
        cache=sl.CacheOptions(dir=str(tmp_path / "cache")),
        readahead=0,
    )
    return list(sl.ShardedDataset(url, decoder=None, read=read))


@pytest.mark.parametrize(
    "escape",
    [
        "%2e%2e/%2e%2e/private/",  # nginx decodes, then .. climbs out
        "%252e%252e/%252e%252e/private/",  # a server that decodes twice
        "..%2f..%2fprivate/",  # an encoded slash
        "sub/..;/..;/..;/private/",  # Tomcat's path parameters
    ],
)
def test_encoded_traversal_in_a_remote_manifest_is_refused_before_any_request(
    www: tuple[Server, Path], tmp_path: Path, escape: str
) -> None:
    server, root = www
    write_dataset(str(root / "ds"), [4], compression="zstd")
    write_dataset(str(root / "private"), [4], compression="zstd")  # what must stay private
    raw = json.loads((root / "ds" / "index.json").read_text())
    private = json.loads((root / "private" / "index.json").read_text())
    raw["shards"] = copy.deepcopy(private["shards"])  # the private shard, checksums and all
    for shard in raw["shards"]:
        shard["path"] = escape + shard["path"]
        shard["index_path"] = escape + shard["index_path"]
    (root / "ds" / "index.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError) as err:
        _read(f"{server.url}/ds", tmp_path)
    assert "shards[0].path" in str(err.value) and "'.." in str(err.value)
    assert server.paths == ["/ds/index.json"]  # nothing outside the dataset was asked for


def test_a_local_manifest_with_encoded_traversal_is_refused_too(tmp_path: Path) -> None:
    write_dataset(str(tmp_path / "ds"), [4], compression="zstd")
    raw = json.loads((tmp_path / "ds" / "index.json").read_text())
    raw["shards"][0]["path"] = "%2e%2e/x.tar.zst"
    with pytest.raises(ManifestError, match=r"decodes to '\.\./x\.tar\.zst'"):
        Manifest.from_json(json.dumps(raw).encode(), "index.json")


def test_an_endless_remote_index_json_stops_at_the_bound(
    www: tuple[Server, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = www
    # the bound, lowered so the test is quick; the real one is 256 MiB
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 1 << 20, raising=False)
    with pytest.raises(ManifestError, match="larger than 1 MiB") as err:
        _read(f"{server.url}/endless", tmp_path)
    assert "/endless/index.json" in str(err.value)
    assert server.sent < 16 << 20  # the reader stopped, and the server with it

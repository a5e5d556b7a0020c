"""Real HTTP servers for the tests, on 127.0.0.1 only: a ``ThreadingHTTPServer`` whose handler
the test chooses, served from a daemon thread and shut down and closed when the block ends.

    with serving(static_files(root)) as url:      # plain static files, no Range support
        ...
    with serving(Handler, context=tls) as url:    # https://127.0.0.1:PORT
        ...
"""

from __future__ import annotations

import http.server
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

__all__ = ["QuietFiles", "serving", "static_files"]


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    """Static files, without a log line on stderr per request."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib name
        pass


def static_files(root: str | Path, handler: type[QuietFiles] = QuietFiles) -> Callable[..., Any]:
    """A handler serving the files under ``root`` (``handler``: a subclass that bends some)."""
    return partial(handler, directory=str(root))


@contextmanager
def serving(handler: Callable[..., Any], *, context: ssl.SSLContext | None = None) -> Iterator[str]:
    """Serve ``handler`` on a free port of 127.0.0.1 (TLS with ``context``); yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    scheme = "http"
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), daemon=True, name="http-test"
    )
    thread.start()
    try:
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

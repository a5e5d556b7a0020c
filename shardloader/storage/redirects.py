"""Which HTTP redirects the fast HTTP client follows, and what it carries along.

A dataset URL is the user's choice; where it redirects is the server's.  So a redirect is
followed the way ``requests`` and curl follow one, and a little more strictly:

- only to ``http://`` or ``https://`` (curl's default ``--proto-redir``): a ``Location`` of
  ``file:``, ``ftp:`` or anything else is refused, never turned into a request;
- never from ``https`` back to ``http``: once a chain is encrypted it stays so;
- at most :data:`MAX_REDIRECTS` hops (a loop ends there);
- the headers of ``storage_options={"headers": ...}`` (a bearer token, an API key, cookies)
  go only to the origin they were given for: on a hop to another origin (scheme, host or port)
  every one of them is dropped but the content-negotiation headers in :data:`SAFE_HEADERS`,
  and they stay dropped for the rest of the chain.  ``requests`` drops only
  ``Authorization`` there; a credential in a custom header (``X-Api-Key``) is one too.  As in
  ``requests``, ``http://host`` to ``https://host`` on the default ports is the same origin
  (an upgrade keeps them).

Every refusal, and every error after the first hop, names the whole chain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import quote, urljoin, urlsplit

from shardloader.errors import StorageError

__all__ = [
    "MAX_REDIRECTS",
    "REDIRECT_STATUSES",
    "SAFE_HEADERS",
    "chain_text",
    "next_hop",
    "request_target",
]

MAX_REDIRECTS = 10  # requests allows 30, curl 50; a dataset behind a CDN needs one or two
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
SAFE_HEADERS = frozenset({"accept", "accept-language", "user-agent", "range"})
_SCHEMES = ("http", "https")
_DEFAULT_PORTS = {"http": 80, "https": 443}
# What may stand unquoted in a request target (requests' requote_uri): reserved characters
# and '%', so escapes already in the URL stay as they are.
_TARGET_SAFE = "!#$%&'()*+,/:;=?@[]~"


def chain_text(chain: Sequence[str]) -> str:
    """``a -> b -> c``: the hops a request took."""
    return " -> ".join(chain)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # a port that is not a number: refused by the client later
        port = None
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


def same_origin(old: str, new: str) -> bool:
    """Whether credentials meant for ``old`` may go to ``new``: same scheme, host and port,
    or the upgrade from ``http`` to ``https`` on the default ports of one host."""
    a, b = _origin(old), _origin(new)
    if a == b:
        return True
    return a[1] == b[1] and a[::2] == ("http", 80) and b[::2] == ("https", 443)


def next_hop(
    chain: list[str], location: str, headers: Mapping[str, str]
) -> tuple[str, dict[str, str]]:
    """The URL to request after the last one in ``chain`` answered a redirect to ``location``,
    and the headers to send there; appends it to ``chain``.  A redirect that must not be
    followed is a :class:`StorageError` naming the chain."""
    here = chain[-1]
    target = urljoin(here, location.strip())
    scheme = urlsplit(target).scheme.lower()
    shown = chain_text([*chain, target])
    if scheme not in _SCHEMES:
        raise StorageError(
            f"cannot read {chain[0]!r}: refused a redirect to {target!r}: only http and https "
            f"redirects are followed (redirects: {shown})"
        )
    if urlsplit(here).scheme.lower() == "https" and scheme == "http":
        raise StorageError(
            f"cannot read {chain[0]!r}: refused a redirect from https to plain http "
            f"({target!r}): it would send the request unencrypted (redirects: {shown})"
        )
    if len(chain) > MAX_REDIRECTS:
        raise StorageError(
            f"cannot read {chain[0]!r}: more than {MAX_REDIRECTS} redirects (redirects: {shown})"
        )
    chain.append(target)
    if same_origin(here, target):
        return target, dict(headers)
    return target, {k: v for k, v in headers.items() if k.lower() in SAFE_HEADERS}


def request_target(url: str) -> str:
    """The path and query of ``url`` to put on the request line, with characters a request
    line cannot carry (spaces, non-ASCII, controls) percent-encoded, as ``requests`` does."""
    parts = urlsplit(url)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return quote(target, safe=_TARGET_SAFE)

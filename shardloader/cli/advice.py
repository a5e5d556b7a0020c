"""The library's advice in the command line's terms, applied to every error the CLI prints.

The library names its remedies as Python (``storage_options={'anon': True}``,
``RetryPolicy(max_attempts=100, max_total_seconds=240)``), which is right for a caller of
``ShardedDataset`` and wrong for someone at a shell.  The CLI rewrites them into the flags that
do the same (``-o anon=true``, ``--retries 99 --retry-seconds 240``), in one place; a message
without such advice passes unchanged.
"""

from __future__ import annotations

import re

__all__ = ["in_cli_terms"]

_RETRY = re.compile(r"RetryPolicy\(max_attempts=(\d+), max_total_seconds=([0-9.]+)\)")

_PLAIN = (
    ("storage_options={'anon': True}", "-o anon=true"),
    ("storage_options={'key': ..., 'secret': ...}", "-o key=... -o secret=..."),
    ("storage_options endpoint_url", "-o endpoint_url=..."),
    ("storage_options key/secret", "-o key=... -o secret=..."),
    ("raise the policy's limits or timeouts", "raise --retries or --retry-seconds"),
)


def _retry_flags(m: re.Match[str]) -> str:
    seconds = float(m.group(2))
    return f"--retries {int(m.group(1)) - 1} --retry-seconds {seconds:g}"


def in_cli_terms(message: str) -> str:
    """``message`` with the library's Python advice replaced by the CLI flags that do it."""
    for python, flags in _PLAIN:
        message = message.replace(python, flags)
    return _RETRY.sub(_retry_flags, message)

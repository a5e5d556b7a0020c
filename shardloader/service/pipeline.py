"""What ``shardloader serve PIPELINE`` serves: a ``module:factory`` dataset, or a dataset path
configured by the command's options (a :class:`~shardloader.presets.DatasetPreset`); and the
bearer token file.  Nothing a client sends is ever run: PIPELINE comes from the command line of
the serving machine.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from typing import TYPE_CHECKING, Any

from shardloader.errors import UsageError
from shardloader.options import World
from shardloader.presets import DatasetPreset

if TYPE_CHECKING:
    from shardloader.dataset import ShardedDataset

__all__ = ["declared_options", "is_factory", "load_pipeline", "read_token"]

_FACTORY = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_factory(pipeline: str) -> bool:
    """Whether PIPELINE names ``package.module:factory`` (and is not an existing path)."""
    return bool(_FACTORY.match(pipeline)) and not os.path.exists(pipeline)


def read_token(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); never empty.

    Like ssh with a private key, a file that other users may read or write is refused: on a
    shared host its token would let any of them read every batch.  Opened without blocking and
    checked on the open file (no FIFO can hang the start, no swap between check and read).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise UsageError(f"--token-file {path}: cannot read it ({err})") from err
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UsageError(f"--token-file {path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        if st.st_mode & 0o077:
            raise UsageError(
                f"--token-file {path}: its permissions {stat.S_IMODE(st.st_mode):04o} let other "
                f"users read or change the token; make it private: `chmod 600 {path}`"
            )
        try:
            token = f.read(_MAX_TOKEN_FILE + 1).decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"--token-file {path}: cannot read it ({err})") from err
    if len(token) < 16 or len(token) > _MAX_TOKEN_FILE or any(c.isspace() for c in token):
        raise UsageError(
            f"--token-file {path}: the token must be one word of at least 16 "
            "characters, e.g. from `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    return token


_MAX_TOKEN_FILE = 4096  # bytes: a token, not a file that happens to be named


def load_pipeline(pipeline: str, preset: DatasetPreset | None = None) -> ShardedDataset:
    """The dataset PIPELINE names: a ``module:factory`` result, or the dataset path/URL
    configured by ``preset`` (:class:`shardloader.presets.DatasetPreset`, as ``shardloader
    bench`` builds it too; a factory configures its own dataset, so it takes no preset)."""
    from shardloader.dataset import ShardedDataset

    if not is_factory(pipeline):
        return (preset or DatasetPreset()).dataset(pipeline, world=World(0, 1))
    if preset is not None:
        raise UsageError(
            f"PIPELINE {pipeline} is a factory that configures its own dataset; "
            "dataset options apply to a dataset path"
        )
    import pkgutil

    module_name, _, attr = pipeline.partition(":")
    try:
        target: Any = pkgutil.resolve_name(pipeline)
    except ImportError as err:
        raise UsageError(
            f"PIPELINE {pipeline}: cannot import {module_name} ({err}); is it "
            "installed or on PYTHONPATH on this machine?"
        ) from err
    except AttributeError as err:
        raise UsageError(f"PIPELINE {pipeline}: {module_name} has no {attr!r} ({err})") from err
    dataset = target
    if callable(target) and not isinstance(target, ShardedDataset):
        import inspect

        try:
            inspect.signature(target).bind()
        except TypeError as err:
            raise UsageError(
                f"PIPELINE {pipeline}: the factory must be callable without arguments ({err})"
            ) from err
        except ValueError:  # no signature to inspect (builtins): just call it
            pass
        dataset = target()
    if not isinstance(dataset, ShardedDataset):
        raise UsageError(
            f"PIPELINE {pipeline} gave a {type(dataset).__name__}; the factory "
            "must return a shardloader.ShardedDataset"
        )
    return dataset


# where and how the data is fetched: replicas may differ in these and still make the same batches
_NOT_PIPELINE = frozenset({"cache_dir", "storage_options", "retry"})


def declared_options(pipeline: str, preset: DatasetPreset | None) -> dict[str, Any]:
    """What the command line declares about the pipeline, for its fingerprint (NOTE [pinned
    pipeline] in :mod:`shardloader.service.fingerprint`): the preset's options (``--transform``,
    ``--image-size``, ``--decode``, ...) for a dataset path, the factory's name otherwise."""
    if preset is None:
        return {"factory": pipeline}
    return {
        f.name: getattr(preset, f.name)
        for f in dataclasses.fields(preset)
        if f.name not in _NOT_PIPELINE
    }

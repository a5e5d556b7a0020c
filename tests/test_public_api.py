"""The public surface is what __all__ says, and each error is also the matching built-in."""

import types

import shardloader
from shardloader import errors


def test_all_names_exist_and_public_names_are_exported():
    assert sorted(shardloader.__all__) == sorted(set(shardloader.__all__))
    for name in shardloader.__all__:
        assert hasattr(shardloader, name), name
    public = {n for n, v in vars(shardloader).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public <= set(shardloader.__all__), public - set(shardloader.__all__)


def test_every_error_is_a_shardloader_error_and_a_builtin():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ShardloaderError)
        if cls is not errors.ShardloaderError:
            assert issubclass(cls, (ValueError, OSError, RuntimeError)), name

"""Imported once by the forkserver that starts pack workers, so that workers start warm.

Only what a worker runs: the shard writer and what it imports (numpy, pyarrow for sidecars,
zstandard, xxhash, msgspec) and the built-in formats; never torch, pandas, botocore or aiohttp
(tests/test_pack_run.py checks a worker's modules).  A format from a plugin module is imported
by the worker that first needs it (``WriteSpec.format_module``).
"""

import shardloader.pack.write  # noqa: F401

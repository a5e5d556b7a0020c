"""Imported once by the forkserver that starts pack workers, so that workers start warm.

Besides the writer, pyarrow's first ``pa.array`` call imports pandas (seconds on a busy machine);
doing it here means the forked workers inherit it instead of each paying for it.
"""

import pyarrow as pa

import shardloader.pack.write  # noqa: F401

pa.array([0])

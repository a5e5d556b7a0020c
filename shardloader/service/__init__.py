"""Service mode: ``shardloader serve`` runs the pipeline on CPU machines and streams finished
batches; :class:`RemoteLoader` reads them in the training loop.  A thin layer over the library:
the server iterates the same :class:`~shardloader.ShardedDataset` a local loader would.

The server side (:mod:`shardloader.service.server`) needs the ``serve`` extra (starlette,
uvicorn); the client needs only the standard library.
"""

from shardloader.service.client import RemoteLoader

__all__ = ["RemoteLoader"]

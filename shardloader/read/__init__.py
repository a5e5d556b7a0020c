"""Reading: getting a shard here and reading a pass of samples out of it.

* :mod:`~shardloader.read.shardset`: a pass's shards (:class:`ShardSet`): opened, their
  samples read by global id shard by shard, and its working set;
* :mod:`~shardloader.read.staging`: those shards as local files, in place or staged through
  the node cache, ahead in the background;
* :mod:`~shardloader.read.indexes`: their sample indexes, fetched, checked, kept parsed;
* :mod:`~shardloader.read.sidecar`: a shard's sample index, read as untrusted input;
* :mod:`~shardloader.read.readahead`: the node's read-ahead schedule;
* :mod:`~shardloader.read.samplepass`: one pass of a worker, of samples or of token rows;
* :mod:`~shardloader.read.loading`: read, decode, transform a batch, and the skip rule;
* :mod:`~shardloader.read.fields`: field aliases (several extensions, one field);
* :mod:`~shardloader.read.mixed`: a mixture's virtual shards, reads routed to each source;
* :mod:`~shardloader.read.lengths`: every sample's length, from the sidecars only;
* :mod:`~shardloader.read.verify` / :mod:`~shardloader.read.summary`: ``verify`` and
  ``inspect``.

Bytes come through :mod:`shardloader.storage`, shard layouts through :mod:`shardloader.format`.
"""

from shardloader._lazy import on_demand

__all__: list[str] = []  # its modules are the API: import them

__getattr__ = on_demand(__name__, globals())

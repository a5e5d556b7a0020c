"""Parquet files adopted in place by ``shardloader index``: a shard is one file, read by row
group (see format.py)."""

__all__: list[str] = []  # the modules: format (registered), table, scan, reader

"""Parquet files adopted in place by ``shardloader index``: a shard is one file, read by row
group (see format.py)."""

"""Delivery: the hand-over from DataLoader workers to the training loop, and the loader's state.

* :mod:`~shardloader.deliver.loader`: :func:`make_loader`, a torch DataLoader with a resumable
  state;
* :mod:`~shardloader.deliver.position`: epoch, position, world and partitions a dataset shares
  with its workers through shared values, and each worker's own state;
* :mod:`~shardloader.deliver.loaderstate`: the loader state, written and checked;
* :mod:`~shardloader.deliver.transport` / :mod:`~shardloader.deliver.slotcollate`: batches
  handed over as shared buffers;
* :mod:`~shardloader.deliver.workers`: how workers start, and what each does first;
* :mod:`~shardloader.deliver.monitor`: ``monitor(loader)``, is the loop waiting for data?
"""

from shardloader._lazy import on_demand

__all__: list[str] = []  # its modules are the API: import them

__getattr__ = on_demand(__name__, globals())

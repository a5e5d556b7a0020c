"""``python -m serve_start_method serve ...``: ``shardloader serve`` whose DataLoader workers
start by ``$SERVE_START_METHOD`` (tests/test_start_methods.py), as they would by default on
Python 3.14 (forkserver)."""

import multiprocessing
import os

from shardloader.cli import main

if __name__ == "__main__":
    multiprocessing.set_start_method(os.environ["SERVE_START_METHOD"])
    main()

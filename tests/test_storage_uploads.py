"""Background uploads (storage/uploads.py): they overlap the caller's work, and a failure is
raised before the caller would commit (NOTE [background uploads])."""

from __future__ import annotations

import threading
import time

import pytest

from shardloader.errors import StorageError
from shardloader.storage.uploads import Uploads


def test_uploads_run_beside_the_caller_and_wait_collects_them() -> None:
    done: list[int] = []
    gate = threading.Event()
    uploads = Uploads(concurrency=2, backlog=2)
    try:
        for i in range(3):
            uploads.submit(lambda i=i: (gate.wait(5), done.append(i)))
        assert done == []  # submit returned while the uploads wait: the caller goes on
        gate.set()
        uploads.wait()
        assert sorted(done) == [0, 1, 2]
    finally:
        uploads.close()


def test_a_failed_upload_is_raised_and_nothing_new_starts() -> None:
    started: list[int] = []

    def fail() -> None:
        started.append(0)
        raise StorageError("cannot upload 's3://b/shard-00000.tar.zst': gave up")

    uploads = Uploads(concurrency=1, backlog=4)
    try:
        uploads.submit(fail)
        deadline = time.monotonic() + 5
        with pytest.raises(StorageError, match="shard-00000"):
            while time.monotonic() < deadline:  # the next submit (or wait) reports it
                uploads.submit(lambda: started.append(1))
                time.sleep(0.01)
        with pytest.raises(StorageError, match="shard-00000"):
            uploads.wait()
        assert started[0] == 0 and started.count(0) == 1
    finally:
        uploads.close()


def test_submit_blocks_past_the_backlog_and_close_waits_for_running_uploads() -> None:
    gate = threading.Event()
    finished: list[int] = []
    uploads = Uploads(concurrency=1, backlog=1)
    uploads.submit(lambda: (gate.wait(5), finished.append(0)))
    uploads.submit(lambda: finished.append(1))
    third = threading.Thread(target=uploads.submit, args=(lambda: finished.append(2),))
    third.start()
    third.join(0.2)
    assert third.is_alive()  # one running + one waiting: the third waits for room
    gate.set()
    third.join(5)
    uploads.wait()
    uploads.close()
    assert finished == [0, 1, 2]

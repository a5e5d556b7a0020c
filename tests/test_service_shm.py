"""The same-host handover (NOTE [shm handover], NOTE [forwarded slots]): through shared memory a
RemoteLoader gets the local loader's batches byte for byte (token blocks from the workers'
ring, RawCollate batches, plain dicts), a client on "another host" (it cannot see the server's
shared-memory folder) or one that asks for TCP gets them over the socket, a client that holds
every batch makes the server fall back instead of overwriting, and neither a client killed
with SIGKILL nor one that never attached leaves a segment behind."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from corpus import docs, packed_docs
from helpers import write_dataset
from test_service_support import UNEVEN, InProcessServer, canonical, parse_metrics

import shardloader as sl
from shardloader import transport
from shardloader.batching.blocks import TokenBlocks
from shardloader.service import RemoteLoader
from shardloader.service.shm import leftover_segments
from shardloader.service.wireframes import read_frame

SEQ, ROWS = 16, 3


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    texts = docs(120, seed=3, mean=2.5, sigma=1.2, longest=200)
    return packed_docs(str(root), texts, format="tokens", max_samples=30)


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uneven"))
    write_dataset(out, UNEVEN)
    return out


@pytest.fixture
def small_bundles(monkeypatch):
    """Bundles of two token batches, so an epoch has many (the server forks its workers,
    which inherit this)."""
    monkeypatch.setattr(transport, "BUNDLE_BYTES", 2 * TokenBlocks(SEQ, ROWS, 0).batch_bytes)


def token_dataset(path):
    return sl.ShardedDataset(path, planner=TokenBlocks(SEQ, ROWS, pad_id=0), shuffle=True, seed=4)


def raw_dataset(path):
    return sl.ShardedDataset(
        path, batch_size=8, shuffle=True, seed=2, decoder=None, collate_fn=sl.RawCollate()
    )


def plain_dataset(path):
    return sl.ShardedDataset(path, batch_size=8, shuffle=True, seed=2)


def local(ds, epoch):
    ds.set_epoch(epoch)
    return [canonical(b) for b in sl.make_loader(ds, num_workers=0)]


def remote(url, epoch, shm_dir, **kw):
    loader = RemoteLoader(url, 0, 1, **kw)
    loader.shm_dir = shm_dir
    loader.set_epoch(epoch)
    return loader, [canonical(b) for b in loader]


@pytest.mark.parametrize("make", [token_dataset, raw_dataset, plain_dataset])
def test_shared_memory_gives_the_local_batches(make, tokens, samples, shm_dir, small_bundles):
    ds = make(tokens if make is token_dataset else samples)
    want = local(ds, 1)
    with InProcessServer(ds, workers=2, shm_dir=shm_dir) as srv:
        for run in range(2):  # the second stream's workers know the batches' size
            loader, got = remote(srv.url, 1, shm_dir)
            assert got == want
            # the first ones may go before the client mapped the segment (a busy machine)
            assert loader.shm_batches >= 1
            assert loader.shm_batches + loader.tcp_batches == len(want)
            metrics = _wait_idle(srv)
            assert metrics["shardloader_shm_frames_total"] >= 1
            if make is token_dataset:  # whole bundles came through the workers' ring
                assert metrics["shardloader_shm_forwarded_total"] >= 1
            elif run:  # the workers encoded batches into the client's memory themselves
                assert metrics["shardloader_shm_worker_frames_total"] >= 1
    assert leftover_segments(shm_dir) == []


@pytest.mark.parametrize("make", [token_dataset, raw_dataset])
def test_another_host_or_tcp_gets_the_same_batches_over_the_socket(
    make, tokens, samples, shm_dir, tmp_path, small_bundles
):
    ds = make(tokens if make is token_dataset else samples)
    want = local(ds, 2)
    elsewhere = tmp_path / "elsewhere"  # the client's /dev/shm: the server's names are not there
    elsewhere.mkdir()
    with InProcessServer(ds, workers=2, shm_dir=shm_dir) as srv:
        for kw, folder in (({}, str(elsewhere)), ({"transport": "tcp"}, shm_dir)):
            loader, got = remote(srv.url, 2, folder, **kw)
            assert got == want
            assert loader.shm_batches == 0 and loader.tcp_batches == len(want)
        metrics = _wait_idle(srv)
        assert metrics["shardloader_shm_frames_total"] == 0
    assert leftover_segments(shm_dir) == []  # the unattached segment went when its stream did


def test_a_server_without_shared_memory_sends_over_tcp(samples, shm_dir):
    ds = raw_dataset(samples)
    want = local(ds, 0)
    with InProcessServer(ds, workers=0, shm_dir=None) as srv:
        loader, got = remote(srv.url, 0, shm_dir)
    assert got == want and loader.shm_batches == 0


def test_a_client_that_keeps_every_batch_never_sees_them_overwritten(
    tokens, samples, shm_dir, small_bundles
):
    """list(loader) holds every slot: the server must fall back (TCP, fresh worker memory)
    rather than reuse a slot whose batch the client still has."""
    for ds in (token_dataset(tokens), raw_dataset(samples)):
        ds.set_epoch(3)
        want = list(sl.make_loader(ds, num_workers=0))
        # one batch per frame: the 25 raw batches need more than the segment's 7 slots
        with InProcessServer(ds, workers=2, shm_dir=shm_dir, max_inflight=1) as srv:
            loader = RemoteLoader(srv.url, 0, 1)
            loader.shm_dir = shm_dir
            loader.set_epoch(3)
            got = list(loader)  # every batch kept alive until the end
            assert [canonical(b) for b in got] == [canonical(b) for b in want]
            metrics = _wait_idle(srv)
            if ds.planner is None:
                assert loader.tcp_batches > 1  # some had to come over the socket
                assert metrics["shardloader_shm_fallbacks_total"] >= 1
        assert leftover_segments(shm_dir) == []


_CLIENT = """
import sys, time
from shardloader.service import RemoteLoader
loader = RemoteLoader(sys.argv[1], 0, 1, prefetch=1)
loader.shm_dir = sys.argv[2]
for i, batch in enumerate(loader):
    print("step", i, loader.shm_batches, flush=True)
    time.sleep(0.05)
"""


def test_a_killed_client_leaves_no_segment(tokens, shm_dir, small_bundles):
    ds = token_dataset(tokens)
    with InProcessServer(ds, workers=2, shm_dir=shm_dir) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, srv.url, shm_dir],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            lines = [proc.stdout.readline() for _ in range(6)]  # type: ignore[union-attr]
            assert int(lines[-1].split()[2]) > 0  # it reads through shared memory
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
            proc.wait(30)
            proc.stdout.close()  # type: ignore[union-attr]
        metrics = _wait_idle(srv)
        assert (
            metrics["shardloader_shm_forwarded_total"] + metrics["shardloader_shm_frames_total"]
            >= 1
        )
    assert leftover_segments(shm_dir) == []


def test_a_client_that_never_attaches_leaves_no_segment(samples, shm_dir):
    ds = raw_dataset(samples)
    with InProcessServer(ds, workers=0, shm_dir=shm_dir) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", "/v1/batches?epoch=0&rank=0&world_size=1&shm=1")
        resp = conn.getresponse()
        assert resp.status == 200
        frame = read_frame(resp.readinto)
        assert frame is not None and frame.kind == "shm"
        assert leftover_segments(shm_dir) == [frame.header["name"]]  # waiting for the client
        conn.close()  # gone without mapping it
        _wait_idle(srv)
    assert leftover_segments(shm_dir) == []


@pytest.mark.parametrize("value", ["2", "yes", ""])
def test_a_bad_shm_parameter_is_a_400(samples, value):
    ds = raw_dataset(samples)
    with InProcessServer(ds, workers=0) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", f"/v1/batches?epoch=0&rank=0&world_size=1&shm={value}")
        resp = conn.getresponse()
        assert resp.status == 400 and b"shm" in resp.read()
        conn.close()


def test_transport_is_checked():
    with pytest.raises(sl.UsageError, match="transport"):
        RemoteLoader("http://127.0.0.1:1", 0, 1, transport="udp")


def _wait_idle(srv) -> dict[str, float]:
    """The server's metrics once no stream runs (a stream's shm counters land as it ends)."""
    service = srv.app.state.service
    deadline = time.monotonic() + 30
    while True:
        metrics = parse_metrics(service.metrics.render())
        if not metrics["shardloader_streams_active"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for thread in threading.enumerate():  # producers add their shm counters as they end
        if thread.name.startswith("shardloader-stream-"):
            thread.join(30)
    return parse_metrics(service.metrics.render())


def test_slots_come_back_only_once_the_client_dropped_their_batches(shm_dir):
    """Segment and Attachment in one process: what each side may do with a slot."""
    import gc

    import torch

    from shardloader.errors import DecodeError
    from shardloader.service.shm import Attachment, Segment

    seg = Segment(shm_dir, 2, 4096)
    try:
        assert seg.place(10) is None  # nobody attached: TCP
        with pytest.raises(DecodeError):
            Attachment(shm_dir, {**seg.announce(), "slots": 3})  # sizes that do not add up
        with pytest.raises(FileNotFoundError):
            Attachment(shm_dir, {**seg.announce(), "nonce": "00" * 16})  # someone else's file
        client = Attachment(shm_dir, seg.announce())
        assert seg.attached and leftover_segments(shm_dir) == []  # unlinked once mapped
        slots = []
        for i in range(2):
            slot, buf = seg.place(8)
            buf[:] = i + 1
            slots.append(slot)
        assert seg.place(8) is None and seg.fallbacks == 1  # both in use: wait, then TCP
        held = [torch.from_numpy(client.receive(s, 8)) for s in slots]
        assert [int(t[0]) for t in held] == [1, 2]
        with pytest.raises(DecodeError):
            client.receive(slots[0], 8)  # not sent again: a broken server
        del held[0]
        gc.collect()
        client.collect()
        slot, _ = seg.place(8)
        assert slot == slots[0]  # the dropped one, never the one still held
        assert int(held[0][0]) == 2
    finally:
        seg.close()
    assert leftover_segments(shm_dir) == []


def test_a_raw_column_read_from_shared_memory_holds_its_slot(shm_dir):
    """A RawBatch's column is a view of the slot (no copy): the slot stays the client's until
    the column is gone, even when the rest of the batch is dropped first."""
    import gc

    from shardloader.batching.raw import ByteColumn, RawBatch
    from shardloader.service import wire
    from shardloader.service.shm import Attachment, Segment

    seg = Segment(shm_dir, 1, 1 << 16)
    try:
        client = Attachment(shm_dir, seg.announce())
        batch = RawBatch({"__key__": ["a", "b"], "jpg": ByteColumn.of([b"\xff\xd8", b"xyz"])})
        chunks = wire.encode_batches(0, [batch], seg.place)
        (frame,) = list(wire.iter_frames(b"".join(bytes(c) for c in chunks)))
        (got,) = wire.decode_batches(frame, client.receive(*wire.shm_span(frame.header)))
        column = got["jpg"]
        del got, frame
        gc.collect()
        client.collect()
        assert seg.place(8) is None  # still held by the column: TCP instead
        assert column.tolist() == [b"\xff\xd8", b"xyz"] and type(column[1]) is bytes
        del column
        gc.collect()
        client.collect()
        assert seg.place(8) is not None
    finally:
        seg.close()

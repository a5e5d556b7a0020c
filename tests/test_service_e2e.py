"""A real ``shardloader serve DATA --token-file ...`` process and real clients: the batches of
a local loader, byte for byte; auth on every request; malformed requests answered 4xx."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import threading
import time

import pytest
import torch
from test_service_support import (
    PATH_OPTIONS,
    canonical,
    dataset_env,
    digest,
    finish_client,
    get,
    ids_and_pads,
    local_batches,
    parse_metrics,
    path_pipeline,
    start_client,
    start_servers,
)

import shardloader as sl
from shardloader.service import RemoteLoader

pytestmark = pytest.mark.subprocess  # a `shardloader serve` process for the module

TOKEN = "s3cret-token-for-the-tests-0123456789"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with dataset_env(tmp_path_factory, "zstd") as env:
        yield env


@pytest.fixture(scope="module")
def server(env, tmp_path_factory):
    """The path pipeline with a token, on 127.0.0.1, 2 DataLoader workers per stream."""
    work = tmp_path_factory.mktemp("srv")
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)  # a token others may read is refused
    (srv,) = start_servers(
        [
            [
                env["SERVICE_TEST_DATA"],
                *PATH_OPTIONS,
                "--workers",
                "2",
                "--cache-dir",
                env["SERVICE_TEST_CACHE"],
                "--token-file",
                str(token_file),
            ]
        ],
        str(work),
        env,
    )
    yield srv
    srv.stop()


def remote(server, rank=0, world=1, ranks_per_node=None, **kw):
    return RemoteLoader(server.url, world=sl.World(rank, world, ranks_per_node), token=TOKEN, **kw)


def test_remote_loader_takes_its_place_as_a_world_or_spelled_out_not_both():
    """Old main: RemoteLoader took rank=/world_size=/data_parallel= only (TypeError on world=),
    and worked its place out with a copy of the dataset's code."""
    url = "http://127.0.0.1:9"  # nothing is asked of a server before the first pass
    loader = RemoteLoader(url, world=sl.World(1, 3))
    assert (loader.rank, loader.world_size) == (1, 3)
    with pytest.warns(DeprecationWarning, match=r"pass world=shardloader.World\(rank=\.\.\., "):
        old = RemoteLoader(url, 2, 3)
    assert (old.rank, old.world_size) == (2, 3)
    with pytest.raises(sl.UsageError, match="pass world= or ranks_per_node=, not both"):
        RemoteLoader(url, ranks_per_node=1, world=sl.World(0, 1))
    with pytest.raises(sl.UsageError, match="rank 3 is outside world_size 3"):
        RemoteLoader(url, world=sl.World(3, 3))


# -- the same batches -----------------------------------------------------------------------------


@pytest.mark.parametrize("epoch", [0, 3])
def test_remote_equals_local_byte_for_byte(server, epoch):
    """World 3 over 200 samples in 25 batches: ranks 1 and 2 end on a padding batch."""
    for rank in range(3):
        local = local_batches(path_pipeline, rank, 3, epoch)
        loader = remote(server, rank, 3)
        loader.set_epoch(epoch)
        assert len(loader) == len(local) == 9
        got = list(loader)
        assert len(got) == len(local)
        for a, b in zip(local, got, strict=True):
            assert a.keys() == b.keys()
            for key, value in a.items():
                if isinstance(value, torch.Tensor):
                    assert b[key].dtype == value.dtype and b[key].shape == value.shape
                    assert torch.equal(value, b[key])
                else:
                    assert type(b[key]) is type(value) and b[key] == value  # lists of str/bytes
            assert canonical(a) == canonical(b)
        assert any(p for b in got for p in b["__pad__"].tolist()) == (rank > 0)


@pytest.mark.slow
def test_two_rank_processes_get_disjoint_complete_equal_shares(server, env, tmp_path):
    """Two real client processes at once, as two ranks of one job."""
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    procs = [
        start_client(
            [
                server.url,
                "--rank",
                str(r),
                "--world",
                "2",
                "--epoch",
                "2",
                "--token",
                TOKEN,
                "--out",
                outs[r],
            ],
            env,
        )
        for r in range(2)
    ]
    got = [finish_client(p, o) for p, o in zip(procs, outs, strict=True)]
    assert len(got[0]["ids"]) == len(got[1]["ids"]) == got[0]["steps"] == 13
    real = [
        {
            i
            for ids, pads in zip(g["ids"], g["pads"], strict=True)
            for i, p in zip(ids, pads, strict=True)
            if not p
        }
        for g in got
    ]
    assert not real[0] & real[1]
    assert real[0] | real[1] == set(range(200))
    ref_state = sl.make_loader(path_pipeline()).state_dict()
    for r in range(2):
        assert got[r]["digests"] == [digest(b) for b in local_batches(path_pipeline, r, 2, 2)]
        assert got[r]["state"] == {**ref_state, "epoch": 3, "position": 0}  # epoch 2 is done


def test_state_moves_between_remote_and_local(server):
    """Stop a remote run after 4 steps and continue locally; and the other way round.

    Rank 0 of 3 has no padding step, so the continued run equals the uninterrupted one; a
    resumed pass re-plans its padding (as the local loader does), so for rank 2 the reference
    is the local loader resumed at the same state.
    """
    full = local_batches(path_pipeline, 0, 3, 5)
    loader = remote(server, 0, 3)
    loader.set_epoch(5)
    head = []
    for batch in loader:
        head.append(batch)
        if len(head) == 4:
            break
    state = loader.state_dict()
    assert state["position"] == 4 * 3 and state["epoch"] == 5
    local = sl.make_loader(path_pipeline().for_rank(0, 3))
    local.load_state_dict(state)
    assert [digest(b) for b in head + list(local)] == [digest(b) for b in full]

    ref_state = {**sl.make_loader(path_pipeline()).state_dict(), "epoch": 5, "position": 6}
    expected = [digest(b) for b in local_batches(path_pipeline, 2, 3, 5, position=6)]
    again = remote(server, 2, 3)
    again.load_state_dict(ref_state)
    assert len(again) == len(expected) == 7
    assert [digest(b) for b in again] == expected
    # the pass ended: the state continues with the next epoch, as the local loader's does
    assert {k: again.state_dict()[k] for k in ("epoch", "position")} == {"epoch": 6, "position": 0}
    local_again = sl.make_loader(path_pipeline().for_rank(2, 3))
    local_again.load_state_dict(ref_state)
    list(local_again)
    assert again.state_dict() == local_again.state_dict()


def test_node_partitions_are_the_clients_and_states_carry_them(server):
    """Ranks of 2 nodes x 2: the server plans the partitions from the ranks per node the client
    sends, batch for batch what the client's local loader reads; the state says so, and a
    state counted in other partitions is refused with the way out."""
    ids = []
    for rank in range(4):
        local = sl.make_loader(path_pipeline().for_rank(rank, 4, ranks_per_node=2))
        local.dataset.set_epoch(1)
        want = [digest(b) for b in local]
        loader = remote(server, rank, 4, ranks_per_node=2)
        loader.set_epoch(1)
        got = list(loader)
        assert [digest(b) for b in got] == want
        ids += [i for b in got for i, p in zip(b["__index__"], b["__pad__"], strict=True) if not p]
    assert sorted(int(i) for i in ids) == list(range(200))
    loader = remote(server, 0, 4, ranks_per_node=2)
    loader.set_epoch(1)
    next(iter(loader))
    state = loader.state_dict()
    assert state["partitions"] == 2 and state["version"] == 3
    flat = remote(server, 0, 4)  # no ranks per node: one partition
    with pytest.raises(sl.ShardloaderError, match="counted in '2' partitions.*local loader"):
        flat.load_state_dict(state)
        len(flat)


def test_set_epoch_reshuffles_and_rerun_repeats(server):
    loader = remote(server)
    first = [ids_and_pads(b)[0] for b in loader]
    assert [ids_and_pads(b)[0] for b in loader] == first
    loader.set_epoch(1)
    second = [ids_and_pads(b)[0] for b in loader]
    assert second != first and sorted(sum(second, [])) == sorted(sum(first, []))


def test_mismatched_expectations_are_refused(server):
    with pytest.raises(sl.ResumeError, match="seed"):
        list(remote(server, seed=8))
    loader = remote(server)
    with pytest.raises(sl.ResumeError, match="fingerprint"):
        loader.load_state_dict({**loader.state_dict(), "fingerprint": "0" * 16})


# -- health and metrics ---------------------------------------------------------------------------


def test_health_and_metrics(server):
    status, body, _ = get(f"{server.url}/health")  # open: load balancers probe it
    assert status == 200 and json.loads(body)["status"] == "ok"
    before = server.metrics(TOKEN)
    batches = list(remote(server, 0, 2))
    status, body, headers = get(f"{server.url}/metrics", TOKEN)
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    after = parse_metrics(body.decode())
    served = "shardloader_batches_served_total"
    assert after[served] - before[served] == len(batches) == 13
    assert after["shardloader_bytes_served_total"] > before["shardloader_bytes_served_total"]
    assert 0.0 <= after["shardloader_pipeline_busy_share"] <= 1.0
    for name in (
        "client_lag_batches",
        "client_next_step",
        "pipeline_busy_seconds_total",
        "streams_active",
        "requests_rejected_total",
        "client_pipeline_busy_share",
    ):
        assert f"# TYPE shardloader_{name} " in body.decode()


def test_open_stream_is_listed_with_its_rank(server):
    it = iter(remote(server, 1, 2, prefetch=1))
    next(it)
    text = get(f"{server.url}/metrics", TOKEN)[1].decode()
    it.close()
    lines = [line for line in text.splitlines() if line.startswith("shardloader_client_lag")]
    assert lines and 'rank="1"' in lines[0] and 'world_size="2"' in lines[0]


def test_a_remote_loader_pickles_and_the_copy_reads(server):
    """It holds no connection (its HTTP client is the process's): a copy sent to another
    process, pickled, reads the same batches."""
    copy = pickle.loads(pickle.dumps(remote(server, 0, 2)))
    a, b = iter(remote(server, 0, 2)), iter(copy)
    assert canonical(next(b)) == canonical(next(a))
    a.close()
    b.close()


def test_closing_a_pass_midway_ends_its_reader_at_once(server):
    """The server goes silent (SIGSTOP) with the reader blocked on its socket: the loop's
    close() aborts that socket, so the reader ends at once, not after the read timeout."""
    it = iter(remote(server, 3, 4, prefetch=1000))
    next(it)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.0)  # the reader takes what the buffers hold, then waits on the socket
        t0 = time.monotonic()
        it.close()
        took = time.monotonic() - t0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert took < 5
    assert not [t for t in threading.enumerate() if t.name == "shardloader-remote-rank3"]


# -- auth -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/metrics", "/v1/info", "/v1/batches?epoch=0&rank=0&world_size=1"]
)
@pytest.mark.parametrize("token", [None, "wrong-token-wrong-token-wrong", TOKEN + "x", ""])
def test_requests_without_the_token_are_rejected(server, path, token):
    status, body, headers = get(server.url + path, token)
    assert status == 401 and "token" in json.loads(body)["error"]
    assert headers["www-authenticate"].startswith("Bearer")


def test_remote_loader_with_a_wrong_token_fails_at_once(server):
    with pytest.raises(sl.StorageError, match="401.*token"):
        list(RemoteLoader(server.url, token="not-the-token-at-all-0000"))


# -- malformed requests ---------------------------------------------------------------------------

BAD = [
    ("/v1/batches", 400, "missing parameter"),
    ("/v1/batches?epoch=x&rank=0&world_size=1", 400, "not an integer"),
    ("/v1/batches?epoch=1.5&rank=0&world_size=1", 400, "not an integer"),
    ("/v1/batches?epoch=-1&rank=0&world_size=1", 400, "outside"),
    (f"/v1/batches?epoch={10**30}&rank=0&world_size=1", 400, "outside"),
    ("/v1/batches?epoch=0&rank=2&world_size=2", 400, "rank 2 is outside world_size 2"),
    ("/v1/batches?epoch=0&rank=0&world_size=0", 400, "outside"),
    ("/v1/batches?epoch=0&rank=0&world_size=1&start=99", 400, "past the 25 steps"),
    ("/v1/batches?epoch=0&rank=0&world_size=1&position=26", 400, "outside the epoch"),
    ("/v1/batches?epoch=0&epoch=1&rank=0&world_size=1", 400, "more than once"),
    ("/v1/batches?epoch=0&rank=0&world_size=1&batch_size=3", 400, "unknown parameter"),
    ("/v1/batches?epoch=0&rank=0&world_size=1&seed=8", 409, "seed"),
    ("/v1/info?fingerprint=abc", 409, "fingerprint"),
    ("/v2/batches", 404, "no such endpoint"),
]


@pytest.mark.parametrize(("path", "status", "message"), BAD)
def test_malformed_requests_get_a_clear_4xx(server, path, status, message):
    got, body, headers = get(server.url + path, TOKEN)
    assert got == status and headers["content-type"] == "application/json"
    error = json.loads(body)
    assert error["status"] == status and message in error["error"]


def test_wrong_method_and_garbage_then_the_server_still_serves(server):
    for method in ("POST", "HEAD", "DELETE"):
        got, body, _ = get(f"{server.url}/v1/batches?epoch=0&rank=0&world_size=1", TOKEN, method)
        assert got == 405 and (method == "HEAD" or json.loads(body)["status"] == 405)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"\x16\x03\x01\x02\x00garbage that is not HTTP\r\n\r\n")
        reply = s.recv(4096)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            b"GET /v1/batches?epoch=0&rank=0&world_size=1 HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
        )
        s.recv(100)  # a stream started; the client vanishes mid-stream
    assert [digest(b) for b in remote(server)] == [
        digest(b) for b in local_batches(path_pipeline, 0, 1, 0)
    ]
    assert get(f"{server.url}/health")[0] == 200

"""What a stream's producer thread hands the event loop (NOTE [frame hand-off]): at most
``max_inflight`` batches' permits out at once, the response woken only when it sleeps, and the
client's progress counted as frames are written; the response reads nothing of the stream but
this hand-off, and the producer is small steps, not one long method."""

from __future__ import annotations

import ast
import asyncio
import inspect
import threading
import time

from shardloader.service import response, stream
from shardloader.service.frames import frame_size
from shardloader.service.handoff import Frame, Handoff
from shardloader.service.metrics import Metrics


def test_permits_bound_the_frames_until_they_are_written():
    loop = asyncio.new_event_loop()
    try:
        metrics = Metrics()
        handoff = Handoff(loop, metrics, max_inflight=3, ping_interval=1.0, start=5)
        go_on = threading.Event()
        frame = Frame([b"header", b"payload"], False, 3)
        assert handoff.put(frame, go_on) and handoff.lag == 3
        stop = threading.Timer(0.3, go_on.set)
        began = time.monotonic()
        stop.start()
        # every permit is out: only the stop ends the wait
        assert not handoff.put(Frame([b"more"], False, 1), go_on)
        stop.join()
        assert time.monotonic() - began >= 0.25
        handoff.written(handoff.pending.popleft())
        assert (handoff.sent, handoff.next_step, handoff.lag) == (3, 8, 0)
        assert (metrics.batches, metrics.bytes) == (3, frame_size(frame.chunks))
        assert handoff.put(Frame([b"next"], False, 3), threading.Event())  # all three came back
        handoff.written(handoff.pending.popleft())
        end = Frame([b"end"], True, 0)
        handoff.written(end)  # the last frame: no batches, the step stays
        assert (handoff.sent, handoff.next_step, metrics.batches) == (6, 11, 6)
    finally:
        loop.close()


def test_the_response_is_woken_only_while_it_sleeps():
    loop = asyncio.new_event_loop()
    try:
        handoff = Handoff(loop, Metrics(), max_inflight=2, ping_interval=1.0, start=0)
        wake = handoff.wake = asyncio.Event()
        assert handoff.put(Frame([b"a"], False, 1), threading.Event())  # awake: no loop call
        loop.run_until_complete(asyncio.sleep(0.05))
        assert not wake.is_set()
        handoff.waiting = True
        pusher = threading.Thread(
            target=handoff.put, args=(Frame([b"b"], False, 1), threading.Event())
        )
        pusher.start()
        loop.run_until_complete(asyncio.wait_for(wake.wait(), 10))  # woken from the thread
        pusher.join()
        assert [f.chunks for f in handoff.pending] == [[b"a"], [b"b"]]
    finally:
        loop.close()


def test_the_response_reads_only_the_handoff_and_the_producer_is_small_steps():
    tree = ast.parse(inspect.getsource(response))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "shardloader.service.stream" not in imported
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "stream" not in names and "handoff" in names
    methods = {
        n.name: n.end_lineno - n.lineno + 1  # type: ignore[operator]
        for n in ast.walk(ast.parse(inspect.getsource(stream.Stream)))
        if isinstance(n, ast.FunctionDef)
    }
    assert {"_produce", "_read_pass", "_drain", "_batches"} <= set(methods)
    assert max(methods.values()) <= 40, methods  # _produce was one 120-line method

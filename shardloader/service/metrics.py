"""The service's counters and their Prometheus text (``GET /metrics``)."""

from __future__ import annotations

import threading
from typing import Any, Protocol

__all__ = ["Metrics", "StreamStats"]


class StreamStats(Protocol):
    """What ``/metrics`` reads of an open stream (:class:`shardloader.service.stream.Stream`)."""

    @property
    def sent(self) -> int: ...

    @property
    def next_step(self) -> int: ...

    @property
    def lag(self) -> int: ...

    def labels(self) -> dict[str, Any]: ...

    def times(self) -> tuple[float, float]: ...

    def busy_share(self) -> float: ...


class Metrics:
    """Counters for ``/metrics``; producer threads and the event loop both write (under
    ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches = 0
        self.bytes = 0
        self.frame_hint = 0  # the largest one-batch payload a stream began with (bytes)
        self.streams = 0
        self.streams_done = 0
        self.rejected: dict[str, int] = {}
        self.pipeline_errors = 0
        self.busy_seconds = 0.0  # producers waiting on the pipeline for a batch
        self.idle_seconds = 0.0  # producers blocked because their client had not taken batches
        self.active: dict[int, StreamStats] = {}
        # connections aborted by NOTE [connection rules], by reason (the event loop writes)
        self.connections_closed: dict[str, int] = {}

    def reject(self, status: int) -> None:
        with self.lock:
            self.rejected[str(status)] = self.rejected.get(str(status), 0) + 1

    def render(self) -> str:
        out: list[str] = []

        def metric(
            name: str, kind: str, help_: str, rows: list[tuple[dict[str, Any], float]]
        ) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in rows:
                text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                labelled = f"{name}{{{text}}}" if text else name
                out.append(f"{labelled} {_number(value)}")

        with self.lock:
            streams = list(self.active.values())
            busy, idle = self.busy_seconds, self.idle_seconds
            for s in streams:
                b, i = s.times()
                busy, idle = busy + b, idle + i
            metric(
                "shardloader_batches_served_total",
                "counter",
                "Batches sent to clients.",
                [({}, self.batches)],
            )
            metric(
                "shardloader_bytes_served_total",
                "counter",
                "Frame bytes sent to clients.",
                [({}, self.bytes)],
            )
            metric(
                "shardloader_streams_total",
                "counter",
                "Batch streams accepted.",
                [({}, self.streams)],
            )
            metric(
                "shardloader_streams_active",
                "gauge",
                "Batch streams open now.",
                [({}, len(streams))],
            )
            metric(
                "shardloader_requests_rejected_total",
                "counter",
                "Requests answered with an error status.",
                [({"status": k}, v) for k, v in sorted(self.rejected.items())],
            )
            metric(
                "shardloader_connections_closed_total",
                "counter",
                "Connections the server aborted: no request head in time (header_timeout, "
                "idle_timeout), pushed out by newer ones waiting (evicted), or a client that "
                "took nothing of a response (write_timeout).",
                [({"reason": k}, v) for k, v in sorted(self.connections_closed.items())],
            )
            metric(
                "shardloader_pipeline_errors_total",
                "counter",
                "Streams ended by an error in the pipeline.",
                [({}, self.pipeline_errors)],
            )
            metric(
                "shardloader_pipeline_busy_seconds_total",
                "counter",
                "Producer time spent waiting for the pipeline to finish a batch.",
                [({}, busy)],
            )
            metric(
                "shardloader_pipeline_busy_share",
                "gauge",
                "Share of producer time the pipeline was the bottleneck (1: clients wait on "
                "the pipeline; 0: the pipeline waits on clients).",
                [({}, busy / (busy + idle) if busy + idle > 0 else 0.0)],
            )
            rows = [(s.labels(), s) for s in streams]
            metric(
                "shardloader_client_lag_batches",
                "gauge",
                "Batches ready on the server that the client has not taken yet.",
                [(lab, s.lag) for lab, s in rows],
            )
            metric(
                "shardloader_client_next_step",
                "gauge",
                "Next step the stream will send.",
                [(lab, s.next_step) for lab, s in rows],
            )
            metric(
                "shardloader_client_batches_total",
                "counter",
                "Batches sent on this stream.",
                [(lab, s.sent) for lab, s in rows],
            )
            metric(
                "shardloader_client_blocked_seconds_total",
                "counter",
                "Producer time blocked because this client did not take batches.",
                [(lab, s.times()[1]) for lab, s in rows],
            )
            metric(
                "shardloader_client_pipeline_busy_share",
                "gauge",
                "Share of this stream's producer time spent waiting for the pipeline.",
                [(lab, s.busy_share()) for lab, s in rows],
            )
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"

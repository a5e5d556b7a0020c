"""The service's counters and their Prometheus text (``GET /metrics``)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardloader.service.stream import Stream

__all__ = ["Metrics"]

# name (after "shardloader_") -> (kind, help)
_HELP = {
    "batches_served_total": ("counter", "Batches sent to clients."),
    "bytes_served_total": ("counter", "Frame bytes sent to clients."),
    "streams_total": ("counter", "Batch streams accepted."),
    "streams_active": ("gauge", "Batch streams open now."),
    "requests_rejected_total": ("counter", "Requests answered with an error status."),
    "connections_closed_total": (
        "counter",
        "Connections the server aborted: no request head in time (header_timeout, idle_timeout), "
        "pushed out by newer ones waiting (evicted), or a client that took nothing of a "
        "response (write_timeout).",
    ),
    "pipeline_errors_total": ("counter", "Streams ended by an error in the pipeline."),
    "pipeline_busy_seconds_total": (
        "counter",
        "Producer time spent waiting for the pipeline to finish a batch.",
    ),
    "pipeline_busy_share": (
        "gauge",
        "Share of producer time the pipeline was the bottleneck (1: clients wait on the "
        "pipeline; 0: the pipeline waits on clients).",
    ),
    "client_lag_batches": (
        "gauge",
        "Batches ready on the server that the client has not taken yet.",
    ),
    "client_next_step": ("gauge", "Next step the stream will send."),
    "client_batches_total": ("counter", "Batches sent on this stream."),
    "client_blocked_seconds_total": (
        "counter",
        "Producer time blocked because this client did not take batches.",
    ),
    "client_pipeline_busy_share": (
        "gauge",
        "Share of this stream's producer time spent waiting for the pipeline.",
    ),
}


class Metrics:
    """Counters for ``/metrics``; producer threads and the event loop both write (under
    ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches = 0
        self.bytes = 0
        self.streams = 0
        self.rejected: dict[str, int] = {}
        self.pipeline_errors = 0
        self.busy_seconds = 0.0  # producers waiting on the pipeline for a batch
        self.idle_seconds = 0.0  # producers blocked because their client had not taken batches
        self.active: dict[int, Stream] = {}
        # connections aborted by NOTE [connection rules], by reason (the event loop writes)
        self.connections_closed: dict[str, int] = {}

    def reject(self, status: int) -> None:
        with self.lock:
            self.rejected[str(status)] = self.rejected.get(str(status), 0) + 1

    def render(self) -> str:
        out: list[str] = []

        def metric(name: str, rows: float | list[tuple[dict[str, Any], float]]) -> None:
            kind, help_ = _HELP[name]
            name = f"shardloader_{name}"
            out.extend((f"# HELP {name} {help_}", f"# TYPE {name} {kind}"))
            for labels, value in rows if isinstance(rows, list) else [({}, rows)]:
                text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                labelled = f"{name}{{{text}}}" if text else name
                out.append(f"{labelled} {_number(value)}")

        with self.lock:
            streams = list(self.active.values())
            busy, idle = self.busy_seconds, self.idle_seconds
            for s in streams:
                b, i = s.times()
                busy, idle = busy + b, idle + i
            metric("batches_served_total", self.batches)
            metric("bytes_served_total", self.bytes)
            metric("streams_total", self.streams)
            metric("streams_active", len(streams))
            metric("requests_rejected_total", _labelled("status", self.rejected))
            metric("connections_closed_total", _labelled("reason", self.connections_closed))
            metric("pipeline_errors_total", self.pipeline_errors)
            metric("pipeline_busy_seconds_total", busy)
            metric("pipeline_busy_share", _share(busy, idle))
            rows = [(s.labels(), s) for s in streams]
            metric("client_lag_batches", [(lab, s.handoff.lag) for lab, s in rows])
            metric("client_next_step", [(lab, s.handoff.next_step) for lab, s in rows])
            metric("client_batches_total", [(lab, s.handoff.sent) for lab, s in rows])
            metric("client_blocked_seconds_total", [(lab, s.times()[1]) for lab, s in rows])
            metric("client_pipeline_busy_share", [(lab, _share(*s.times())) for lab, s in rows])
        return "\n".join(out) + "\n"


def _share(busy: float, idle: float) -> float:
    """The share of a producer's time spent waiting on the pipeline (0 before any wait)."""
    return busy / (busy + idle) if busy + idle > 0 else 0.0


def _labelled(label: str, counts: dict[str, int]) -> list[tuple[dict[str, Any], float]]:
    return [({label: k}, v) for k, v in sorted(counts.items())]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"

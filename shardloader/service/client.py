"""``RemoteLoader``: the training loop's end of ``shardloader serve``.

It yields, for its rank, seed and epoch, the batches a local :func:`shardloader.make_loader`
would, byte for byte, and saves/restores the same state.  A background thread keeps up to
``prefetch`` frames (a frame: one batch, or several small consecutive ones) received ahead of
the loop.

Faults and reconnects: NOTE [faults] in :mod:`shardloader.service.passreader`, the thread
that reads a pass.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from shardloader.deliver.loaderstate import STATE_VERSIONS, state_version
from shardloader.errors import ResumeError, UsageError
from shardloader.options import World, from_old_keywords
from shardloader.service.failover import Failover, get_json, service_url
from shardloader.service.frames import PROTOCOL
from shardloader.service.passreader import PassReader
from shardloader.storage.clients import client_for
from shardloader.storage.httpclient import HttpClient, http_client
from shardloader.storage.retry import RetryPolicy
from shardloader.world import resolve_world

__all__ = ["RemoteLoader", "DEFAULT_REMOTE_RETRY"]


_OLD_WORLD = ("rank", "world_size", "ranks_per_node", "data_parallel")  # before world=

# 120 s without a batch before the loop gives up: a replica restarted by systemd or
# Kubernetes (torch imports, a warm-up batch) is back well within it.  Attempts come at most
# 2 s apart, so one that is back is found soon; their count only caps failures faster than
# that, and a 503 with Retry-After is no attempt at all (NOTE [faults]).
DEFAULT_REMOTE_RETRY = RetryPolicy(
    max_attempts=1000,
    initial_backoff=0.1,
    max_backoff=2.0,
    max_total_seconds=120.0,
    connect_timeout=10.0,
    read_timeout=60.0,
)


class RemoteLoader:
    """Batches of one rank from ``shardloader serve`` replicas, as the local loader yields them.

    ``urls``: one or more replicas serving the same pipeline (rank ``r`` starts at
    ``urls[r % len(urls)]`` to spread load).  ``world``: this rank's place, a
    :class:`~shardloader.options.World` as ``ShardedDataset`` takes it (by default the detected
    one; ``World.of(group)`` makes it the data-parallel rank and the number of replicas, so the
    ranks of one replica get the same batches).  ``rank``/``world_size``/``ranks_per_node``/
    ``data_parallel`` are the same place spelled out, as before ``world``: they still work for a
    release, with a DeprecationWarning naming the replacement.
    ``seed``/``fingerprint`` pin what the servers must serve (409 → :class:`ResumeError`
    otherwise); unset, they are learned from the first server. The first server's pipeline
    (decoder, transform, collate and the options that built them) is pinned too: a replica whose
    pipeline differs is refused with a :class:`ResumeError` naming both fingerprints and what
    differs (NOTE [pinned pipeline] in :mod:`shardloader.service.fingerprint`).
    ``retry``: the budget of attempts that deliver no batch, spent by the library's one retry
    loop (:func:`shardloader.storage.retry.call_with_retries`); by default 120 s since the
    last batch.  A replica that stops, is restarted or loses a worker process is a fault,
    not an error: the pass continues on the next replica where the last batch left off.
    ``token``: the bearer token of servers started with ``--token-file``; by default it comes
    from ``$SHARDLOADER_TOKEN``, or the file ``$SHARDLOADER_TOKEN_FILE`` names.
    ``transport``: no longer has an effect (batches always come over TCP; the same-host
    shared-memory road measured no steady gain over a local loader, see the Service page) and
    warns; it goes in a later release.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        rank: int | None = None,
        world_size: int | None = None,
        *,
        ranks_per_node: int | None = None,
        seed: int | None = None,
        fingerprint: str | None = None,
        token: str | None = None,
        retry: RetryPolicy | None = None,
        prefetch: int = 2,
        transport: str | None = None,
        data_parallel: Any = None,
        world: World | None = None,
    ) -> None:
        listed = [urls] if isinstance(urls, str) else list(urls)
        if not listed:
            raise UsageError("RemoteLoader needs at least one service URL")
        self._endpoints = [service_url(u) for u in listed]
        spelled = zip(_OLD_WORLD, (rank, world_size, ranks_per_node, data_parallel), strict=True)
        old = {k: v for k, v in spelled if v is not None}
        resolved = resolve_world(from_old_keywords(world, None, old, "RemoteLoader")[0])
        if prefetch < 1:
            raise UsageError(f"prefetch={prefetch} must be >= 1")
        self._rank, self._world, self._per_node = resolved
        self._expect: dict[str, Any] = {
            "fingerprint": fingerprint,
            "seed": seed,
            "plan": None,
            "partitions": None,  # the server plans them from the ranks per node it is sent
        }
        self.pipeline: str | None = None  # the pinned pipeline's fingerprint
        self.pipeline_spec: dict[str, Any] | None = None  # ... and its description
        self._token = token if token is not None else _token_from_env()
        self.retry = retry or DEFAULT_REMOTE_RETRY
        self.prefetch = prefetch
        if transport is not None:
            if transport not in ("auto", "tcp"):
                raise UsageError(f"transport={transport!r} must be 'auto' or 'tcp'")
            warnings.warn(
                "RemoteLoader(transport=...) has no effect: batches always come over TCP; "
                "drop the argument",
                DeprecationWarning,
                stacklevel=2,
            )
        self._epoch = 0
        self._start = 0  # global batches consumed before the next pass of this epoch
        self._position = 0  # global batches consumed, as the loop has seen them
        self._steps_left: int | None = None  # steps of the current pass not yet handed out
        self.reconnects = 0  # requests made again after a fault (for logs and tests)

    # -- public state ---------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return list(self._endpoints)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch; keeps a loaded resume position for that same epoch."""
        if epoch != self._epoch:
            self._start = self._position = 0
            self._steps_left = None
        self._epoch = int(epoch)

    def __len__(self) -> int:
        """Steps this rank gets in the coming pass of the current epoch."""
        return int(self._info(self._epoch, self._start)["steps"])

    def __repr__(self) -> str:
        return (
            f"RemoteLoader({self.urls!r}, rank={self._rank}, world_size={self._world}, "
            f"epoch={self._epoch})"
        )

    def state_dict(self) -> dict[str, Any]:
        """The local loader's state: enough to continue here or on a local loader (after a
        pass's last step: the next epoch, as ``shardloader.deliver.loader`` explains)."""
        if any(v is None for v in self._expect.values()):  # pin what the servers serve
            self._info(self._epoch, self._start)
        epoch, position = self._epoch, self._position
        if self._steps_left == 0:  # the pass is over: continue with the next epoch
            epoch, position = epoch + 1, 0
        partitions = int(self._expect["partitions"] or 1)
        # the local loader's keys, whatever the progress (NOTE [one state for every rank])
        return {
            "version": state_version((), partitions),
            "epoch": epoch,
            "position": position,
            **self._expect,
            "partitions": partitions,
            "reshapes": [],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run (local or remote); the servers check seed, manifest and plan."""
        version = state.get("version")
        if version not in STATE_VERSIONS or state.get("reshapes"):
            raise ResumeError(
                f"loader state version {version!r} is not one of {STATE_VERSIONS} without "
                "reshapes: a state whose batch shape changed resumes on a local loader "
                "(make_loader)"
            )
        saved = {**state, "partitions": state.get("partitions", 1)}
        for key in ("fingerprint", "seed", "plan", "partitions"):
            mine = self._expect[key]
            if mine is not None and saved.get(key) != mine:
                hint = ": a state counted in other partitions resumes on a local loader"
                raise ResumeError(
                    f"saved {key} {saved.get(key)!r} does not match {mine!r}, which this "
                    f"RemoteLoader reads{hint if key == 'partitions' else ''}"
                )
            self._expect[key] = saved.get(key)
        self._epoch = int(state["epoch"])
        self._start = self._position = int(state["position"])
        self._steps_left = None

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._epoch, self._start
        planned = len(self)  # also pins seed, fingerprint and plan
        self._position, self._steps_left = start, planned
        reader = PassReader(self, epoch, start)
        try:
            for seen, batch in enumerate(reader.batches(), 1):
                self._position += self._world
                self._steps_left = planned - seen
                yield batch
        finally:
            reader.close()
        if self._epoch == epoch:
            self._start = 0  # the epoch is done; a re-run starts it afresh

    # -- requests -------------------------------------------------------------------------
    def _params(self, epoch: int, position: int) -> dict[str, Any]:
        params = {
            "epoch": epoch,
            "rank": self._rank,
            "world_size": self._world,
            "position": position,
            "ranks_per_node": self._per_node,
            **self._expect,
            "pipeline": self.pipeline,
        }
        return {k: v for k, v in params.items() if v is not None}

    @property
    def _http(self) -> HttpClient:
        """This process's HTTP client for the loader's timeouts and token, from the storage
        layer's per-process cache: a pickled or forked loader makes its own."""
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        client: HttpClient = client_for(
            "shardloader-service", {"headers": headers}, self.retry, http_client
        )
        return client

    def _info(self, epoch: int, position: int) -> dict[str, Any]:
        def ask(url: str) -> tuple[str, dict[str, Any]]:
            params = self._params(epoch, position)
            return url, get_json(self._http, f"{url}/v1/info", params, self.pipeline_spec)

        failover = Failover(self)
        try:
            url, info = failover.call(ask, f"read /v1/info (epoch {epoch}) from the service at")
        finally:  # no idle connection outlives the request (nor the loader: streams never pool)
            self._http.close()
        if info.get("protocol") != PROTOCOL:
            raise UsageError(
                f"{url} speaks protocol {info.get('protocol')!r}, this "
                f"client {PROTOCOL}; run matching shardloader versions"
            )
        for key in ("fingerprint", "seed", "plan", "partitions"):
            if self._expect[key] is None:
                self._expect[key] = info[key]
        if self.pipeline is None and isinstance(info.get("pipeline"), str):
            self.pipeline, self.pipeline_spec = info["pipeline"], info.get("pipeline_spec")
        return info


def _token_from_env() -> str | None:
    token = os.environ.get("SHARDLOADER_TOKEN")
    path = os.environ.get("SHARDLOADER_TOKEN_FILE")
    if token is None and path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read()
        except OSError as err:
            raise UsageError(f"SHARDLOADER_TOKEN_FILE={path}: cannot read it ({err})") from err
    return (token or "").strip() or None  # None for no token, or one of whitespace only

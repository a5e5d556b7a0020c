"""The sample indexes of a pass's shards (:class:`SampleIndexes`), each read as untrusted input.

A local shard's sidecar is read beside it; a remote one is fetched once per node through the
node cache, like the shards, and fetched once more when its copy there turns out damaged.  A
shard that carries its sample index (format/embedded.py) brings it along when it is staged:
:meth:`SampleIndexes.keep_embedded` saves it next to the staged copy, and it is used instead of
a GET of the sidecar.  Every index is checked against its manifest entry
(:mod:`shardloader.read.sidecar`) before use; a carried copy that is damaged or fails that check
is passed over for the sidecar, with a warning.  The last 64 parsed are kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from typing import TYPE_CHECKING

from shardloader.errors import ChecksumError, ShardloaderError, StorageError, located
from shardloader.format.embedded import carried_index
from shardloader.manifest import SampleIndex, ShardInfo
from shardloader.read.sidecar import check_digest, parse_sidecar, read_sidecar
from shardloader.schema import sidecar_bound
from shardloader.storage.private import open_private, write_private
from shardloader.storage.store import Store
from shardloader.storage.streams import TailReader

if TYPE_CHECKING:
    from shardloader.read.shardset import ShardSet

__all__ = ["SampleIndexes"]

log = logging.getLogger(__name__)

_CARRIED = ".carried"  # cache name suffix of a sample index that came inside its shard
_PARSED = 64  # parsed sample indexes kept (the least recently parsed goes)


class SampleIndexes:
    """The checked sample index of each shard of one dataset, for one process (one pass)."""

    def __init__(self, shards: ShardSet) -> None:
        self.shards = shards  # its manifest, store, place, node cache and shard names
        self.manifest = shards.manifest
        self._parsed: OrderedDict[int, SampleIndex] = OrderedDict()

    def of(self, shard: int) -> SampleIndex:
        """The sample index of ``shard``, checked against its manifest entry."""
        idx = self._parsed.get(shard)
        if idx is None:
            info = self.manifest.shards[shard]
            store = self.shards.store.join(info.index_path)
            idx = None if store.is_local else self._carried(shard, info)
            if idx is None:
                data = self._sidecar(info, store, f"sample index {store.url} ({self.shards.where})")
                with located(self.shards.describe(shard)):
                    idx = parse_sidecar(data, store.url, self.manifest.format, info)
            self._parsed[shard] = idx
            if len(self._parsed) > _PARSED:
                self._parsed.popitem(last=False)
        return idx

    def forget(self, shard: int) -> None:
        """Drop the parsed index of ``shard``: one it carried is staged again with it."""
        self._parsed.pop(shard, None)

    def _sidecar(self, info: ShardInfo, store: Store, where: str) -> bytes:
        """The sidecar's hashed bytes: beside a local shard, or for a remote one its node cache
        copy (fetched once per node, like the shards), fetched once more when that copy was
        damaged since it hashed right (NOTE [re-staging a damaged copy] in storage/cache.py)."""
        for attempt in (1, 2):
            source, inode = store, None
            if not store.is_local:
                path = self.shards.cache().get(
                    info.index_path,
                    0,
                    info.index_sha256,
                    store.url,
                    lambda: store.open_stream(limit=sidecar_bound(info)),  # one GET, no HEAD
                    lambda src, dst: dst.write(src.read()),
                )
                assert path is not None  # waiting calls always return the staged path
                source, inode = Store(path), os.stat(path).st_ino
            data = read_sidecar(source, info)
            try:
                with located(where):
                    check_digest(data, info)
                return data
            except ChecksumError:
                if inode is None or attempt == 2:
                    raise
                log.warning("%s: its copy in the node cache is damaged; fetching it again", where)
                self.shards.cache().discard(info.index_path, inode)
        raise AssertionError("unreachable")

    def _carried(self, shard: int, info: ShardInfo) -> SampleIndex | None:
        """The sample index a staged shard carried (format/embedded.py), checked against its
        manifest entry; None when it carried none, or one that fails the check: that copy is
        logged once, removed, and the sidecar read instead (it came inside a shard that hashed
        to the manifest's sum, but the sidecar is the reference)."""
        try:
            path = self.shards.cache().path_for(info.index_path + _CARRIED)
            with open_private(path, os.O_RDONLY, "rb") as f:
                if os.fstat(f.fileno()).st_size > sidecar_bound(info):
                    return None  # never written so (see keep_embedded): not ours to trust
                data = f.read()
        except (FileNotFoundError, StorageError):
            return None
        carried = f"the sample index carried in {self.shards.describe(shard)}"
        try:
            with located(carried):
                return parse_sidecar(data, carried, self.manifest.format, info)
        except ShardloaderError as err:
            log.warning("%s; that copy is damaged, reading the shard's sidecar instead", err)
            with contextlib.suppress(OSError):
                os.remove(path)
            return None

    def keep_embedded(self, shard: int, stored: TailReader) -> None:
        """Save the sample index a shard carries next to its staged copy (called under the
        shard's cache lock, after its stored bytes hashed to the manifest's SHA-256: the copy
        is as trustworthy as the shard; it is still checked like a sidecar when parsed)."""
        info = self.manifest.shards[shard]
        carried = carried_index(stored.tail)
        if carried is None or len(carried.data) > sidecar_bound(info):
            return
        if not carried.whole:
            log.warning(
                "the sample index carried in %s does not match the SHA-256 its frame carries; "
                "that copy is damaged, reading the shard's sidecar instead",
                self.shards.describe(shard),
            )
            return
        try:
            write_private(self.shards.cache().path_for(info.index_path + _CARRIED), carried.data)
        except OSError as err:  # only costs a GET of the sidecar later
            log.debug(
                "%s: cannot keep the embedded sample index (%s)", self.shards.describe(shard), err
            )

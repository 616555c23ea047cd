"""A cluster's /v1/cache/events: the replicas' event streams, merged, each event labelled.

The ingress follows every replica's cache events anyway (ClusterEngine, for routing). This hub
is the single server's CacheEventHub (engine/event_stream.py: one ring, a cursor per reader,
resets for readers that fall behind, a tenant's filter) fed from those streams instead of an
engine: each event gets the merged stream's own `seq` and a `replica` field. A replica's
stream starts with a `cleared` of that replica (its snapshot follows as `stored` events: a
replica joining, or followed again after its stream broke), and a replica that leaves ends
with one, so a client that applies the merged stream per replica holds every replica's pages.

A reader's snapshot is taken from the router's index of the replicas' caches (ClusterView),
which holds exactly the events applied so far: the ring is appended in the same step of the
event loop that applies a batch to the index, so the snapshot and the ring's end agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from radixserve.cache.events import DEVICE, HOST, AllCleared, BlockRemoved, BlockStored, CacheEvent
from radixserve.engine.event_stream import SERVER_LINGER_S, CacheEventHub, SnapshotBlock, StreamSnapshot

if TYPE_CHECKING:
    from radixserve.cluster.engine import ClusterEngine


class ReplicaBlockStored(BlockStored, tag="stored"):
    """BlockStored of one replica's cache."""

    replica: str = ""


class ReplicaBlockRemoved(BlockRemoved, tag="removed"):
    """BlockRemoved of one replica's cache."""

    replica: str = ""


class ReplicaAllCleared(AllCleared, tag="cleared"):
    """Every page of one replica's `tier` (None: of every tier) was dropped."""

    replica: str = ""


class ReplicaSnapshotBlock(SnapshotBlock):
    """The cached pages of one namespace on one replica."""

    replica: str = ""


_LABELLED = {BlockStored: ReplicaBlockStored, BlockRemoved: ReplicaBlockRemoved, AllCleared: ReplicaAllCleared}


class ClusterEventHub(CacheEventHub):
    """CacheEventHub's readers over the merged stream of a ClusterEngine's replicas."""

    def __init__(self, engine: ClusterEngine, *, capacity: int, linger_s: float = SERVER_LINGER_S) -> None:
        super().__init__(engine, capacity=capacity, linger_s=linger_s)  # type: ignore[arg-type]
        self.cluster = engine
        engine.cache_listener = self._on_replica

    def _on_replica(self, replica: str, events: list[CacheEvent] | None) -> None:
        """On the event loop, right after the index applied them: a replica's events (None:
        it left). With no reader there is no ring to keep: a reader's snapshot comes from the index."""
        if not self._readers:
            return
        for event in [AllCleared(seq=0)] if events is None else events:
            fields = msgspec.structs.asdict(event)
            fields["seq"] = self._last_seq + 1
            self._on_event(_LABELLED[type(event)](**fields, replica=replica))

    def close(self) -> None:
        """Ends every reader's stream and stops taking the replicas' events."""
        if self.cluster.cache_listener == self._on_replica:
            self.cluster.cache_listener = None
        super().close()

    async def current_mirror(self) -> ClusterMirror:
        """The replicas' cached pages as the index holds them, at the ring's end."""
        view = self.cluster.view
        with view.lock:
            index = view.state.index
            pages = {(r, tier, ns): hashes for r in view.replicas for tier in (DEVICE, HOST)
                     for ns, hashes in index.pages_by_namespace(r, tier).items()}
        return ClusterMirror(pages, seq=self._last_seq, cursor=self._end, page_size=self.cluster.engine.page_size)


class ClusterMirror:
    """PageMirror's interface for a reader's snapshot: pages per (replica, tier, namespace id)."""

    def __init__(self, pages: dict[tuple[str, str, str], list[int]], *, seq: int, cursor: int,
                 page_size: int) -> None:
        self.pages = pages
        self.seq = seq
        self.cursor = cursor
        self.page_size = page_size

    def encoded(self, encoder: msgspec.json.Encoder) -> bytes:
        """The snapshot message of every replica's pages."""
        return self.encoded_for(encoder, None, self.seq)

    def encoded_for(self, encoder: msgspec.json.Encoder, visible: Any, seq: int) -> bytes:
        """The snapshot message of the namespaces that pass `visible` (None: all), numbered `seq`."""
        blocks = [ReplicaSnapshotBlock(namespace=ns, tier=tier, hashes=sorted(hashes), replica=replica)
                  for (replica, tier, ns), hashes in sorted(self.pages.items())
                  if hashes and (visible is None or visible(ns))]
        return encoder.encode(StreamSnapshot(seq=seq, page_size=self.page_size, blocks=blocks))

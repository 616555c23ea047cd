"""Which pages each replica's prefix cache holds: rebuilt exactly from its cache events.

A replica's events (radixserve.cache.events: BlockStored / BlockRemoved / AllCleared) applied
in order to a set of (namespace id, page hash) end with exactly its tree's pages. A page hash
is chained over every token from the start of the prompt, so "the first k page hashes of a
prompt are all in the set" means "the replica holds the prompt's first k pages": a lookup is
exact, not a guess from where earlier requests were sent.

Requests routed to a replica whose prompt pages are not cached yet (still queued or
prefilling there) are tracked apart as in flight: a burst of requests sharing a new prefix
then lands together instead of each computing the prefix on another replica.

Pages a replica holds in its host tier (events of tier HOST) are kept apart: a prefix that
continues on the host is loaded back there instead of recomputed, so routing may count it
with a credit below one (`matched_pages(host_credit=...)`: a load costs less than a
prefill but is not free), and `tiered_pages` predicts how many prompt tokens the replica
will report as cached (its `cached_tokens` counts both tiers).

The index also remembers where each prompt was routed (its last full page): a prompt whose
cached prefix runs through an earlier prompt's end on a replica continues a conversation
there (`continued_pages`), which the routing rule holds to more firmly than a shared prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from radixserve.cache.events import DEVICE, HOST, AllCleared, BlockRemoved, BlockStored, CacheEvent


@dataclass
class _InFlight:
    replica: str
    namespace: str
    hashes: list[int]


class CacheIndex:
    """Per replica: the set of cached page hashes per namespace, and the in-flight prompts.

    Not thread-safe: the caller serialises access (the Ray router holds a lock).
    """

    def __init__(self) -> None:
        self._cached: dict[str, dict[str, set[int]]] = {}
        self._host: dict[str, dict[str, set[int]]] = {}  # the same, for the host tier
        self._in_flight: dict[str, dict[str, Counter[int]]] = {}
        self._device_pages: dict[str, int] = {}  # replica → its device pages, kept as events apply
        self._requests: dict[str, _InFlight] = {}
        # replica → (namespace, hash of a routed prompt's last full page) → the router's routing
        # number then (ClusterState counts its routings); in the order recorded
        self._prompt_ends: dict[str, dict[tuple[str, int], int]] = {}

    # ------------------------------------------------------------------ events
    def apply(self, replica: str, events: Iterable[CacheEvent]) -> None:
        """Applies one replica's events, in the order the replica emitted them. A namespace
        whose last page goes is dropped: namespaces are (model, tenant, salt), and a salt per
        user or per request would otherwise leave one empty entry each, kept for good."""
        tiers = {DEVICE: self._cached.setdefault(replica, {}), HOST: self._host.setdefault(replica, {})}
        device = self._device_pages.get(replica, 0)
        for event in events:
            if isinstance(event, BlockStored):
                held = tiers[event.tier].setdefault(event.namespace, set())
                before = len(held)
                held.update(event.hashes)
                if event.tier == DEVICE:
                    device += len(held) - before
            elif isinstance(event, BlockRemoved):
                held = tiers[event.tier].get(event.namespace)
                if held is not None:
                    before = len(held)
                    held.difference_update(event.hashes)
                    if event.tier == DEVICE:
                        device -= before - len(held)
                    if not held:
                        del tiers[event.tier][event.namespace]
            elif isinstance(event, AllCleared):
                for tier, spaces in tiers.items():
                    if event.tier in (None, tier):
                        spaces.clear()
                        if tier == DEVICE:
                            device = 0
            else:
                self._device_pages[replica] = device
                raise TypeError(f"not a cache event: {event!r}")
        self._device_pages[replica] = device

    def forget(self, replica: str) -> None:
        """Drops everything known about a replica (it died or left)."""
        self._cached.pop(replica, None)
        self._host.pop(replica, None)
        self._device_pages.pop(replica, None)
        self._in_flight.pop(replica, None)
        self._prompt_ends.pop(replica, None)
        for request_id in [r for r, f in self._requests.items() if f.replica == replica]:
            del self._requests[request_id]

    # ------------------------------------------------------------------ in flight
    def add_in_flight(self, request_id: str, replica: str, namespace: str, hashes: Sequence[int]) -> None:
        """Records a request routed to `replica` whose prompt pages it will cache."""
        self.end_in_flight(request_id)
        hashes = list(hashes)
        self._requests[request_id] = _InFlight(replica, namespace, hashes)
        self._in_flight.setdefault(replica, {}).setdefault(namespace, Counter()).update(hashes)

    def end_in_flight(self, request_id: str) -> None:
        """The request finished (or failed): from now on only the events count."""
        flight = self._requests.pop(request_id, None)
        if flight is None:
            return
        spaces = self._in_flight[flight.replica]
        counts = spaces.get(flight.namespace)
        if counts is None:  # a prompt of no full page, whose namespace's entry another's end emptied
            return
        counts.subtract(flight.hashes)
        for h in flight.hashes:
            if counts[h] <= 0:
                del counts[h]
        if not counts:  # as in `apply`: no empty entry per namespace ever routed
            del spaces[flight.namespace]

    def add_prompt_end(self, replica: str, namespace: str, hashes: Sequence[int], at: int = 0) -> None:
        """Records the last full page of a prompt routed to `replica` as the router's `at`-th (see
        `continued_pages` and `prompt_ends_through`)."""
        if not len(hashes):
            return
        ends = self._prompt_ends.setdefault(replica, {})
        key = (namespace, hashes[-1])
        ends[key] = max(at, ends.pop(key, at))  # a moved request brings its first routing's number
        if len(ends) > PROMPT_ENDS_MEMORY:
            del ends[next(iter(ends))]

    def drop_prompt_end(self, replica: str, namespace: str, hashes: Sequence[int], at: int) -> None:
        """Forgets the prompt end `add_prompt_end` recorded for the router's `at`-th routing
        (the request was moved elsewhere), unless a later prompt ending there replaced it."""
        ends = self._prompt_ends.get(replica)
        if ends is not None and len(hashes) and ends.get((namespace, hashes[-1])) == at:
            del ends[(namespace, hashes[-1])]

    def in_flight_on(self, request_id: str) -> str | None:
        """The replica a request is in flight on (None: not in flight)."""
        flight = self._requests.get(request_id)
        return flight.replica if flight is not None else None

    # ------------------------------------------------------------------ lookups
    def matched_pages(self, replica: str, namespace: str, hashes: Sequence[int], *,
                      in_flight: bool = True, host_credit: float = 0.0) -> float:
        """Leading pages of a prompt (its page hashes) the replica holds, or (`in_flight`)
        is computing for a request routed there; with `host_credit`, the pages that continue
        them in its host tier count that much each."""
        device, host = self.tiered_pages(replica, namespace, hashes, in_flight=in_flight,
                                         host=host_credit > 0)
        return device + host_credit * host if host else device

    def tiered_pages(self, replica: str, namespace: str, hashes: Sequence[int], *,
                     in_flight: bool = False, host: bool = True) -> tuple[int, int]:
        """(device, host): the leading pages of a prompt the replica holds on the device (or,
        with `in_flight`, is computing), then how many pages continue them on its host tier
        (0 without `host`). The replica loads those back, so it reports the sum as cached."""
        cached = self._cached.get(replica, {}).get(namespace, _EMPTY)
        flying = self._in_flight.get(replica, {}).get(namespace, _EMPTY) if in_flight else _EMPTY
        on_host = self._host.get(replica, {}).get(namespace, _EMPTY) if host else _EMPTY
        device = 0
        for h in hashes:
            if h not in cached and h not in flying:
                break
            device += 1
        below = device
        for h in hashes[device:]:
            if h not in on_host:
                break
            below += 1
        return device, below - device

    def continued_pages(self, replica: str, namespace: str, hashes: Sequence[int], *,
                        in_flight: bool = False, host_credit: float = 0.0) -> float:
        """Leading pages of a prompt the replica caches (or, with `in_flight`, is computing),
        if they run through the whole of an earlier prompt routed there: the prompt continues
        (or repeats) that conversation. 0 otherwise, e.g. when only a prefix shared by many
        (a system prompt) is held. With `host_credit`, pages continuing them on the host
        tier count that much each (and may run through the earlier prompt's end)."""
        device, host = self.tiered_pages(replica, namespace, hashes, in_flight=in_flight, host=host_credit > 0)
        ends = self._prompt_ends.get(replica, {})
        if not any((namespace, h) in ends for h in hashes[: device + host]):
            return 0
        return device + host_credit * host if host else device

    def prompt_ends_through(self, replica: str, namespace: str, hashes: Sequence[int]) -> list[int]:
        """When (counted in the router's routings) the earlier prompts routed to `replica` that
        this prompt runs through were routed: a conversation's earlier turns there, each
        resent within its next (a prompt that ended inside a prefix many share, such as a
        system prompt, counts for them all)."""
        ends = self._prompt_ends.get(replica)
        if not ends:
            return []
        return [at for h in hashes if (at := ends.get((namespace, h))) is not None]

    def cached_pages(self, replica: str) -> int:
        """Pages the replica's cache holds (all namespaces). Counted as events apply: routing
        asks for it per replica per request, and a sum walked every namespace."""
        return self._device_pages.get(replica, 0)

    def pages_by_namespace(self, replica: str, tier: str = DEVICE, *, ordered: bool = True) -> dict[str, list[int]]:
        """The page hashes of a replica in `tier`, per namespace id (snapshots); sorted unless
        `ordered` is False (a copy taken under a lock, to be sorted after it: 8x quicker)."""
        spaces = self._cached if tier == DEVICE else self._host
        if not ordered:
            return {ns: list(hashes) for ns, hashes in spaces.get(replica, {}).items() if hashes}
        return {ns: sorted(hashes) for ns, hashes in sorted(spaces.get(replica, {}).items()) if hashes}

    def page_set(self, replica: str, tier: str = DEVICE) -> set[tuple[str, int]]:
        """(namespace id, hash) of every page of a replica in `tier` (snapshots, tests)."""
        spaces = self._cached if tier == DEVICE else self._host
        return {(ns, h) for ns, hashes in spaces.get(replica, {}).items() for h in hashes}

    @property
    def replicas(self) -> list[str]:
        """Replicas whose events were applied and not forgotten."""
        return list(self._cached)


_EMPTY: frozenset[int] = frozenset()
PROMPT_ENDS_MEMORY = 65536  # prompt ends remembered per replica (the oldest are forgotten)

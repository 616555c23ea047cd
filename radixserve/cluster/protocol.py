"""What the ingress and the engine replicas send each other through Ray Serve handles."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.radix import Retention
from radixserve.engine.params import SamplingParams


@dataclass
class ReplicaRequest:
    """One generation request for a replica: AsyncEngine.generate's arguments, plus what the
    router needs to place it (the namespace's id, the prompt's page hashes)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    retention: Retention | None = None
    prefix_retention: tuple[int, Retention] | None = None
    session_id: str | None = None
    namespace: str = ""                                  # routing.prompt_pages: the namespace id
    page_hashes: list[int] = field(default_factory=list)  # ... and the prompt's page hashes
    tenant: str | None = None
    admin: bool = False  # an admin's request (Request.admin)
    # The replicas' latest adaptive-rule records, by replica id (cluster/duel_pool.py): the
    # replica that takes the request pools the others' evidence with its own.
    duel_records: dict[str, list[float]] = field(default_factory=dict)
    # The prompt's leading pages the cluster saw recently (duel_pool.ClusterReuse; None: no
    # count), what the replica's adaptive rule boosts.
    cluster_seen: int | None = None
    client: Hashable = None  # whom the replica's fair share counts it as (Request.client)
    # Replicas that refused it for a full queue: the router sends it to another while one is left.
    avoid: tuple[str, ...] = ()

    @property
    def prompt(self) -> str:
        """The prompt's token ids as one character each: the text Ray Serve LLM's
        PrefixCacheAffinityRouter matches (it reads a request's `prompt` attribute)."""
        return "".join(map(chr, self.prompt_ids))


@dataclass
class Accepted:
    """The first item of every generate stream: the replica took the request."""

    replica: str


@dataclass
class Refused:
    """The first (and only) item of a generate stream the engine refused up front."""

    kind: str      # "queue_full" | "prompt_too_long" | "invalid"
    message: str
    param: str | None = None   # PromptTooLong's param, where the engine names one
    replica: str | None = None  # who refused (a full queue is tried on another replica)


@dataclass
class EventBatch:
    """One item of a replica's event stream: cache events in order, the requests they settle
    (every cache event of these finished requests is in this batch or an earlier one), and
    the replica's latest stats.

    The first batch of a subscription starts with AllCleared and lists every cached page, so
    a subscriber that applies the batches in order holds exactly the replica's cached pages.
    """

    replica: str
    events: list[Any]
    stats: dict[str, Any]
    settled: list[str] = field(default_factory=list)


@dataclass
class ReplicaInfo:
    """What the ingress needs to parse and check requests like a single server does."""

    model_name: str
    max_context_len: int
    max_sequence_len: int
    page_size: int
    tokenizer: Any
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    # The replica's torch.device: the ingress's defaults that depend on it (start_shares.py's
    # --tenant-starts: a limit where the replicas run on a CPU) read it as the single server's.
    device: Any = None
    max_queue: int | None = None  # each replica's --max-queue (None: unbounded)


class WrongReplica(RuntimeError):
    """A call pinned to one replica reached another: the pinned replica is gone."""

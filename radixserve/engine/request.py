"""A request and its sequences: the state the scheduler moves between queues."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Hashable

import numpy as np

from radixserve.cache.radix import RadixNode, Retention
from radixserve.cache.reuse import REUSED_RETENTION
from radixserve.cache.transfer import LoadHandle
from radixserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from radixserve.engine.params import SamplingParams, TokenLogprob
from radixserve.grammar import Matcher

if TYPE_CHECKING:
    from radixserve.engine.beam import BeamGroup

_ids = itertools.count()


def namespace_of(model_name: str, cache_salt: str | None, tenant: str | None = None) -> Hashable:
    """The cache namespace a request's pages live in: requests share cached pages only within
    one. A tenant (an API key of a multi-tenant server) gets namespaces of its own, and within
    it each `cache_salt` another; `tenant=None` (the single-tenant server) keeps the plain
    (model, salt) namespace. An empty salt is no salt: one namespace, one id."""
    if tenant is None:
        return (model_name, cache_salt or None)
    return (model_name, tenant, cache_salt or None)


def tenant_of(namespace: Hashable) -> str | None:
    """The tenant whose namespace `namespace` is (`namespace_of`'s inverse); None for the
    single-tenant server's namespaces and any other shape."""
    if isinstance(namespace, tuple) and len(namespace) == 3:
        return namespace[1]
    return None


@dataclass(eq=False)
class Request:
    """One submitted prompt; it owns `params.n` sequences once its prompt is computed.

    A beam-search request keeps its live beams in `beam` instead; `sequences` then receives
    the `n` best finished beams when the search ends.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    namespace: Hashable = None
    retention: Retention | None = None
    prefix_retention: tuple[int, Retention] | None = None
    session_id: str | None = None
    tenant: str | None = None  # who sent it (None: the server's one tenant); see namespace_of
    # Within the single tenant, which client sent it (the server's client address): fair
    # share goes round these as round tenants (`fair_key`). Ignored for a tenant's request.
    client: Hashable = None
    # Sent with an admin key: its `priority` orders other tenants' requests too, not only its
    # own tenant's (engine/fair_share.py), and its raised retention is not held to a share.
    admin: bool = False
    # A tenant's retention above the default, raised once it finishes and held within the
    # tenant's share (engine/sessions.py): (tokens it covers, None for all computed; retention).
    held_retention: tuple[tuple[int | None, Retention], ...] = ()
    reused_tokens: int = 0  # leading tokens seen recently (reuse history): retained longer
    reused_retention: Retention = REUSED_RETENTION  # what they get (the reuse rule's)
    sequences: list[SequenceState] = field(default_factory=list)
    cached_tokens: int | None = None  # set when its first sequence is first admitted
    host_cached_tokens: int = 0  # how many of those were copied back from the host tier
    aborted: bool = False
    beam: BeamGroup | None = None
    # Why the request failed when its own input was at fault (its grammar: GrammarFault), for
    # its client (a 400, not a 500); None for a failure of the server's.
    fault: str | None = None
    # params.grammar compiled, held from the request's arrival to its end: its samples and
    # beams start from it, and a cache that evicted the spec meanwhile cannot make the engine
    # thread compile it again (grammar/compiled.py: what is held stays findable).
    compiled_grammar: Any = None

    @property
    def fair_key(self) -> Hashable:
        """Whom fair share, a step's rows, paced turns and the queue's shares go round: the
        tenant; within the single tenant (no keys), the client (its address)."""
        return self.tenant if self.tenant is not None else self.client

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return len(self.sequences) == self.params.n and all(s.finished for s in self.sequences)

    def range_retention(self) -> list[tuple[int, int, Retention]]:
        """Token ranges retained above the request's own retention, for RadixTree.insert."""
        ranges = []
        if self.prefix_retention is not None:
            num_tokens, retention = self.prefix_retention
            ranges.append((0, num_tokens, retention))
        if self.reused_tokens:
            ranges.append((0, self.reused_tokens, self.reused_retention))
        return ranges


@dataclass(eq=False)
class SequenceState:
    """One sample: its tokens, the pages that hold their K/V, and its output state.

    `num_computed` tokens have their K/V in the pages of `block_table`; the rest of
    `token_ids` are still to be run. Prefill and decode are the same thing here: a step runs
    the next chunk of not-yet-computed tokens, and a sequence needs a new token once all of
    its tokens are computed.
    """

    request: Request
    index: int
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    sampling_seed: int | None  # None: greedy (engine/sampler.py draws token t from (seed, t))
    # The request's grammar state after output_ids (None: unconstrained). Preemption keeps the
    # generated tokens, so it keeps this too: resumption continues from the same state.
    grammar: Matcher | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)  # appended to in place, else replaced
    lock_node: RadixNode | None = None
    locked_tokens: int = 0  # tokens covered by lock_node's path (whole pages in the tree)
    loaded_tokens: int = 0  # of num_computed, tokens copied back from the host at admission
    # The most tokens ever computed or cached for it: a chunk below this mark recomputes
    # work a preemption threw away (SchedulerCounters.recomputed_tokens).
    computed_high: int = 0
    pending_loads: list[LoadHandle] = field(default_factory=list)  # copies not done yet: wait
    pages_out_of_window: int = 0  # leading block-table entries released (out of a sliding window)
    last_step: int = -1  # the scheduler's step that last ran a chunk of it (step_share.py)
    # The step it was preempted for another tenant's claim (None: it holds no loan): it lent
    # its slot, and is readmitted before any other waiting sequence (Scheduler._lend_slots).
    lent_step: int | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    beam_score: float | None = None  # a finished beam's score (beam search only)
    # What has already been handed to the stream: the engine emits only what is new.
    emitted_tokens: int = 0
    emitted_text: int = 0
    emitted_logprobs: int = 0

    # The scheduling policy's view (see engine/policy.py: Schedulable).
    @property
    def prompt_ids(self) -> np.ndarray:
        return np.asarray(self.token_ids, dtype=np.int32)

    @property
    def namespace(self) -> Hashable:
        return self.request.namespace

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

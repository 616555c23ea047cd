"""Paged KV memory and the radix-tree prefix cache over it."""

from radixserve.cache.eviction import DEFAULT_PRIORITY, EvictionPolicy, Retention, make_policy
from radixserve.cache.invariants import InvariantError, SequenceView, check_invariants
from radixserve.cache.pool import OutOfPages, PagePool
from radixserve.cache.radix import Histogram, MatchResult, RadixNode, RadixTree

__all__ = [
    "DEFAULT_PRIORITY", "EvictionPolicy", "Histogram", "InvariantError", "MatchResult",
    "OutOfPages", "PagePool", "RadixNode", "RadixTree", "Retention", "SequenceView",
    "check_invariants", "make_policy",
]

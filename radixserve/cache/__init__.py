"""Paged KV memory and the radix-tree prefix cache over it."""

from radixserve.cache.events import AllCleared, BlockRemoved, BlockStored, CacheEvent, CacheEventHub
from radixserve.cache.eviction import EvictionPolicy, make_eviction_policy
from radixserve.cache.invariants import InvariantError, SequenceView, check_invariants
from radixserve.cache.pool import OutOfPages, PagePool
from radixserve.cache.radix import MatchResult, RadixNode, RadixTree
from radixserve.cache.retention import DEFAULT_PRIORITY, Retention
from radixserve.cache.stats import Histogram

__all__ = [
    "DEFAULT_PRIORITY", "AllCleared", "BlockRemoved", "BlockStored", "CacheEvent", "CacheEventHub",
    "EvictionPolicy", "Histogram", "InvariantError", "MatchResult", "OutOfPages", "PagePool",
    "RadixNode", "RadixTree", "Retention", "SequenceView", "check_invariants", "make_eviction_policy",
]

"""What a prefill chunk costs a step, in prompt tokens: its tokens and their attention.

A step that carries decoding streams is a pause in each of them, and the scheduler caps the
prompt work in it (`mixed_prefill_tokens`). Counted in tokens alone, a late chunk of a long
prompt costs several times an early one: each of its tokens attends to every key before it
(a chunk of 512 at 6,144 keys spent 1.79 s of its 2.25 s in attention on a 2-core CPU).
`ChunkCost` counts a query-key pair as `key_cost` of a prompt token: the share of a token's
linear work (its projections and MLP) that one more key adds, from the model's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True)
class ChunkCost:
    """The cost of prefilling `n` tokens from position `start`: n + key_cost x keys attended,
    where a token at position p attends to min(p + 1, window) keys."""

    key_cost: float
    window: int | None = None
    min_tokens: int = 1  # a chunk no smaller than this however long its context (steps cost too)

    def of(self, start: int, n: int) -> float:
        """The cost of `n` tokens from `start`."""
        return n + self.key_cost * _keys(start, n, self.window)

    def affordable(self, start: int, limit: int, budget: float) -> int:
        """The most tokens from `start`, at most `limit`, whose cost fits `budget`; at least
        `min_tokens` (or `limit`) while `budget` is that large, so that a chunk deep in a long
        context still moves (the step then passes the cap by a bounded amount)."""
        if budget <= 0 or limit <= 0:
            return 0
        low, high = 0, limit  # the cost grows with n: the largest n that fits, by bisection
        while low < high:
            middle = (low + high + 1) // 2
            if self.of(start, middle) <= budget:
                low = middle
            else:
                high = middle - 1
        return max(low, min(self.min_tokens, limit)) if budget >= self.min_tokens else low

    @classmethod
    def of_model(cls, config: PretrainedConfig, window: int | None, min_tokens: int = 1) -> ChunkCost:
        """From a decoder's shapes: one key costs a token 2 x heads x head_dim multiply-adds
        (its score and its value), against one per weight of its projections and MLP."""
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        linear = (hidden * heads * head_dim * 2  # q and o
                  + hidden * kv_heads * head_dim * 2  # k and v
                  + hidden * config.intermediate_size * 3)  # gate, up, down
        return cls(key_cost=2 * heads * head_dim / linear, window=window, min_tokens=min_tokens)


def _keys(start: int, n: int, window: int | None) -> float:
    """Sum over positions p in [start, start + n) of min(p + 1, window)."""
    first, last = start + 1, start + n
    if window is None or last <= window:
        return (first + last) * n / 2
    if first >= window:
        return n * window
    return (first + window) * (window - first + 1) / 2 + (last - window) * window

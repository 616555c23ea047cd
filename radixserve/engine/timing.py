"""Where a step's time goes: cumulative seconds per section of `Engine.step`.

A `perf_counter` pair per section (well under a microsecond each), always on. The sections:

- schedule: the scheduler's choice of chunks (queue order, tree lookups, admission, eviction);
- metadata: the runner's host work before the forward pass (block tables, attention
  metadata, the backend's plan, input tensors);
- model: the forward pass. On a GPU kernels run asynchronously, so the time the device
  spends may show up in the next section that waits for it (sampling reads the tokens);
- sampling: next tokens and logprobs from the logits;
- detokenize: the incremental detokenizer, stop strings and the output bookkeeping;
- tree: caching computed pages and releasing finished sequences (tree inserts, refcounts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SECTIONS = ("schedule", "metadata", "model", "sampling", "detokenize", "tree")


@dataclass
class StepTimings:
    """Cumulative seconds per section, and the number of steps that did any work."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SECTIONS, 0.0))
    steps: int = 0

    def add(self, section: str, seconds: float) -> None:
        """Adds `seconds` to `section` (one of SECTIONS)."""
        self.seconds[section] += seconds

    def snapshot(self) -> dict[str, float]:
        """A copy of the cumulative seconds per section, plus "steps"."""
        return {**self.seconds, "steps": self.steps}

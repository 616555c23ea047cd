"""What a caller asks of a request (SamplingParams) and what it gets back (outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_TEMPERATURE = 1e-5
# Bounds on what one request may ask of the engine's per-token work (docs/server.md).
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 512  # per stop string: the matcher rescans this much text per token
MAX_STOP_TOKEN_IDS = 256


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; the OpenAI parameters of the same names.

    temperature 0 is greedy. top_k 0 and top_p 1 and min_p 0 switch those filters off.
    `logprobs` None returns none; k >= 0 returns the sampled token's logprob and its top-k
    alternatives. With `seed`, the same request gives the same tokens every time.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    def validate(self) -> None:
        """Raises ValueError("<field>: why") on the first bad value."""
        checks: list[tuple[bool, str]] = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens: must be an integer >= 1"),
            (0.0 <= self.temperature <= 2.0, "temperature: must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p: must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k: must be an integer >= 0 (0 = off)"),
            (0.0 <= self.min_p <= 1.0, "min_p: must be in [0, 1]"),
            (isinstance(self.n, int) and 1 <= self.n <= 16, "n: must be an integer in [1, 16]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs: must be in [0, 20]"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"stop: at most {MAX_STOP_STRINGS} stop strings"),
            (all(isinstance(s, str) and s for s in self.stop), "stop: must be non-empty strings"),
            (all(len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"stop: each stop string must be at most {MAX_STOP_CHARS} characters"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32: the limit is greedy anyway.
        return self.temperature < MIN_TEMPERATURE


@dataclass
class TokenLogprob:
    """The log-probability of one generated token and its most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """The result of one sample of a finished request (Engine.generate)."""

    request_id: str
    index: int
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None


@dataclass
class StreamDelta:
    """What is new in one sample since the last delta (AsyncEngine.generate)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int


class QueueFull(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later."""


class PromptTooLong(ValueError):
    """The prompt and max_tokens do not fit the model's context or the KV pool.

    `param` names the cause: "prompt" when the prompt alone does not fit, else "max_tokens".
    """

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param

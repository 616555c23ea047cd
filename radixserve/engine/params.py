"""What a caller asks of a request (SamplingParams) and what it gets back (outputs)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.grammar.spec import GrammarSpec

if TYPE_CHECKING:  # request.py imports this module
    from radixserve.engine.request import SequenceState

MIN_TEMPERATURE = 1e-5
# Bounds on what one request may ask of the engine's per-token work (docs/server.md).
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 512  # per stop string: the matcher rescans this much text per token
MAX_STOP_TOKEN_IDS = 256
MAX_BEAM_WIDTH = 16


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; the OpenAI parameters of the same names.

    temperature 0 is greedy. top_k 0 and top_p 1 and min_p 0 switch those filters off.
    `logprobs` None returns none; k >= 0 returns the sampled token's logprob and its top-k
    alternatives. With `seed`, the same request gives the same tokens every time.

    `grammar` constrains the output to a JSON Schema, a regex, a choice or an EBNF grammar
    (radixserve/grammar): every token is drawn from the tokens it allows, and the end of
    sequence only once the grammar is complete.

    Beam search: `beam_width` W >= 2 keeps the W best hypotheses at every step and returns the
    `n` <= W best finished ones, best first, scored as transformers' beam search scores them
    (sum of token log-probabilities / generated length ** `length_penalty`; `early_stopping`
    True, False or "never" with transformers' meanings). It is deterministic: temperature,
    top_p, top_k, min_p and seed do not apply. W = 1 is greedy decoding (as num_beams=1 is in
    transformers). None (the default) samples.
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
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    grammar: GrammarSpec | None = None

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
        if self.beam_width is not None:
            checks += self._beam_checks()
        if self.grammar is not None:
            checks += [
                (not self.ignore_eos, "ignore_eos: not supported with structured outputs (the end token "
                                      "closes a complete output)"),
            ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def _beam_checks(self) -> list[tuple[bool, str]]:
        width = self.beam_width
        return [
            (isinstance(width, int) and 1 <= width <= MAX_BEAM_WIDTH,
             f"beam_width: must be an integer in [1, {MAX_BEAM_WIDTH}]"),
            (not isinstance(width, int) or self.n <= width, "n: beam search returns at most beam_width beams"),
            (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty),
             "length_penalty: must be a finite number"),
            (isinstance(self.early_stopping, bool) or self.early_stopping == "never",
             'early_stopping: must be true, false or "never"'),
            (not self.stop, "stop: stop strings are not supported with beam search (use stop_token_ids)"),
            (self.logprobs is None, "logprobs: not supported with beam search"),
        ]

    @property
    def beam_search(self) -> bool:
        """Whether this request runs beam search (beam_width >= 2; 1 is plain greedy)."""
        return self.beam_width is not None and self.beam_width >= 2

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
    score: float | None = None  # beam search: the beam's length-penalised log-probability

    @classmethod
    def of(cls, seq: SequenceState) -> RequestOutput:
        """The output of a finished sample (or returned beam)."""
        req = seq.request
        return cls(req.request_id, seq.index, len(req.prompt_ids), req.cached_tokens or 0, list(seq.output_ids),
                   seq.text, seq.finish_reason, list(seq.logprobs) if req.params.logprobs is not None else None,
                   seq.beam_score)


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
    fault: str | None = None  # with finish_reason "error": the request's own fault (Request.fault)


class QueueFull(RuntimeError):
    """The waiting queue is at its limit; the caller should retry later."""


class PromptTooLong(ValueError):
    """The prompt and max_tokens do not fit the model's context or the KV pool.

    `param` names the cause: "prompt" when the prompt alone does not fit, else "max_tokens".
    """

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param

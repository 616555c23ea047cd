"""What a step writes out for the samples it ran: their sampled tokens, the text and stop
checks a token brings, and the StreamDeltas callers take."""

from __future__ import annotations

import logging
from collections.abc import Callable, Container

import torch

from radixserve.engine.params import StreamDelta, TokenLogprob
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.sampler import compute_logprobs, sample
from radixserve.grammar import MaskBuffer, TokenMask
from radixserve.grammar.matcher import GrammarTooSlow

logger = logging.getLogger(__name__)


def sample_rows(rows: torch.Tensor, seqs: list[SequenceState], fail: Callable[[Request, BaseException | None], None],
                masks: MaskBuffer | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token (and logprobs if asked) per row; the batch at once, or row by row if the
    batch fails, so a request whose sampling fails ends alone (`fail`; a dummy token here).
    A step's grammar mask is built in `masks` (reused step after step) when given."""
    too_slow = _grammars_too_slow(seqs)
    if too_slow:  # their requests end alone, the others sample as one batch (no traceback:
        for i, fault in too_slow.items():  # the request's grammar is at fault, not the server)
            fail(seqs[i].request, fault)
        keep = [i for i in range(len(seqs)) if i not in too_slow]
        tokens, logprobs = [0] * len(seqs), [None] * len(seqs)
        if keep:
            kept_tokens, kept_logprobs = sample_rows(rows[keep], [seqs[i] for i in keep], fail, masks)
            for i, token, logprob in zip(keep, kept_tokens, kept_logprobs):
                tokens[i], logprobs[i] = token, logprob
        return tokens, logprobs
    params = [s.request.params for s in seqs]
    seeds = [s.sampling_seed for s in seqs]
    steps = [len(s.output_ids) for s in seqs]  # token t of a sample is drawn from (seed, t)
    mask = None
    try:
        mask = grammar_mask(seqs, rows.shape[-1], masks)
        tokens = sample(rows, params, seeds, steps, mask)
        return tokens, compute_logprobs(rows, tokens, [p.logprobs for p in params])
    except Exception:
        logger.exception("batched sampling failed; sampling row by row")
    tokens, logprobs = [0] * len(seqs), [None] * len(seqs)
    for i, seq in enumerate(seqs):
        try:
            alone = mask.select(i) if mask is not None else grammar_mask(seqs[i:i + 1], rows.shape[-1])
            (tokens[i],) = sample(rows[i:i + 1], params[i:i + 1], seeds[i:i + 1], steps[i:i + 1], alone)
            (logprobs[i],) = compute_logprobs(rows[i:i + 1], tokens[i:i + 1], [params[i].logprobs])
        except Exception as exc:
            logger.exception("sampling failed for request %s; it ends with finish_reason 'error'",
                             seq.request.request_id)
            fail(seq.request, exc)
    return tokens, logprobs


def _grammars_too_slow(seqs: list[SequenceState]) -> dict[int, GrammarTooSlow]:
    """The rows whose grammar took too long to follow (Matcher.check_pace), and why."""
    slow: dict[int, GrammarTooSlow] = {}
    for i, seq in enumerate(seqs):
        if seq.grammar is not None:
            try:
                seq.grammar.check_pace()
            except GrammarTooSlow as fault:
                slow[i] = fault
    return slow


def grammar_mask(seqs: list[SequenceState], vocab_size: int, masks: MaskBuffer | None = None) -> TokenMask | None:
    """The allowed tokens of the constrained sequences' rows (their prepared masks, see
    push_token); None (no work at all) when no sequence of the step has a grammar."""
    constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
    return TokenMask.for_rows(constrained, vocab_size, masks) if constrained else None  # type: ignore[arg-type]


def push_token(seq: SequenceState, token: int, logprob: TokenLogprob | None, eos_token_ids: set[int],
               max_context_len: int) -> str | None:
    """Appends a sampled token to `seq` (ids, logprob, text past stop strings); returns why the
    sample ends with it ("stop", "length") or None if it goes on."""
    params = seq.request.params
    if seq.grammar is not None and not seq.grammar.accept(token):  # the mask allowed it: a bug
        raise RuntimeError(f"token {token} is not allowed by the request's grammar")
    seq.token_ids.append(token)
    seq.output_ids.append(token)
    if logprob is not None:
        seq.logprobs.append(logprob)
    text, hit_stop = seq.stop_matcher.feed(seq.detokenizer.push(token))
    seq.text += text
    if hit_stop or token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos):
        reason = "stop"
    elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= max_context_len:
        reason = "length"
    else:
        reason = None
    if reason is None and seq.grammar is not None:
        # The next step's mask, filled now while the matcher is in the cache (a fill after
        # the next forward pass finds every cache cold): ready when the logits come.
        seq.grammar.prepare()
    if reason is not None and not hit_stop:
        # The end releases held-back text (an unfinished character): it may hold a stop.
        tail, hit_stop = seq.stop_matcher.feed(seq.detokenizer.flush())
        seq.text += tail if hit_stop else tail + seq.stop_matcher.flush()
        if hit_stop:
            reason = "stop"
    return reason


class DeltaQueue:
    """The StreamDeltas of open requests that no caller has taken yet, per request id."""

    def __init__(self) -> None:
        self._pending: dict[str, list[StreamDelta]] = {}

    def open(self, request_id: str) -> None:
        """Starts collecting deltas for a new request."""
        self._pending[request_id] = []

    def emit(self, seq: SequenceState) -> None:
        """Queues what is new in `seq` since its last delta (and its finish reason, if any)."""
        req = seq.request
        if req.request_id not in self._pending:
            return
        new_logprobs = seq.logprobs[seq.emitted_logprobs:] if req.params.logprobs is not None else None
        delta = StreamDelta(seq.index, seq.output_ids[seq.emitted_tokens:], seq.text[seq.emitted_text:],
                            new_logprobs, seq.finish_reason, len(req.prompt_ids), req.cached_tokens or 0,
                            req.fault)  # set only as the request fails: its last deltas carry it
        seq.emitted_tokens, seq.emitted_text = len(seq.output_ids), len(seq.text)
        seq.emitted_logprobs = len(seq.logprobs)
        self._pending[req.request_id].append(delta)

    def end_unforked(self, req: Request, reason: str) -> None:
        """Ends the samples of `req` not forked yet (an abort or error before they started)."""
        for index in range(len(req.sequences), req.params.n):
            self._pending[req.request_id].append(StreamDelta(index, [], "", None, reason, len(req.prompt_ids),
                                                             req.cached_tokens or 0, req.fault))

    def take(self, live: Container[str]) -> dict[str, list[StreamDelta]]:
        """The deltas queued since the last call, per request id; only `live` requests stay open."""
        out, self._pending = self._pending, {rid: [] for rid in self._pending if rid in live}
        return {rid: deltas for rid, deltas in out.items() if deltas}

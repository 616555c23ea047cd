"""One engine step: scheduling, the forward pass, and what follows from its logits.

`StepLoop.step()` sweeps expired sessions, asks the scheduler for the step's chunks, runs them
(`run`) and counts the step. `run(chunks)` runs the chunks through the model; a pass that raises
is retried in halves, so a chunk that cannot run fails only its own request. After a pass,
`Scheduler.advance` does the step's bookkeeping and hands each sequence that reached its last
token its logits row: beams go to their group (`BeamDriver.deliver`); the other rows are
sampled (`token_output.sample_rows`) and each token is pushed to its sequence (stop checks,
a delta, the end of the sample). A request's samples 1..n-1 fork from sample 0 once its
prompt is computed.

Like `BeamDriver`, it holds no engine state: the engine gives it the scheduler, the runner,
the beam driver, the sessions, the queue of deltas, the callbacks that make, finish, fail and
retire sequences and requests, and the counters, timings, step clock and released-pages list
it adds to (the list appended to and cleared in place, never rebound).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from radixserve.engine.beam_driver import BeamDriver
from radixserve.engine.engine_stats import StepClock
from radixserve.engine.params import TokenLogprob
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.runner import ModelRunner
from radixserve.engine.scheduler import ScheduledChunk, Scheduler
from radixserve.engine.sessions import SessionTable
from radixserve.engine.timing import StepTimings
from radixserve.engine.token_output import DeltaQueue, push_token, sample_rows
from radixserve.grammar import GrammarFault, MaskBuffer

logger = logging.getLogger("radixserve.engine.engine")  # a failed request is logged as the engine's

NewSequence = Callable[[Request, int, list[int]], SequenceState]  # sample `index` of a request over these tokens


class StepLoop:
    """Runs one engine's steps; see the module docstring.

    Args:
        scheduler: the engine's scheduler (`advance`, forks, queues).
        runner: the model runner (`prepare`, `forward`); a tensor-parallel one alike.
        beams: the engine's beam driver, which takes beam rows.
        sessions: the engine's open sessions (swept before each step).
        deltas: the engine's queue of stream deltas.
        new_sequence: makes sample `index` of a request over given tokens (Engine._new_sequence).
        finish: ends a sample with a reason, caching its pages (Engine._finish).
        fail: ends a request with finish_reason "error" (Engine._fail_request).
        retire: removes a finished request from the engine (Engine._retire).
        eos_token_ids: the model's end tokens. max_context_len: the model's context.
        counters: the engine's ("steps", "prefill_tokens", "generated_tokens").
        timings: seconds per section of step(). step_clock: each step's duration.
        grammar_masks: the step's grammar mask rows, reused step after step.
        released: pages let go in this step, for the debug checker; appended to, never rebound.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, beams: BeamDriver, sessions: SessionTable,
                 deltas: DeltaQueue, *,
                 new_sequence: NewSequence, finish: Callable[[SequenceState, str], None],
                 fail: Callable[[Request, BaseException | None], None], retire: Callable[[Request], None],
                 eos_token_ids: set[int], max_context_len: int, counters: dict[str, int],
                 timings: StepTimings, step_clock: StepClock, grammar_masks: MaskBuffer,
                 released: list[int]) -> None:
        self._scheduler = scheduler
        self._runner = runner
        self._beams = beams
        self._sessions = sessions
        self._deltas = deltas
        self._new_sequence = new_sequence
        self._finish = finish
        self._fail = fail
        self._retire = retire
        self._eos_token_ids = eos_token_ids
        self._max_context_len = max_context_len
        self._counters = counters
        self._timings = timings
        self._step_clock = step_clock
        self._grammar_masks = grammar_masks
        self._released = released

    def step(self, check: Callable[[], None] | None) -> None:
        """Runs one step: what it makes new waits in the delta queue. `check`: the debug
        invariant checker, run after the step (before its released pages are forgotten)."""
        start = time.perf_counter()
        self._sessions.sweep()
        scheduling = time.perf_counter()
        chunks = self._scheduler.schedule()
        self._timings.add("schedule", time.perf_counter() - scheduling)
        if chunks:
            self._timings.steps += 1
            self.run(chunks)
            self._scheduler.grammar_pace.bill(c.seq for c in chunks)
        self._counters["steps"] += 1
        prefilled = sum(c.num_new for c in chunks if c.num_new > 1)
        self._counters["prefill_tokens"] += prefilled  # for prefill time per token (vs. a copy's)
        self._step_clock.record(time.perf_counter() - start, prefilled=prefilled > 0)
        if check is not None:
            check()
        self._released.clear()  # in place: the beam driver appends to this list too

    def run(self, chunks: list[ScheduledChunk]) -> None:
        """Runs `chunks` in one forward pass; if it fails, runs each half on its own, so a
        chunk that cannot run fails only its own request and the rest are retried.

        Retrying is safe: a failed pass advanced no sequence and cached nothing, and the
        slots it may have half-written are rewritten by the retry (they lie in pages the
        sequence holds alone: the copy-on-write rule).
        """
        chunks = [c for c in chunks if not c.seq.finished]  # a sibling half may have failed it
        if not chunks:
            return
        clock = time.perf_counter
        try:
            t0 = clock()
            prepared = self._runner.prepare(chunks)
            t1 = clock()
            logits = self._runner.forward(*prepared)
            self._timings.add("metadata", t1 - t0)
            self._timings.add("model", clock() - t1)
        except Exception as exc:
            if getattr(self._runner, "fault", None) is not None:
                # The tensor-parallel group is broken (its runner logged why, once): no retry
                # or half can succeed, and a traceback per request would say it again each time.
                for chunk in chunks:
                    if not chunk.seq.finished:
                        self._fail(chunk.seq.request, exc)
                return
            if len(chunks) == 1:
                logger.exception("forward pass failed for request %s; it ends with finish_reason "
                                 "'error'", chunks[0].seq.request.request_id)
                self._fail(chunks[0].seq.request, exc)
                return
            middle = len(chunks) // 2
            self.run(chunks[:middle])
            self.run(chunks[middle:])
            return
        self._process(chunks, logits)

    def _process(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> None:
        """The step's bookkeeping (`Scheduler.advance`), then each logits row to its sequence:
        beams to their group, samples sampled and their tokens pushed (forking the samples
        1..n-1 of a request whose prompt just finished)."""
        clock, timings = time.perf_counter, self._timings
        ready: list[tuple[SequenceState, int]] = []  # (sequence, logits row)
        beams: list[tuple[SequenceState, int]] = []  # beam-search beams: their rows go to their group
        next_row = itertools.count()  # the k-th sequence that needs a token has the k-th logits row

        def take_row(seq: SequenceState) -> None:
            row = next(next_row)
            if seq.request.beam is not None:
                beams.append((seq, row))
                return
            ready.append((seq, row))
            req = seq.request
            if len(req.sequences) < req.params.n and seq.index == 0:
                ready.extend((child, row) for child in self._fork(seq))

        t0 = clock()
        self._released.extend(self._scheduler.advance(chunks, take_row))
        t1 = clock()
        timings.add("tree", t1 - t0)
        if beams:  # scored with the sampling
            self._beams.deliver(beams, logits)
        if not ready:
            return
        seqs = [s for s, _ in ready]
        rows = [r for _, r in ready]
        # A decode step samples every row in order: no copy of the logits then.
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        tokens, logprobs = sample_rows(picked, seqs, fail=self._fail, masks=self._grammar_masks)
        t2 = clock()
        timings.add("sampling", t2 - t1)
        tree_before = timings.seconds["tree"]
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            if seq.finished:  # its request failed while sampling
                continue
            try:
                self._append_token(seq, token, logprob)
            except GrammarFault as exc:  # the request's own constraint: its client is told, one line here
                logger.info("request %s ends: %s", seq.request.request_id, exc)
                self._fail(seq.request, exc)
            except Exception as exc:
                logger.exception("post-processing a token of request %s failed; it ends with "
                                 "finish_reason 'error'", seq.request.request_id)
                self._fail(seq.request, exc)
        finishing = timings.seconds["tree"] - tree_before  # _finish's share, counted there
        timings.add("detokenize", clock() - t2 - finishing)

    def _fork(self, parent: SequenceState) -> list[SequenceState]:
        """Samples 1..n-1 of a request start from sample 0's computed prompt pages."""
        req = parent.request
        children = []
        for index in range(len(req.sequences), req.params.n):
            child = self._new_sequence(req, index, list(parent.token_ids))
            # A child past max_running waits and is admitted like any request (a cache hit).
            if self._scheduler.slots_taken() < self._scheduler.max_running and self._scheduler.fork(parent, child):
                children.append(child)
            else:
                self._scheduler.waiting.append(child)
        return children

    def _append_token(self, seq: SequenceState, token: int, logprob: TokenLogprob | None) -> None:
        self._counters["generated_tokens"] += 1
        reason = push_token(seq, token, logprob, self._eos_token_ids, self._max_context_len)
        if reason is not None:
            self._finish(seq, reason)
        else:
            self._deltas.emit(seq)
        if seq.request.finished:
            self._retire(seq.request)

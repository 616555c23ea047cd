"""Beam search over the paged cache: the engine's side of a BeamGroup (engine/beam.py).

`BeamGroup` scores candidates and keeps hypotheses; it holds no pages. `BeamDriver` turns
its decisions into sequences and pages: it hands each beam its logits row, runs a group's
step once every beam has delivered, gives new hypotheses and children their pages through
the scheduler, and ends a search (its n best hypotheses become the request's outputs, the
rest is released). It owns no state of its own: the engine gives it the scheduler, the
callbacks that make, finish, fail and retire sequences and requests, the list that
collects released pages for the debug checker, and the counters it adds generated tokens to.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from radixserve.cache.invariants import InvariantError
from radixserve.engine.beam import BeamGroup, Candidate, Hypothesis
from radixserve.engine.params import SamplingParams
from radixserve.engine.request import Request, SequenceState
from radixserve.engine.scheduler import Scheduler
from radixserve.grammar import Matcher
from radixserve.grammar.matcher import GrammarFault, GrammarTooFewOutputs

logger = logging.getLogger(__name__)

NewBeam = Callable[[Request, list[int]], SequenceState]  # a beam of the request over these tokens


class BeamDriver:
    """Runs the beam-search requests of one engine; see the module docstring.

    Args:
        scheduler: the engine's scheduler (pages, queues).
        new_beam: makes a beam sequence of a request over given tokens (not an output yet).
        finish: ends an output sequence with a reason, caching its pages (Engine._finish).
        fail: ends a request with finish_reason "error" (Engine._fail).
        retire: removes a finished request from the engine (Engine._retire).
        eos_token_ids: the model's end tokens (a hypothesis ending in one stopped).
        released: pages let go in this step, for the debug checker; appended to, never rebound.
        counters: the engine's counters; "generated_tokens" counts each beam's new token.
    """

    def __init__(self, scheduler: Scheduler, *, new_beam: NewBeam,
                 finish: Callable[[SequenceState, str], None], fail: Callable[[Request, BaseException | None], None],
                 retire: Callable[[Request], None], eos_token_ids: set[int],
                 released: list[int], counters: dict[str, int]) -> None:
        self.scheduler = scheduler
        self._new_beam = new_beam
        self._finish_output = finish
        self._fail = fail
        self._retire = retire
        self._eos_token_ids = eos_token_ids
        self._released = released
        self._counters = counters

    def stop_tokens(self, params: SamplingParams) -> set[int]:
        """The tokens that end a hypothesis of a request with `params`."""
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self._eos_token_ids)

    def start(self, req: Request) -> SequenceState:
        """Gives `req` its beam group; returns the first beam (the prompt), to be queued."""
        req.beam = BeamGroup.for_request(req, self.stop_tokens(req.params))
        first = self._new_beam(req, list(req.prompt_ids))
        req.beam.running.append(first)
        return first

    def deliver(self, beams: list[tuple[SequenceState, int]], logits: torch.Tensor) -> None:
        """Hands each beam its logits row; a group whose beams have all delivered steps."""
        rows: dict[int, tuple[BeamGroup, list[tuple[SequenceState, int]]]] = {}
        for seq, row in beams:
            group = seq.request.beam
            if group is not None and not group.done:
                rows.setdefault(id(group), (group, []))[1].append((seq, row))
        for group, members in rows.values():
            try:
                for seq, row in members:  # (a beam's mask: its grammar may have grown too slow)
                    group.deliver(seq, logits[row])
                if group.ready:
                    self._step(group)
            except GrammarFault as exc:  # the request's own constraint: its client is told, no traceback
                logger.info("beam search of request %s ends: %s", group.request.request_id, exc)
                self._fail(group.request, exc)
            except Exception as exc:
                logger.exception("a beam search step of request %s failed; it ends with finish_reason "
                                 "'error'", group.request.request_id)
                self._fail(group.request, exc)

    def _step(self, group: BeamGroup) -> None:
        """One beam-search step over the paged cache.

        New hypotheses hold their parent's full pages; a beam no candidate continues releases
        its pages; a parent's first surviving child is the parent itself (it keeps its pages,
        last page included), every further child shares the parent's full pages and copies
        its partly filled last page. Beams that die free exactly as many partial pages as the
        extra children copy, so only the first step (one prompt, W children) needs free
        pages: if they cannot be had, the group is preempted and recomputes from the cache.
        """
        parents = list(group.running)
        result = group.step()
        # Each candidate's grammar state, checked before any sequence or page changes: a beam
        # gets its own copy of its parent's state (siblings never share one), advanced past
        # its token; the parent's own state is left for its other children.
        grammars = [_advanced(parents[cand.parent], cand.token) for cand in result.running]
        finished_grammars = [_advanced(parents[entry.parent], entry.token) if isinstance(entry, Candidate) else None
                             for entry in result.finished]
        hypotheses = [self._hypothesis(entry, parents, grammar)
                      for entry, grammar in zip(result.finished, finished_grammars)]
        for dropped in group.keep(hypotheses):
            self._released.extend(self.scheduler.finish(dropped.seq, cache=False))
        if result.done:
            self._finish_search(group)
            return
        children: dict[int, list[int]] = {}  # parent position -> ranks of its children
        for rank, cand in enumerate(result.running):
            children.setdefault(cand.parent, []).append(rank)
        for i, parent in enumerate(parents):
            if i not in children:
                parent.finish_reason = "pruned"
                self._released.extend(self.scheduler.finish(parent, cache=False))
        extra = len(result.running) - len(children)
        copies = extra if parents[0].num_computed % self.scheduler.page_size else 0
        fits = (self.scheduler.slots_taken() + extra <= self.scheduler.max_running
                and self.scheduler.ensure_free(copies))
        running: list[SequenceState] = [parents[0]] * len(result.running)
        for i, ranks in children.items():
            parent = parents[i]
            for rank in ranks[1:]:
                child = self._new_beam(group.request, list(parent.token_ids))
                child.output_ids = list(parent.output_ids)
                if not (fits and self.scheduler.fork(parent, child)):
                    self.scheduler.waiting.append(child)
                running[rank] = child
            running[ranks[0]] = parent
        for rank, cand in enumerate(result.running):
            running[rank].grammar = grammars[rank]
            if grammars[rank] is not None:  # the next step's mask, while the state is in the cache
                grammars[rank].prepare()
            running[rank].token_ids.append(cand.token)
            running[rank].output_ids.append(cand.token)
            self._counters["generated_tokens"] += 1
        group.running = running
        if not fits:  # all of the group waits, and is admitted again as a whole
            self.scheduler.preempt_unit(running)

    def _hypothesis(self, entry: Candidate | Hypothesis, parents: list[SequenceState],
                    grammar: Matcher | None) -> Hypothesis:
        """A finished candidate becomes a hypothesis frozen at its parent's pages plus its token
        (and `grammar`, its parent's state past that token)."""
        if not isinstance(entry, Candidate):
            return entry
        parent = parents[entry.parent]
        seq = self._new_beam(parent.request, parent.token_ids + [entry.token])
        seq.output_ids = parent.output_ids + [entry.token]
        seq.grammar = grammar
        if not parent.pages_out_of_window:  # else it could never be cached: it holds nothing
            self.scheduler.share_full_pages(parent, seq)
        return Hypothesis(entry.score, seq)

    def _finish_search(self, group: BeamGroup) -> None:
        """Ends a search: the n best hypotheses become the request's outputs (their pages are
        cached like any finished sample's); everything else the group holds is released."""
        req = group.request
        stops = self.stop_tokens(req.params)
        if len(group.hypotheses) < req.params.n:
            # Unconstrained, the scorer always keeps W (a bug); a grammar may allow fewer
            # distinct outputs than n within max_tokens: the request fails (finish_reason
            # "error") rather than return fewer choices than asked or invalid ones.
            found = f"beam search ended with {len(group.hypotheses)} finished beams, fewer than n={req.params.n}"
            if req.params.grammar is not None:  # the request's own doing: its client is told so
                raise GrammarTooFewOutputs(f"{found}: the request's output constraint allows no more "
                                           "distinct outputs within max_tokens")
            raise ValueError(found)
        best, rest = group.hypotheses[: req.params.n], group.hypotheses[req.params.n:]
        group.hypotheses = rest
        self.release(group, None)
        for rank, hyp in enumerate(best):
            seq = hyp.seq
            seq.index, seq.beam_score = rank, hyp.score
            seq.text = "".join(seq.detokenizer.push(t) for t in seq.output_ids) + seq.detokenizer.flush()
            req.sequences.append(seq)
            self._finish_output(seq, "stop" if seq.output_ids[-1] in stops else "length")
        self._retire(req)

    def release(self, group: BeamGroup, reason: str | None) -> None:
        """Releases every running beam and kept hypothesis of `group` (no caching) and ends
        the search; `reason` marks the beams (so chunks of this step skip them)."""
        for seq in group.running + [h.seq for h in group.hypotheses]:
            seq.finish_reason = reason or "pruned"
            self._released.extend(self.scheduler.finish(seq, cache=False))
        group.running, group.hypotheses = [], []
        group.logits.clear()
        group.done = True

    def check(self, group: BeamGroup) -> None:
        """A beam group is scheduled as a whole: its beams all run or all wait."""
        running = [s in self.scheduler.running for s in group.running]
        waiting = [s in self.scheduler.waiting for s in group.running]
        if not (all(running) or all(waiting)):
            raise InvariantError(f"[beam-group-split] request {group.request.request_id}: beams running "
                                 f"{running}, waiting {waiting}")


def _advanced(parent: SequenceState, token: int) -> Matcher | None:
    """A copy of `parent`'s grammar state past `token` (None if unconstrained). The mask let
    only allowed tokens be candidates, so a refusal is a bug: the step fails before any
    sequence or page has changed."""
    if parent.grammar is None:
        return None
    state = parent.grammar.fork()
    if not state.accept(token):
        raise RuntimeError(f"beam token {token} is not allowed by the request's grammar")
    return state

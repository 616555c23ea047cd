"""One request's failure ends that request alone; scheduling keeps its promises.

Failures are real: a PyTorch hook on the model's embedding makes the forward pass raise, or
turns a sequence's activations into NaN, whenever a chosen "poison" token is in the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.cache.invariants import InvariantError, SequenceView, check_invariants
from tests.engine_util import hf_greedy

POISON = 299  # a token id the other prompts never use
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(ckpt: Path, **kwargs) -> Engine:
    kwargs.setdefault("page_size", 4)
    kwargs.setdefault("num_pages", 128)
    return Engine(model=str(ckpt), debug_checks=True, **kwargs)


@contextmanager
def poisoned(engine: Engine, mode: str, token: int = POISON) -> Iterator[None]:
    """While active, a step whose tokens include `token` raises ("raise"), or the rows of
    `token` become NaN ("nan", which spreads to that sequence's logits only)."""
    embed = engine.loaded.model.model.embed_tokens

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        hit = args[0] == token
        if not hit.any():
            return output
        if mode == "raise":
            raise RuntimeError("poisoned step")
        return output.masked_fill(hit[:, None], float("nan"))

    handle = embed.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Submits every request, steps to the end; returns per request id its finish reasons
    and token ids."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    out: dict[str, list] = {rid: [] for rid in requests}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_work():
        for rid, deltas in engine.step().items():
            for d in deltas:
                tokens[rid] += d.token_ids
                if d.finish_reason is not None:
                    out[rid].append(d.finish_reason)
    return {rid: [out[rid], tokens[rid]] for rid in requests}


INNOCENT = {f"ok{i}": (list(range(10 + 7 * i, 30 + 7 * i)), GREEDY) for i in range(4)}


@pytest.mark.parametrize("mode", ["raise", "nan"])
def test_a_failing_request_ends_alone_and_its_batch_mates_are_unaffected(tiny_llama_dir: Path, mode: str) -> None:
    alone = run(make_engine(tiny_llama_dir), INNOCENT)
    engine = make_engine(tiny_llama_dir)
    bad = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)  # NaN logits cannot be sampled
    with poisoned(engine, mode):
        mixed = run(engine, {**INNOCENT, "bad": ([5, 6, POISON, 7], bad)})
    assert mixed.pop("bad") == [["error"], []]
    assert mixed == alone
    assert alone["ok0"][1] == hf_greedy(tiny_llama_dir, INNOCENT["ok0"][0], 8)
    assert engine.stats()["requests_aborted"] == 1 and engine.tree.locked_pages == 0
    assert engine.pool.num_free + engine.tree.cached_pages == engine.pool.num_pages


@pytest.mark.parametrize("bad", [GREEDY, SamplingParams(max_tokens=8, beam_width=2, ignore_eos=True)],
                         ids=["greedy", "beam"])
def test_nan_logits_fail_a_greedy_or_beam_request_instead_of_returning_token_0(
        tiny_llama_dir: Path, bad: SamplingParams) -> None:
    """argmax of a NaN row returns the NaN's index (or 0): it must not pass for a token."""
    alone = run(make_engine(tiny_llama_dir), INNOCENT)
    engine = make_engine(tiny_llama_dir)
    with poisoned(engine, "nan"):
        mixed = run(engine, {**INNOCENT, "bad": ([5, 6, POISON, 7], bad)})
    assert mixed.pop("bad") == [["error"], []]
    assert mixed == alone
    assert engine.tree.locked_pages == 0


def test_a_request_that_fails_after_decoding_for_a_while_frees_its_pages(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    prompt = list(range(40, 60))
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    innocent = run(make_engine(tiny_llama_dir), INNOCENT)
    used = {t for p, _ in INNOCENT.values() for t in p} | {t for _, out in innocent.values() for t in out}
    # The first generated token nobody else ever feeds to the model: when it comes back as
    # input at the next step, that step fails.
    k = next(i for i in range(2, len(free)) if free[i] not in used | set(prompt) | set(free[:i]))
    engine.flush_cache()
    with poisoned(engine, "raise", token=free[k]):
        result = run(engine, {"r": (prompt, GREEDY), **INNOCENT})
    assert result.pop("r") == [["error"], free[: k + 1]]
    assert result == innocent
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_pages


def test_a_large_request_is_not_starved_by_a_trickle_of_small_ones(tiny_llama_dir: Path) -> None:
    # 48 pages of 4 tokens; the large request needs 31 of them. With max_wait_s=0 every request
    # counts as aged, so admission is in arrival order and stops at the first that does not fit.
    engine = make_engine(tiny_llama_dir, num_pages=48, max_wait_s=0.0)
    small = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    arrivals = iter(range(1000))

    def trickle() -> None:
        n = next(arrivals)
        engine.add_request([3 + n % 200, 4, 5] + list(range(100, 100 + 20)), small, request_id=f"s{n}")

    for _ in range(4):
        trickle()
    engine.step()
    engine.add_request(list(range(3, 123)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       request_id="big")
    big = engine._requests["big"]
    steps = 0
    while big.cached_tokens is None:  # set when the request is first admitted
        trickle()
        trickle()
        engine.step()
        steps += 1
        assert steps < 60, "the large request was never admitted"
    while "big" in engine._requests:
        engine.step()


def test_forked_samples_respect_max_running(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=9, n=4, ignore_eos=True)
    prompt = list(range(20, 38))
    ample = make_engine(tiny_llama_dir).generate([prompt], params)
    engine = make_engine(tiny_llama_dir, max_running=2)
    engine.add_request(prompt, params, request_id="r")
    outputs: dict[int, list[int]] = {i: [] for i in range(4)}
    while engine.has_work():
        for delta in engine.step().get("r", []):
            outputs[delta.index] += delta.token_ids
        assert len(engine.scheduler.running) <= 2
    assert [outputs[i] for i in range(4)] == [o.token_ids for o in ample]  # seeds reproduce


def test_a_prefill_chunk_shrinks_instead_of_preempting(tiny_llama_dir: Path) -> None:
    # lpm admits `a` (a cache hit) before the earlier `b`, so `b` runs first and `a` after it.
    # `b`'s second 48-token chunk needs 12 pages where 11 are free: it takes 11 and `a`, which
    # needs no new page to finish, is not preempted for it.
    engine = make_engine(tiny_llama_dir, num_pages=34, max_batch_tokens=48)
    system = list(range(150, 190))
    engine.generate([system + [1]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    prompts = {"b": list(range(30, 130)), "a": system + [2, 3]}
    result = run(engine, {rid: (p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
                          for rid, p in prompts.items()})
    stats = engine.stats()
    assert stats["shrunk_chunks"] == 1 and stats["preemptions"] == 0
    for rid, prompt in prompts.items():
        assert result[rid] == [["length"], hf_greedy(tiny_llama_dir, prompt, 2)]


def test_a_request_whose_samples_outgrow_the_pool_delays_its_own_samples_not_others(tiny_llama_dir: Path) -> None:
    # 4 samples of 68 tokens need 68 pages; the pool has 40. By arrival alone the newest
    # sequence, another client's short request, was the one preempted whenever a page ran
    # out, and waited behind the samples' re-admissions: 39 steps for 12 tokens.
    engine = make_engine(tiny_llama_dir, num_pages=40)
    hog = SamplingParams(max_tokens=60, temperature=1.0, seed=1, n=4, ignore_eos=True)
    engine.add_request(list(range(20, 28)), hog, request_id="hog")
    short = list(range(40, 46))
    arrivals = {20: "a", 30: "b", 40: "c"}  # step → request added just before it
    finished: dict[str, int] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in arrivals.values()}
    hog_tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    step = 0
    while engine.has_work():
        step += 1
        if step in arrivals:
            engine.add_request(short, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                               request_id=arrivals[step])
        for rid, deltas in engine.step().items():
            for delta in deltas:
                (hog_tokens[delta.index] if rid == "hog" else tokens[rid]).extend(delta.token_ids)
                if delta.finish_reason is not None and rid != "hog":
                    finished[rid] = step
    assert engine.stats()["preemptions"] > 0  # the pool did run out
    for arrival, rid in arrivals.items():
        assert finished[rid] - arrival + 1 <= 12 + 2  # 12 steps for 12 tokens, and at most 2 more
        assert tokens[rid] == hf_greedy(tiny_llama_dir, short, 12)
    alone = make_engine(tiny_llama_dir, num_pages=128).generate([list(range(20, 28))], hog)
    assert [hog_tokens[i] for i in range(4)] == [o.token_ids for o in alone]  # seeds reproduce


def preempted_samples_and_a_newcomer(ckpt: Path, priority: int) -> Engine:
    """An engine whose request "many" (n = 2, priority 10) ran two steps and was preempted
    whole, and whose request "new" (`priority`) arrived after."""
    engine = make_engine(ckpt)
    engine.add_request(list(range(20, 28)), SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=1),
                       request_id="many", priority=10)
    engine.step()
    engine.step()
    assert [s.index for s in engine.scheduler.running] == [0, 1]
    for seq in list(engine.scheduler.running):
        engine.scheduler.preempt_unit([seq])
    engine.add_request(list(range(40, 48)), SamplingParams(max_tokens=4), request_id="new", priority=priority)
    return engine


def admission(engine: Engine, now: float) -> list[tuple[str, int]]:
    scheduler = engine.scheduler
    return [(s.request.request_id, s.index) for s in scheduler._waiting_order(list(scheduler.waiting), now)]


def test_further_samples_keep_their_priority_and_never_age_ahead_of_first_samples(tiny_llama_dir: Path) -> None:
    engine = preempted_samples_and_a_newcomer(tiny_llama_dir, priority=0)
    # A further sample comes after first samples of its own priority only, not of a lower one.
    assert admission(engine, engine.scheduler.clock()) == [("many", 0), ("many", 1), ("new", 0)]
    engine = preempted_samples_and_a_newcomer(tiny_llama_dir, priority=10)
    first, second, new = sorted(engine.scheduler.waiting, key=lambda s: (s.arrival_time, s.index))
    assert first.arrival_time < new.arrival_time
    max_wait = engine.scheduler.policy.max_wait_s
    # "many" has waited past max_wait_s, "new" has not: aging puts "many"'s first sample
    # first; its further sample is never aged (its request is running), or a hog's preempted
    # samples would all come first again.
    now = first.arrival_time + max_wait + (new.arrival_time - first.arrival_time) / 2
    assert admission(engine, now) == [("many", 0), ("new", 0), ("many", 1)]
    assert admission(engine, new.arrival_time + max_wait + 1) == [("many", 0), ("new", 0), ("many", 1)]


def test_the_checker_catches_a_write_into_a_shared_page(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    engine.add_request(list(range(20, 38)), SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=2,
                                                           ignore_eos=True))
    engine.step()
    parent, child = engine.scheduler.running
    assert parent.num_computed % 4  # the last page is partly filled, so the next write goes there
    # The bug copy-on-write prevents: the child writes into its parent's partial page.
    engine.pool.incref([parent.block_table[-1]])
    engine.pool.decref([child.block_table[-1]])
    child.block_table[-1] = parent.block_table[-1]
    with pytest.raises(InvariantError, match="copy-on-write"):
        engine.check_invariants()


def test_the_checker_catches_a_write_into_a_cached_page(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    engine.generate([list(range(20, 37))], GREEDY)  # 4 full pages cached
    page = engine.tree.match(list(range(20, 24)), (engine.model_name, None), update=False).pages[0]
    engine.pool.incref([page])
    # A sequence holding the cached page with 3 tokens in it would write its 4th slot next.
    with pytest.raises(InvariantError, match="copy-on-write"):
        check_invariants(engine.pool, engine.tree, [SequenceView([page], 3)])
    check_invariants(engine.pool, engine.tree, [SequenceView([page], 4)])  # a full page is read only


def test_an_expired_session_leaves_the_table(tiny_llama_dir: Path) -> None:
    import time

    engine = make_engine(tiny_llama_dir, session_ttl_s=0.2)
    engine.add_request(list(range(3, 20)), GREEDY, session_id="s")
    while engine.has_work():
        engine.step()
    assert engine.stats()["sessions_open"] == 1
    time.sleep(0.3)
    engine.add_request([3, 4, 5], GREEDY)
    engine.step()  # any step sweeps idle sessions
    assert engine.stats()["sessions_open"] == 0
    engine.add_request(list(range(3, 20)), GREEDY, session_id="t")
    while engine.has_work():
        engine.step()
    time.sleep(0.3)
    assert not engine.close_session("t")  # expired: the server answers 404

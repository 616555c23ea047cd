"""Beam search: the returned beams and their scores equal transformers' beam search, over
shared pages, cold and warm in the prefix cache, and when a group is preempted.

Every engine here runs with debug_checks on: after every step the structural checker verifies
reference counts, the copy-on-write rule (a beam's next write slot is in a page it alone
holds) and that a beam group runs or waits as a whole.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from tests.engine_util import hf_model

MAX_NEW = 10

# (family, num_beams, num_return_sequences ("W" = num_beams), length_penalty, early_stopping,
# page_size). A pairwise design rather than the 2 x 2 x 3 x 2 cross product: every pair of
# values of (num_beams, num_return_sequences, length_penalty, early_stopping) occurs in some row
# (each length_penalty value has two rows, which between them take both values of each other
# parameter, in the combinations that complete the pairs), each family runs one row, each page
# size two rows; the last row adds early_stopping="never" (with length_penalty > 0, the case
# where transformers bounds the best running score at max_new_tokens).
MATRIX = [
    ("llama", 2, 1, 1.0, True, 1),
    ("llama3_rope", 4, "W", 1.0, False, 4),
    ("llama_tied_bias", 2, "W", 0.0, False, 16),
    ("mistral", 4, 1, 0.0, True, 1),
    ("qwen2", 2, 1, 2.0, False, 4),
    ("qwen3", 4, "W", 2.0, True, 16),
    ("llama", 4, 2, 2.0, "never", 4),
]


def prompt_for(seed: int, length: int = 11) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


def frequent_token(directory: Path, prompt: list[int]) -> int:
    """The token the model finds likeliest on average along its greedy continuation: used as
    the stop token, so beams finish at different lengths and early stopping matters."""
    model = hf_model(str(directory))
    with torch.no_grad():
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
        return int(torch.softmax(model(tokens).logits[0], dim=-1).mean(0).argmax())


def hf_beams(directory: Path, prompt: list[int], width: int, k: int, length_penalty: float,
             early_stopping: bool | str, stop: int | None, max_new: int = MAX_NEW) -> list[tuple[list[int], float]]:
    """transformers' beam search: the k best (generated tokens, score), best first."""
    model = hf_model(str(directory))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=k, do_sample=False,
                             max_new_tokens=max_new, length_penalty=length_penalty,
                             early_stopping=early_stopping, eos_token_id=stop, pad_token_id=0,
                             return_dict_in_generate=True, output_scores=True)
    beams = []
    for i in range(k):
        generated = int((out.beam_indices[i] >= 0).sum())  # the beam's own length (rows are padded)
        beams.append((out.sequences[i, len(prompt):len(prompt) + generated].tolist(),
                      float(out.sequences_scores[i])))
    return beams


def beam_params(width: int, k: int, length_penalty: float = 1.0, early_stopping: bool | str = False,
                stop: int | None = None, max_new: int = MAX_NEW) -> SamplingParams:
    # The model's own EOS is ignored and `stop` takes its place, as eos_token_id does for HF.
    return SamplingParams(max_tokens=max_new, beam_width=width, n=k, length_penalty=length_penalty,
                          early_stopping=early_stopping, ignore_eos=True,
                          stop_token_ids=[] if stop is None else [stop])


def assert_same_beams(outs, expected: list[tuple[list[int], float]], stop: int | None) -> None:
    assert [o.index for o in outs] == list(range(len(expected)))
    for out, (tokens, score) in zip(outs, expected):
        assert out.token_ids == tokens
        assert out.score == pytest.approx(score, abs=1e-4)
        assert out.finish_reason == ("stop" if stop is not None and tokens[-1] == stop else "length")


@pytest.mark.parametrize("family,width,k,length_penalty,early_stopping,page_size", MATRIX,
                         ids=[f"{row[0]}-W{row[1]}-k{row[2]}-lp{row[3]}-es{row[4]}-P{row[5]}" for row in MATRIX])
def test_beams_equal_transformers_cold_and_warm(tiny_checkpoints: dict[str, Path], family: str, width: int,
                                                k: int | str, length_penalty: float,
                                                early_stopping: bool | str, page_size: int) -> None:
    directory = tiny_checkpoints[family]
    k = width if k == "W" else k
    prompt = prompt_for(seed=width * 10 + page_size, length=2 * page_size + 3 if page_size > 4 else 11)
    stop = frequent_token(directory, prompt)
    expected = hf_beams(directory, prompt, width, k, length_penalty, early_stopping, stop)
    engine = Engine(model=str(directory), page_size=page_size, num_pages=256, debug_checks=True)
    params = beam_params(width, k, length_penalty, early_stopping, stop)
    cold = engine.generate([prompt], params)
    assert cold[0].cached_tokens == 0
    assert_same_beams(cold, expected, stop)
    warm = engine.generate([prompt], params)
    # The prompt's full pages at least (the returned beams' pages may cover the rest of it);
    # the prompt's last token always runs.
    assert min(len(prompt) // page_size * page_size, len(prompt) - 1) <= warm[0].cached_tokens < len(prompt)
    assert_same_beams(warm, expected, stop)


def test_beams_stop_at_the_models_own_eos(tiny_llama_dir: Path) -> None:
    """Without stop_token_ids the model's EOS ends beams, as transformers' eos_token_id does."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128, debug_checks=True)
    prompt = prompt_for(seed=3)
    eos = hf_model(str(tiny_llama_dir)).config.eos_token_id
    assert engine.eos_token_ids == {eos}
    outs = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, beam_width=3, n=3))
    assert_same_beams(outs, hf_beams(tiny_llama_dir, prompt, 3, 3, 1.0, False, eos), eos)


def test_preempted_beam_groups_resume_whole_and_equal_transformers(tiny_llama_dir: Path) -> None:
    """Six groups of four beams in 40 pages of 4 tokens: some groups are preempted (all their
    beams at once: the checker's beam-group-split rule) and recomputed from the cache."""
    prompts = [prompt_for(seed, length=5 + seed) for seed in range(6)]
    stop = frequent_token(tiny_llama_dir, prompts[0])
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=40, debug_checks=True)
    outs = engine.generate(prompts, beam_params(4, 4, stop=stop, max_new=24))
    preemptions = engine.stats()["preemptions"]
    assert preemptions > 0 and preemptions % 4 == 0  # whole groups of four beams
    for i, prompt in enumerate(prompts):
        assert_same_beams(outs[4 * i: 4 * i + 4], hf_beams(tiny_llama_dir, prompt, 4, 4, 1.0, False, stop, 24),
                          stop)


def test_beams_share_the_prompt_pages(tiny_llama_dir: Path) -> None:
    """Four beams over a 64-token prompt hold its 16 pages once (plus one page of their own
    each), where four independent sequences would hold 4 x 17 pages."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128, debug_checks=True)
    prompt = prompt_for(seed=5, length=64)
    engine.add_request(prompt, beam_params(4, 4, max_new=3))
    engine.step()  # the prompt, then the first beam step: four beams, one token each
    request = next(iter(engine._requests.values()))
    assert len(request.beam.running) == 4
    assert all(b.num_computed == 64 and len(b.block_table) == 16 for b in request.beam.running)
    engine.step()  # each beam writes its first token into a page of its own
    tables = [b.block_table for b in request.beam.running]
    assert all(t[:16] == tables[0][:16] for t in tables)  # the prompt's pages, shared
    assert len({t[16] for t in tables}) == 4              # one private page per beam
    group_pages = {p for t in tables for p in t}
    assert len(group_pages) == 16 + 4
    assert sum(len(t) for t in tables) == 4 * 17          # what four copies would hold
    assert engine.pool.num_used == 16 + 4                 # the prompt is cached in those same pages
    while engine.has_work():
        engine.step()


def test_partial_last_page_is_copied_once_per_extra_child(tiny_llama_dir: Path) -> None:
    """A 10-token prompt in pages of 4: the first beam step gives four children of one
    parent; the parent keeps its partly filled page and three copies are made."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=64, debug_checks=True)
    engine.add_request(prompt_for(seed=7, length=10), beam_params(4, 1, max_new=4))
    engine.step()
    (request,) = engine._requests.values()
    tables = [b.block_table for b in request.beam.running]
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    assert [engine.pool.refcount(p) for p in tables[0][:2]] == [5, 5]  # four beams + the tree
    while engine.has_work():
        engine.step()


def test_abort_mid_search_releases_every_beam_and_hypothesis(tiny_llama_dir: Path) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128, debug_checks=True)
    prompt = prompt_for(seed=11)
    stop = frequent_token(tiny_llama_dir, prompt)
    rid = engine.add_request(prompt, beam_params(4, 2, stop=stop, max_new=20))
    for _ in range(6):
        engine.step()
    engine.abort(rid)
    deltas = engine.take_deltas()[rid]
    assert [(d.index, d.finish_reason) for d in deltas] == [(0, "abort"), (1, "abort")]
    engine.check_invariants()
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["pages_locked"] == 0
    assert stats["pages_used"] == stats["pages_cached"]  # nothing but cache is left


def test_one_beam_is_greedy(tiny_llama_dir: Path) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128, debug_checks=True)
    prompt = prompt_for(seed=2)
    (beam,) = engine.generate([prompt], SamplingParams(max_tokens=8, beam_width=1, ignore_eos=True))
    (greedy,) = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert beam.token_ids == greedy.token_ids and beam.score is None


@pytest.mark.parametrize("fields,message", [
    (dict(beam_width=2, n=3), "n: beam search returns at most beam_width beams"),
    (dict(beam_width=17), "beam_width: must be an integer in [1, 16]"),
    (dict(beam_width=2, early_stopping="sometimes"), 'early_stopping: must be true, false or "never"'),
    (dict(beam_width=2, length_penalty=float("nan")), "length_penalty: must be a finite number"),
    (dict(beam_width=2, stop=["x"]), "stop: stop strings are not supported with beam search"),
    (dict(beam_width=2, logprobs=1), "logprobs: not supported with beam search"),
])
def test_bad_beam_parameters_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**fields).validate()


def test_a_group_that_cannot_fit_the_pool_is_refused(tiny_llama_dir: Path) -> None:
    from radixserve import PromptTooLong

    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=20, debug_checks=True)
    engine.generate([prompt_for(seed=1)], SamplingParams(max_tokens=8, temperature=0.0))  # fits alone
    with pytest.raises(PromptTooLong, match="4 beams of prompt"):
        engine.add_request(prompt_for(seed=1), beam_params(4, 1, max_new=8))


@pytest.mark.parametrize("length_penalty", [-1e308, -50.0, 50.0, 1e308])
def test_extreme_length_penalties_still_return_the_best_beams(tiny_llama_dir: Path, length_penalty: float) -> None:
    """Scores far below transformers' -1e9 placeholder (a strong negative penalty) or a
    divisor that overflows still finish hypotheses: the request gets its n beams, never none."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128, debug_checks=True)
    prompt = prompt_for(seed=3)
    stop = frequent_token(tiny_llama_dir, prompt)
    outs = engine.generate([prompt], beam_params(4, 2, length_penalty=length_penalty, stop=stop, max_new=8))
    assert len(outs) == 2 and all(o.finish_reason in ("stop", "length") for o in outs)
    assert all(math.isfinite(o.score) for o in outs) and outs[0].score >= outs[1].score
    assert not engine.has_work() and engine.stats()["pages_locked"] == 0


# ---------------------------------------------------------------- the scorer on its own


def test_scorer_finishes_only_stop_candidates_ranked_below_the_width() -> None:
    """A stop candidate ranked exactly `width` (0-based) must not join the finished set;
    one ranked below it does, with score sum(log p) / length ** length_penalty."""
    from radixserve.engine.beam import BeamScorer

    stop = 3
    # One running beam (the prompt): tokens 0 > 1 > stop(3) > 2 > 4 by log-probability.
    logprobs = torch.log_softmax(torch.tensor([[4.0, 3.0, 1.0, 2.0, 0.0]]), dim=-1)
    scorer = BeamScorer(width=2, length_penalty=1.0, early_stopping=False, max_new_tokens=10,
                        stop_token_ids={stop})
    result = scorer.step(logprobs)
    assert result.finished == [] and not bool(scorer.slot_finished.any())
    assert [(c.parent, c.token) for c in result.running] == [(0, 0), (0, 1)]
    # The stop token ranked 1st of the non-best: it finishes, normalised by length 1.
    logprobs = torch.log_softmax(torch.tensor([[4.0, 1.0, 2.0, 3.0, 0.0]]), dim=-1)
    scorer = BeamScorer(width=2, length_penalty=1.0, early_stopping=False, max_new_tokens=10,
                        stop_token_ids={stop})
    result = scorer.step(logprobs)
    (finished,) = result.finished
    assert (finished.parent, finished.token) == (0, stop)
    assert finished.score == pytest.approx(float(logprobs[0, stop]), abs=1e-6)
    assert [(c.parent, c.token) for c in result.running] == [(0, 0), (0, 2)]

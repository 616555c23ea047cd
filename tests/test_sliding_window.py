"""Sliding-window models through the engine against transformers, and the pages they hold.

Two tiny checkpoints with a window of WINDOW tokens: Mistral (every layer windowed, so the
scheduler releases pages that leave the window) and Qwen2 with use_sliding_window and
max_window_layers=1 (layer 0 full, layers 1-2 windowed: nothing may be released). Prompts
and generations run several times past the window, at page sizes 1, 4 (the window is not a
multiple of either's boundary) and 16 (larger than the window). The oracle is transformers:
its greedy generation (its sliding-window cache) for the tokens, and one full forward over
the whole sequence (its sliding-window mask, eager attention) for the log-probabilities.
Every engine runs with debug_checks: after each step the structural checker verifies the
window rule (exactly the pages wholly before the window are released) and the runner checks
that no released page is attended.
"""

from __future__ import annotations

import functools
import math
import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.engine.request import SequenceState
from tests.model_helpers import load_reference, write_tiny_checkpoint
from tests.test_beam_search import assert_same_beams, beam_params, hf_beams
from tests.test_engine import assert_cached_kv_is_factual

WINDOW = 10
PROMPT_LEN = 37
MAX_NEW = 36  # prompt + generation: over 7 windows
TOP = 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("window_checkpoints")
    return {name: write_tiny_checkpoint(name, root / name, window=WINDOW)
            for name in ("mistral_window", "qwen2_window")}


def prompt_for(seed: int, length: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


def params(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP)


class Reference:
    """transformers on one checkpoint: greedy tokens and per-position log-probabilities.

    Both are deterministic functions of their arguments, and the tests ask for the same ones
    again and again (the same prompt cold and warm, at every page size): each is computed
    once and remembered."""

    def __init__(self, directory: Path) -> None:
        self.model = load_reference(directory)
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self._logprobs: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new: int) -> list[int]:
        key = (tuple(prompt), max_new)
        if key not in self._greedy:
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                                      pad_token_id=0)
            self._greedy[key] = out[0, len(prompt):].tolist()
        return list(self._greedy[key])

    @torch.no_grad()
    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """log-softmax of the logits at every position of `tokens`, one forward, no cache."""
        key = tuple(tokens)
        if key not in self._logprobs:
            self._logprobs[key] = torch.log_softmax(self.model(torch.tensor([tokens])).logits[0].float(), dim=-1)
        return self._logprobs[key]


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(path) for name, path in checkpoints.items()}


def assert_equals_transformers(reference: Reference, prompt: list[int], out) -> None:
    """Greedy tokens equal transformers' generation; each step's chosen and top-5
    log-probabilities equal its full forward's within 1e-4."""
    assert out.token_ids == reference.greedy(prompt, len(out.token_ids))
    expected = reference.logprobs(prompt + out.token_ids)[len(prompt) - 1: -1]
    for step, (lp, row) in enumerate(zip(out.logprobs, expected, strict=True)):
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4), f"step {step}"
        top_ids = [t for t, _ in lp.top]
        assert top_ids == row.topk(TOP).indices.tolist(), f"step {step}"
        assert [v for _, v in lp.top] == pytest.approx(row.topk(TOP).values.tolist(), abs=1e-4), f"step {step}"


def held_pages(seq: SequenceState) -> int:
    return len(seq.block_table) - seq.pages_out_of_window


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window"])
def test_cold_and_warm_equal_transformers(checkpoints: dict[str, Path], references: dict[str, Reference],
                                          name: str, page_size: int) -> None:
    """A prompt of 37 tokens and 36 generated (window 10), cold; then, after the first
    request's out-of-window pages were freed, requests reusing its cached prompt (the same
    prompt, and the prompt with another continuation), warm; all equal transformers."""
    engine = Engine(model=str(checkpoints[name]), page_size=page_size, num_pages=160, debug_checks=True,
                    max_batch_tokens=16)  # prompts prefill in chunks, each past the window
    reference = references[name]
    prompt = prompt_for(1)
    (cold,) = engine.generate([prompt], params())
    assert cold.cached_tokens == 0
    assert_equals_transformers(reference, prompt, cold)
    all_windowed = name == "mistral_window"
    cached_prompt = (PROMPT_LEN // page_size) * page_size
    if all_windowed:
        # The generated tokens' pages left the window and were freed; the prompt's stay cached.
        assert engine.tree.cached_pages == PROMPT_LEN // page_size
        assert engine.pool.num_used == engine.tree.cached_pages
    else:
        # A full-attention layer needs every page: the whole sequence stays cached, its last,
        # partly filled page included.
        assert engine.tree.cached_pages == -(-(PROMPT_LEN + MAX_NEW - 1) // page_size)
    assert_cached_kv_is_factual(engine)

    other = prompt + prompt_for(2, 9)
    warm_same, warm_other = engine.generate([prompt, other], params())
    # The same prompt matches all but its last token (which must run for its logits).
    if all_windowed:  # the prompt's full pages
        assert warm_same.cached_tokens == min(cached_prompt, ((PROMPT_LEN - 1) // page_size) * page_size)
        assert warm_other.cached_tokens == cached_prompt
    else:  # the whole first sequence is cached: a hit into its partly matched page too
        assert (warm_same.cached_tokens, warm_other.cached_tokens) == (PROMPT_LEN - 1, PROMPT_LEN)
    assert warm_same.token_ids == cold.token_ids
    assert_equals_transformers(reference, prompt, warm_same)
    assert_equals_transformers(reference, other, warm_other)
    assert_cached_kv_is_factual(engine)


def test_a_batch_of_short_and_long_sequences_equals_transformers(checkpoints: dict[str, Path],
                                                                  references: dict[str, Reference]) -> None:
    """Prompts shorter and longer than the window in one batch (sequences the window cuts
    next to ones it does not), both models."""
    prompts = [prompt_for(3, 4), prompt_for(4, WINDOW), prompt_for(5, 23), prompt_for(6, 41)]
    for name in ("mistral_window", "qwen2_window"):
        engine = Engine(model=str(checkpoints[name]), page_size=4, num_pages=160, debug_checks=True)
        for prompt, out in zip(prompts, engine.generate(prompts, params(20))):
            assert_equals_transformers(references[name], prompt, out)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_windowed_model_holds_the_window_and_a_mixed_one_everything(checkpoints: dict[str, Path],
                                                                      page_size: int) -> None:
    """Decoding far past the window: with every layer windowed the sequence holds at most
    ceil(window / page_size) + 1 pages (exactly those overlapping its next token's window,
    once that has left the cached prompt); with one full-attention layer, all of its pages."""
    bound = math.ceil(WINDOW / page_size) + 1
    prompt = prompt_for(7, 12)
    for name in ("mistral_window", "qwen2_window"):
        engine = Engine(model=str(checkpoints[name]), page_size=page_size, num_pages=256, debug_checks=True)
        engine.add_request(prompt, SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
        held: list[tuple[int, int]] = []
        while engine.has_work():
            engine.step()
            for seq in engine.scheduler.running:
                held.append((seq.num_computed, held_pages(seq)))
        assert max(n for n, _ in held) == len(prompt) + 148  # seen before its last step
        if name == "mistral_window":
            far = [(n, pages) for n, pages in held if n - WINDOW + 1 >= len(prompt)]
            assert len(far) > 100
            for n, pages in far:
                assert pages == math.ceil(n / page_size) - (n - WINDOW + 1) // page_size
            assert max(pages for _, pages in far) <= bound
        else:
            for n, pages in held:
                assert pages == math.ceil(n / page_size)


@functools.cache
def _window_beams(directory: Path, prompt: tuple[int, ...]) -> list[tuple[list[int], float]]:
    return hf_beams(directory, list(prompt), 3, 3, 1.0, False, None, max_new=3 * WINDOW)


def window_beams(directory: Path, prompt: list[int]) -> list[tuple[list[int], float]]:
    """transformers' 3 best of 3 beams over three windows past `prompt`, computed once for
    both page sizes (a copy each time: the test compares, never changes them)."""
    return [(list(tokens), score) for tokens, score in _window_beams(directory, tuple(prompt))]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window"])
def test_beam_search_over_a_window_equals_transformers(checkpoints: dict[str, Path], name: str,
                                                       page_size: int) -> None:
    """Three beams generating three windows past a prompt that fills two: beams fork and
    copy pages while the window releases them; beams and scores equal transformers'."""
    directory = checkpoints[name]
    prompt = prompt_for(8, 2 * WINDOW)
    expected = window_beams(directory, prompt)
    engine = Engine(model=str(directory), page_size=page_size, num_pages=200, debug_checks=True)
    params = beam_params(3, 3, max_new=3 * WINDOW)
    for _ in range(2):  # cold, then warm
        assert_same_beams(engine.generate([prompt], params), expected, None)

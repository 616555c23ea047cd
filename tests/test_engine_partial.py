"""Engine with partial pages cached: a conversation's next turn recomputes only its new tokens
at page size 16, and greedy output stays what transformers gives, partial pages on or off.

Every engine here runs with debug_checks on: the structural checker runs after every step.
"""

from __future__ import annotations

from pathlib import Path

from radixserve import Engine, SamplingParams
from tests.engine_util import hf_greedy
from tests.test_engine import assert_cached_kv_is_factual

PAGE_SIZE = 16
TURN = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)


def converse(ckpt: Path, partial: bool, turns: int = 4) -> tuple[list[list[int]], list[list[int]], list[int], Engine]:
    """(each turn's prompt, its greedy answer, its cached tokens, the engine) of one conversation."""
    engine = Engine(model=str(ckpt), page_size=PAGE_SIZE, num_pages=64, debug_checks=True,
                    cache_partial_pages=partial)
    conversation = list(range(100, 131))  # 31 tokens: no turn ends on a page boundary
    prompts, answers, cached = [], [], []
    for turn in range(turns):
        out = engine.generate([conversation], TURN)[0]
        prompts.append(conversation)
        answers.append(out.token_ids)
        cached.append(out.cached_tokens)
        conversation = conversation + out.token_ids + [200 + turn, 201 + turn, 202 + turn]
    return prompts, answers, cached, engine


def test_turns_reuse_the_previous_turns_partial_page_and_greedy_output_is_unchanged(tiny_llama_dir: Path) -> None:
    prompts, answers, cached, engine = converse(tiny_llama_dir, partial=True)
    computed = [len(p) + len(a) - 1 for p, a in zip(prompts, answers)]  # the last token is never computed
    assert cached == [0, *computed[:-1]]
    assert any(c % PAGE_SIZE for c in cached[1:])  # the hits end inside a page: partial pages were used
    assert any(node.partial for node, _ in engine.tree.nodes())
    assert_cached_kv_is_factual(engine)  # partial leaves' K/V included
    plain_prompts, plain_answers, plain_cached, _ = converse(tiny_llama_dir, partial=False)
    assert plain_cached == [0, *(c // PAGE_SIZE * PAGE_SIZE for c in computed[:-1])]
    assert (plain_prompts, plain_answers) == (prompts, answers)
    for prompt, answer in zip(prompts, answers):
        assert answer == hf_greedy(tiny_llama_dir, prompt, len(answer))


def test_preemption_and_eviction_with_partial_pages_give_the_same_tokens(tiny_llama_dir: Path) -> None:
    """Preemption caches the computed tokens, partial page included, and pressure evicts
    partial leaves like any leaf; the output is what an unpressed engine gives."""
    prompts = [list(range(10 + i, 10 + i + 21 + 3 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    ample = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=64, debug_checks=True)
    tight = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=8, max_batch_tokens=32,
                   debug_checks=True)
    squeezed = tight.generate(prompts, params)
    assert tight.stats()["preemptions"] > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in ample.generate(prompts, params)]
    assert squeezed[0].token_ids == hf_greedy(tiny_llama_dir, prompts[0], 9)

"""ChunkCost: a prefill chunk's tokens and their attention, in prompt tokens; exact values."""

from __future__ import annotations

from transformers import LlamaConfig

from radixserve.engine.step_cost import ChunkCost, _keys

SMOLLM2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                      num_hidden_layers=30)


def test_keys_attended_count_the_window() -> None:
    assert _keys(0, 4, None) == 1 + 2 + 3 + 4
    assert _keys(0, 4, 2) == 1 + 2 + 2 + 2  # the window reached inside the chunk
    assert _keys(5, 3, 2) == 3 * 2  # wholly past it
    assert _keys(2, 2, 100) == 3 + 4


def test_a_key_costs_its_score_and_value_against_a_tokens_weights() -> None:
    """SmolLM2-135M: 2 x 9 x 64 multiply-adds a key against 576 x (576 x 2 + 192 x 2 + 1536 x 3)
    a token: a key costs 1/3072 of a prompt token."""
    assert ChunkCost.of_model(SMOLLM2, None).key_cost == 1 / 3072


def test_chunks_deep_in_a_long_context_are_smaller_but_move() -> None:
    cost = ChunkCost(key_cost=1 / 3072)
    assert cost.affordable(0, 512, 120) == 117  # 117 + 6,903 / 3,072 = 119.2; 118 would be 120.3
    assert cost.affordable(6000, 512, 120) == 40  # 40 + 40 x 6,020.5 / 3,072 = 118.4
    assert cost.affordable(6000, 30, 120) == 30  # the tokens left
    floored = ChunkCost(key_cost=1 / 3072, min_tokens=16)
    assert floored.affordable(20000, 512, 120) == 16  # 15 fit; the floor moves it by 16
    assert floored.affordable(20000, 512, 10) == 1  # a budget under the floor gets what fits
    assert floored.affordable(0, 512, 0) == 0

"""The thread governor: trials at the other thread count, paired with the step before; three
wins switch, a loss doubles the wait; and in an engine, the tokens do not depend on it."""

from __future__ import annotations

import itertools

import torch

from radixserve import Engine, SamplingParams
from radixserve.engine.thread_governor import (
    FIRST_TRIAL_AFTER,
    MOST_STEPS_BETWEEN_TRIALS,
    WINS_TO_SWITCH,
    ThreadGovernor,
)


def _drive(governor: ThreadGovernor, seconds: dict[int, float], steps: int, shape: object = 4) -> list[int]:
    """`steps` governed steps whose time depends only on their thread count; the counts used."""
    used = []
    for _ in range(steps):
        threads = governor.threads_for_step(shape)
        used.append(threads)
        governor.record(threads, shape, seconds[threads])
    return used


def test_a_busy_machine_switches_to_one_thread_after_three_won_trials() -> None:
    governor = ThreadGovernor(max_threads=2)
    used = _drive(governor, {2: 0.100, 1: 0.030}, steps=WINS_TO_SWITCH * (FIRST_TRIAL_AFTER + 1))
    trials = [i for i, threads in enumerate(used) if threads == 1]
    # a trial after each FIRST_TRIAL_AFTER steps at two threads; the third win switches
    assert trials == [FIRST_TRIAL_AFTER + k * (FIRST_TRIAL_AFTER + 1) for k in range(WINS_TO_SWITCH)]
    assert (governor.current, governor.switches) == (1, 1)
    # and back when the machine is quiet again: two threads win their trials
    _drive(governor, {2: 0.020, 1: 0.030}, steps=WINS_TO_SWITCH * (FIRST_TRIAL_AFTER + 1))
    assert (governor.current, governor.switches) == (2, 2)


def test_lost_trials_double_the_wait_up_to_a_bound() -> None:
    governor = ThreadGovernor(max_threads=2)
    used = _drive(governor, {2: 0.020, 1: 0.030}, steps=5000)
    assert governor.current == 2 and governor.switches == 0
    trials = [i for i, threads in enumerate(used) if threads == 1]
    gaps = [b - a - 1 for a, b in itertools.pairwise(trials)]
    assert gaps[:4] == [2 * FIRST_TRIAL_AFTER, 4 * FIRST_TRIAL_AFTER, 8 * FIRST_TRIAL_AFTER, 16 * FIRST_TRIAL_AFTER]
    assert max(gaps) == MOST_STEPS_BETWEEN_TRIALS


def test_a_machine_turned_busy_after_a_quiet_spell_is_followed_within_one_wait() -> None:
    governor = ThreadGovernor(max_threads=2)
    _drive(governor, {2: 0.020, 1: 0.030}, steps=5000)  # quiet: the wait has grown to its bound
    assert governor.steps_between_trials == MOST_STEPS_BETWEEN_TRIALS
    steps = 0
    while governor.current == 2 and steps < 10 * MOST_STEPS_BETWEEN_TRIALS:
        _drive(governor, {2: 0.100, 1: 0.030}, steps=1)
        steps += 1
    # the first won trial brings the next ones forward: one wait, then two short ones
    assert governor.current == 1 and steps <= MOST_STEPS_BETWEEN_TRIALS + WINS_TO_SWITCH * (FIRST_TRIAL_AFTER + 1)


def test_a_close_trial_does_not_count_and_a_loss_resets_the_wins() -> None:
    governor = ThreadGovernor(max_threads=2)
    _drive(governor, {2: 0.100, 1: 0.030}, steps=2 * (FIRST_TRIAL_AFTER + 1))  # two wins
    assert governor.wins == 2
    _drive(governor, {2: 0.100, 1: 0.085}, steps=FIRST_TRIAL_AFTER + 1)  # 0.85 > WIN_RATIO: a loss
    assert (governor.wins, governor.current) == (0, 2)


def test_trials_pair_only_with_a_step_of_their_own_shape() -> None:
    governor = ThreadGovernor(max_threads=2)
    for _ in range(FIRST_TRIAL_AFTER):
        governor.record(governor.threads_for_step(4), 4, 0.100)
    assert governor.threads_for_step(8) == 2  # the last step had 4 rows: no trial at 8
    governor.record(2, 8, 0.300)
    assert governor.threads_for_step(8) == 1  # now paired with the 8-row step
    governor.record(1, 8, 0.100)
    assert governor.wins == 1


def test_one_thread_machines_never_try() -> None:
    governor = ThreadGovernor(max_threads=1)
    assert set(_drive(governor, {1: 0.01}, steps=200)) == {1}


def test_the_engine_gives_the_same_tokens_whatever_the_thread_count() -> None:
    """A float32 engine forced to trial every step (alternating one and two threads) gives the
    tokens of an engine at a fixed count: the kernels' sums do not depend on the threads."""
    threads_before = torch.get_num_threads()
    prompts = [[5 + (i * 7 + j) % 50 for j in range(9 + 5 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    try:
        torch.set_num_threads(2)
        for adaptive in (False, True):
            engine = Engine("demo", dtype="float32", adaptive_threads=adaptive)
            if adaptive:
                assert engine.runner.governor is not None
                engine.runner.governor.steps_between_trials = 0  # every paired step is a trial
            outputs[adaptive] = [r.token_ids for r in engine.generate(prompts, params)]
            if adaptive:
                assert engine.runner.governor.trials >= 3  # steps at one thread among steps at two
    finally:
        torch.set_num_threads(threads_before)
    assert outputs[True] == outputs[False]

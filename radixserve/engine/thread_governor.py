"""How many threads a decode step runs with: all the cores, or one, whichever is faster now.

The CPU kernels split each call between threads and join them at its end, and a decode step
makes about a hundred such calls. On a machine whose cores are also busy with other work,
each join waits for a thread the OS has descheduled, and a step with two threads can take
several times as long as with one. No setting is right everywhere (a quiet machine wants every
core), and load changes while a server runs, so the runner measures: now and then one decode
step runs at the other thread count, and its time is compared with the step just before it
(the same rows, one token more of context: nearly the same work). Three wins in a row switch
the setting; a lost trial doubles the wait before the next one, so a trial costs little when
the setting is right, and a won one brings the next forward, so a change of load is followed
within one wait and a few dozen steps. The kernels' results do not depend on the thread
count (each output is one fixed sum), so the tokens do not either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_TRIAL_AFTER = 16  # governed steps before the first trial, and after each switch
MOST_STEPS_BETWEEN_TRIALS = 1024
WINS_TO_SWITCH = 3
WIN_RATIO = 0.8  # a trial wins when its step took at most this share of the step before


@dataclass
class ThreadGovernor:
    """Chooses between `max_threads` and one thread for governed (decode) steps.

    Per governed step the caller asks `threads_for_step(shape)` (shape: what makes two steps
    comparable, such as the number of rows), runs the step with that many threads, and
    reports its seconds to `record`. Steps of another shape between two governed steps do not
    disturb the pairing; a trial is compared only with a step of its own shape.
    """

    max_threads: int
    current: int = 0  # 0: max_threads
    steps_between_trials: int = FIRST_TRIAL_AFTER
    wins: int = 0
    switches: int = 0
    trials: int = 0
    _steps_since_trial: int = 0
    _last: tuple[object, float] | None = None  # (shape, seconds) of the last step at `current`
    _trial_shape: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.current = self.current or self.max_threads

    @property
    def alternative(self) -> int:
        """The thread count a trial runs with."""
        return 1 if self.current != 1 else self.max_threads

    def threads_for_step(self, shape: object) -> int:
        """The thread count for the next governed step of `shape`."""
        if (self.max_threads > 1 and self._steps_since_trial >= self.steps_between_trials
                and self._last is not None and self._last[0] == shape):
            self._trial_shape = shape
            return self.alternative
        return self.current

    def record(self, threads: int, shape: object, seconds: float) -> None:
        """The step of `shape` just run with `threads` threads took `seconds`."""
        if threads == self.current or self._trial_shape is None:
            self._last = (shape, seconds)
            self._steps_since_trial += 1
            return
        last = self._last
        self._trial_shape, self._steps_since_trial = None, 0
        self.trials += 1
        if last is not None and last[0] == shape and seconds <= WIN_RATIO * last[1]:
            self.wins += 1
            # The next trial comes soon: after a quiet spell the wait had grown to a thousand
            # steps, and three wins that far apart left a machine turned busy at the slow
            # setting for minutes (16-token chats at 2-14 s instead of 0.2 s).
            self.steps_between_trials = min(self.steps_between_trials, FIRST_TRIAL_AFTER)
            if self.wins >= WINS_TO_SWITCH:
                self.current, self.wins, self._last = threads, 0, None
                self.steps_between_trials = FIRST_TRIAL_AFTER
                self.switches += 1
            return
        self.wins = 0
        self.steps_between_trials = min(2 * self.steps_between_trials, MOST_STEPS_BETWEEN_TRIALS)

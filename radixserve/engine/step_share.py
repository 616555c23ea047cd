"""Each tenant's share of a step's decode rows: one tenant's many streams cannot set the pace
of another's.

Every running sequence decodes in every step, and on a CPU a step's time grows with its rows
(SmolLM2-135M on 2 cores: 12.6 ms for one row, 35 ms for 32, 124 ms for 128). Fair share
(fair_share.py) bounds the service each tenant gets, not the pace of a step: a tenant holding
128 streams made another tenant's short chat wait a 128-row step for each of its tokens.
With a row limit, while several tenants decode and their rows exceed it, the limit is shared
between the tenants max-min fairly (water-filling: a tenant needing less than an equal part
gets all its rows, the others split the rest) and a tenant's rows beyond its part sit the
step out, its higher priorities and then those that ran least recently running first, so
each of its streams of one priority still runs every few steps. Step time stays near that
of `row_limit` rows for everyone; the tenant held back loses only the batching beyond the
limit (on that CPU, 32 rows: 3% of the tokens; bench/tenant_step_share.py), and a GPU, whose
decode step barely grows with its rows, sets no limit.

Only decoding units are held (a prefill chunk is capped by the step's prefill cap); a unit is
a beam group (its beams run together) or one sequence, and a tenant always runs at least one
unit. With one tenant, or rows within the limit, nothing is held. A held unit keeps its
pages and stays in the preemption order: when pages run out, it is preempted in its turn.
"""

from __future__ import annotations

from collections.abc import Hashable

from radixserve.engine.request import SequenceState


def units_held(units: list[list[SequenceState]], row_limit: int) -> set[int]:
    """The seq_ids of the members of the running units that sit this step out."""
    decoding: dict[Hashable, list[list[SequenceState]]] = {}
    for unit in units:
        if all(seq.num_tokens - seq.num_computed == 1 for seq in unit):
            decoding.setdefault(unit[0].request.fair_key, []).append(unit)
    rows = {tenant: sum(len(unit) for unit in group) for tenant, group in decoding.items()}
    if len(decoding) < 2 or sum(rows.values()) <= row_limit:
        return set()
    held: set[int] = set()
    left, tenants = row_limit, sorted(rows, key=lambda t: rows[t])
    for i, tenant in enumerate(tenants):
        share = max(1, left // (len(tenants) - i))
        taken = 0
        # Higher priority first (as in admission and preemption), then least recently run;
        # the scheduler's order (arrival) among equals.
        for unit in sorted(decoding[tenant], key=lambda u: (-u[0].priority, u[0].last_step, u[0].arrival_time,
                                                            u[0].seq_id)):
            if taken and taken + len(unit) > share:
                held.update(seq.seq_id for seq in unit)
            else:
                taken += len(unit)
        left = max(0, left - taken)
    return held

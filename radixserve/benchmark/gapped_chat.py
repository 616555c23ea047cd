"""A conversation workload whose turns arrive minutes apart (heavy-tailed gaps).

Conversations start as a Poisson process; each resends its whole history every turn (system
prompt, earlier messages and replies, a new message). The number of turns and the gaps
between them are heavy-tailed (Pareto): most conversations are short and quick, a few run
long with pauses of many minutes. Between two turns of one conversation a replica serves
many other requests, so no count of requests in flight says where the conversation lives,
and a few long conversations can pile their turns onto one replica: the shape routing must
balance over time (radixserve/cluster/routing.py), not only over what is in flight.
"""

from __future__ import annotations

import numpy as np

from radixserve.benchmark.workloads import DEFAULT_VOCAB_SIZE, BenchRequest, Workload, _TokenSource


def gapped_conversations(num_conversations: int = 400, start_rate: float = 1.0, mean_turns: float = 5.0,
                         max_turns: int = 40, gap_scale_s: float = 30.0, gap_alpha: float = 1.3,
                         max_gap_s: float = 1800.0, num_system_prompts: int = 4, system_len: int = 1024,
                         message_len: int = 256, output_len: int = 128, *, seed: int = 0,
                         vocab_size: int = DEFAULT_VOCAB_SIZE) -> Workload:
    """`num_conversations` conversations starting at `start_rate` per second. Turns per
    conversation: 1 + a Pareto draw with mean about `mean_turns` - 1 (at most `max_turns`);
    the gap before each later turn: `gap_scale_s` x a Pareto(`gap_alpha`) draw (at most
    `max_gap_s`). Requests are in arrival order; a turn's parent is the previous turn."""
    src = _TokenSource(seed, vocab_size)
    rng = np.random.default_rng(seed + 1)
    systems = src.siblings(num_system_prompts, system_len)
    firsts = src.siblings(num_conversations, message_len)
    starts = np.cumsum(rng.exponential(1.0 / start_rate, size=num_conversations))
    # A Pareto(a) draw (numpy's Lomax, plus one) has mean a / (a - 1); scaled to mean_turns - 1.
    turn_alpha = 1.5
    extra = (rng.pareto(turn_alpha, size=num_conversations) + 1) * (mean_turns - 1) * (turn_alpha - 1) / turn_alpha
    turns = np.minimum(1 + np.floor(extra).astype(int), max_turns)
    pending: list[tuple[float, int, BenchRequest]] = []
    parent_of: dict[int, BenchRequest] = {}  # id of a later turn → the turn before it
    for conv in range(num_conversations):
        group = conv % num_system_prompts
        prompt = np.concatenate([systems[group], firsts[conv]])
        at = float(starts[conv])
        parent: BenchRequest | None = None
        for turn in range(int(turns[conv])):
            if parent is not None:
                at += min(max_gap_s, gap_scale_s * (rng.pareto(gap_alpha) + 1))
                prompt = np.concatenate([parent.prompt_ids, parent.output_ids, src.tokens(message_len)])
            request = BenchRequest(index=-1, prompt_ids=prompt, output_len=output_len, arrival_time=at,
                                   group_id=group, client_id=conv, output_ids=src.tokens(output_len),
                                   shared_len=system_len)
            if parent is not None:
                parent_of[id(request)] = parent
            pending.append((at, len(pending), request))
            parent = request
    pending.sort(key=lambda item: (item[0], item[1]))
    requests = [request for _, _, request in pending]
    for i, request in enumerate(requests):
        request.index = i  # a turn arrives after the one before it, so its parent is numbered first
        if id(request) in parent_of:
            request.parent = parent_of[id(request)].index
    return Workload("gapped-chat", requests, dict(
        num_conversations=num_conversations, start_rate=start_rate, mean_turns=mean_turns, max_turns=max_turns,
        gap_scale_s=gap_scale_s, gap_alpha=gap_alpha, max_gap_s=max_gap_s, num_system_prompts=num_system_prompts,
        system_len=system_len, message_len=message_len, output_len=output_len, seed=seed))

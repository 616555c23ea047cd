"""Held-out workloads: mixes of the matrix's families that no rule was tuned on.

The adaptive rule and the router were tuned on the matrix (`matrix.matrix_workloads`), whose
every workload keeps one shape for its whole run. Real traffic changes shape: a document
service by day, chats by night; a batch job scanning through while conversations go on.
These mixes put the families together in ways none of them shows alone, and stay out of
the default matrix so that they stay held out: run them with `radixserve bench matrix
--workloads phases,blend,scan-burst,drift` to check a change against traffic it was not
tuned on (docs/benchmark.md, "Held-out mixes").

- `phases`: documents (zipf-docs), then a crowd of chats (chat-crowd), then a new document
  set, then a scan, one after the other: what a rule learned in one phase is wrong in the next;
- `blend`: chats with gaps, document questions and a scan, all at once;
- `scan-burst`: agent loops, and halfway through a burst of one-off prompts at ten times
  the agents' rate;
- `drift`: zipf-docs whose popularity ranking is drawn anew four times over the run.

Each part draws its tokens from its own seed, so parts share no prefix by chance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from radixserve.benchmark import families
from radixserve.benchmark.workloads import Workload


def merged(name: str, parts: list[tuple[Workload, float]]) -> Workload:
    """One workload of `parts` in arrival order, each part's arrivals shifted by its offset
    (seconds); every request re-indexed and its parent with it."""
    timed = sorted(((request.arrival_time + offset, k, request) for k, (part, offset) in enumerate(parts)
                    for request in part.requests), key=lambda item: (item[0], item[1], item[2].index))
    index_of = {(k, request.index): i for i, (_, k, request) in enumerate(timed)}
    requests = [replace(request, index=i, arrival_time=at,
                        parent=None if request.parent is None else index_of[(k, request.parent)])
                for i, (at, k, request) in enumerate(timed)]
    return Workload(name, requests, {"parts": [part.name for part, _ in parts]})


def _last_arrival(workload: Workload) -> float:
    return max(request.arrival_time for request in workload.requests)


def phases(token_scale: float, count_scale: float) -> Workload:
    """Documents, chats, other documents, a scan: one after another."""
    parts = [families.zipf_docs(scale=count_scale, token_scale=token_scale, seed=11),
             families.chat_crowd(scale=count_scale, token_scale=token_scale, seed=12),
             families.zipf_docs(scale=count_scale, token_scale=token_scale, seed=13),
             families.scan(scale=count_scale, token_scale=token_scale, seed=14)]
    offsets, start = [], 0.0
    for part in parts:
        offsets.append(start)
        start += _last_arrival(part) + 1.0
    return merged("phases", list(zip(parts, offsets)))


def blend(token_scale: float, count_scale: float) -> Workload:
    """Chats with gaps, document questions and a scan at once."""
    return merged("blend", [(families.chat_gaps(scale=count_scale, token_scale=token_scale, seed=21), 0.0),
                            (families.zipf_docs(scale=count_scale, token_scale=token_scale, seed=22, rate=1.0), 0.0),
                            (families.scan(scale=count_scale, token_scale=token_scale, seed=23, rate=0.5), 0.0)])


def scan_burst(token_scale: float, count_scale: float) -> Workload:
    """Agent loops, and a burst of one-off prompts halfway through."""
    agents = families.agent_tools(scale=count_scale, token_scale=token_scale, seed=31)
    burst = families.scan(scale=count_scale, token_scale=token_scale, seed=32, rate=40.0)
    return merged("scan-burst", [(agents, 0.0), (burst, _last_arrival(agents) / 2)])


def drift(token_scale: float, count_scale: float, shifts: int = 4) -> Workload:
    """zipf-docs whose popularity ranking is drawn anew `shifts` times: each phase asks
    about the documents of the ranks the first drew, in a new order."""
    base = families.zipf_docs(scale=count_scale, token_scale=token_scale, seed=7)
    documents: dict[int, np.ndarray] = {}
    for request in base.requests:
        documents.setdefault(request.group_id, request.prompt_ids[:request.shared_len])
    ids = sorted(documents)
    rng = np.random.default_rng(7)
    rankings = [dict(zip(ids, rng.permutation(ids).tolist())) for _ in range(shifts)]
    requests = []
    for request in base.requests:
        doc = rankings[request.index * shifts // len(base.requests)][request.group_id]
        question = request.prompt_ids[request.shared_len:]
        requests.append(replace(request, prompt_ids=np.concatenate([documents[doc], question]), group_id=doc,
                                shared_len=len(documents[doc])))
    return Workload("drift", requests, dict(base.params, shifts=shifts))


HELD_OUT: dict[str, Callable[[float, float], Workload]] = {
    "phases": phases, "blend": blend, "scan-burst": scan_burst, "drift": drift}

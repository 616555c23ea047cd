"""The `tools` benchmark workload: agents whose prompts carry a toolset block every step."""

from __future__ import annotations

import numpy as np

from radixserve.benchmark.workloads import make_workload, tool_agents


def test_each_step_extends_the_last_prompt_and_reply() -> None:
    w = tool_agents(num_agents=3, num_steps=4, num_toolsets=2, system_len=16, tools_len=32, task_len=8,
                    call_len=4, result_len=6, vocab_size=500)
    assert len(w.requests) == 12 and make_workload("tools", vocab_size=500).name == "tools"
    for r in w.requests:
        assert r.shared_len == 48
        if r.parent is not None:
            parent = w.requests[r.parent]
            assert parent.client_id == r.client_id
            prefix = np.concatenate([parent.prompt_ids, parent.output_ids])
            assert np.array_equal(r.prompt_ids[: len(prefix)], prefix)
            assert len(r.prompt_ids) == len(prefix) + 6
    firsts = w.requests[:3]
    assert np.array_equal(firsts[0].prompt_ids[:48], firsts[2].prompt_ids[:48])  # same toolset
    assert np.array_equal(firsts[0].prompt_ids[:16], firsts[1].prompt_ids[:16])  # same system prompt
    assert firsts[0].prompt_ids[16] != firsts[1].prompt_ids[16]  # other toolset


def test_unstable_tool_rendering_breaks_the_prefix_after_the_system_prompt() -> None:
    w = tool_agents(num_agents=2, num_steps=3, system_len=16, tools_len=32, task_len=8, call_len=4,
                    result_len=6, stable_tools=False, vocab_size=500)
    for r in w.requests:
        if r.parent is not None:
            parent = w.requests[r.parent]
            assert np.array_equal(r.prompt_ids[:16], parent.prompt_ids[:16])
            assert r.prompt_ids[16] != parent.prompt_ids[16]
            assert np.array_equal(r.prompt_ids[17:48], parent.prompt_ids[17:48])

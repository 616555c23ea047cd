"""The README's test command (`-n 2 --dist loadgroup`) keeps the tests that start Ray, and the
real-model modules, each on one worker (tests/conftest.py marks them). pytest-xdist does so by
writing each group into the test's id; under pytest 9.2 that write no longer took, silently:
Ray and the real model then started on both workers, about 90 s more a run (pyproject.toml
pins pytest below 9.2). This fails the run instead of slowing it."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("group_check")
def test_loadgroup_puts_the_group_in_the_test_id(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@group_check"), (
        f"{request.node.nodeid}: --dist loadgroup did not group this test; this pytest and "
        "pytest-xdist do not work together (see pyproject.toml)")

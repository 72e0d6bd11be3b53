"""Shared fixtures: hypothesis profiles and the engines every engine test runs on."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import pargrad

# `dev` for quick local runs; `ci` (selected by the CI environment variable) runs more
# examples, derandomized so that a CI failure reproduces.
settings.register_profile(
    "dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# Every engine test runs on each of these; later engines join the list.
ENGINES = {"sequential": pargrad.SequentialEngine}


@pytest.fixture(params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest) -> pargrad.Engine:
    """An engine to run the test's backward calls on (also made current for the test)."""
    eng = ENGINES[request.param]()
    with pargrad.use_engine(eng):
        yield eng

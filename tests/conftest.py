"""Shared fixtures: hypothesis profiles and the engines every engine test runs on."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

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

# Every engine test runs on each of these. The threaded ones hand every node with more
# than one element to the ReadyQueue (handoff_threshold=2), so the tests' small graphs
# really run on several threads instead of inline on the caller.
ENGINES: dict[str, Callable[[], pargrad.Engine]] = {
    "sequential": pargrad.SequentialEngine,
    "threaded-1": lambda: pargrad.ThreadedEngine(workers=1),
    "threaded-4-handoff": lambda: pargrad.ThreadedEngine(workers=4, handoff_threshold=2),
    "threaded-deterministic": lambda: pargrad.ThreadedEngine(
        workers=3, deterministic=True, handoff_threshold=2),
}


# The engines that sum every buffer in the canonical order (docs/design.md §4): the
# reference, a threaded engine whose small graphs never leave the calling thread (it then
# runs nodes in the reference's order), and deterministic mode (any order, canonical sums).
CANONICAL = ["sequential", "threaded-1", "threaded-deterministic"]
# The engines that also run nodes in the reference's order.
IN_ORDER = ["sequential", "threaded-1"]


def _use(name: str) -> Iterator[pargrad.Engine]:
    eng = ENGINES[name]()
    with pargrad.use_engine(eng):
        yield eng
    if isinstance(eng, pargrad.ThreadedEngine):
        eng.shutdown()


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest) -> Iterator[pargrad.Engine]:
    """An engine to run the test's backward calls on (also made current for the test)."""
    yield from _use(request.param)


@pytest.fixture(params=CANONICAL)
def canonical_engine(request: pytest.FixtureRequest) -> Iterator[pargrad.Engine]:
    """Like ``engine``, over the engines that promise the canonical summation order."""
    yield from _use(request.param)


@pytest.fixture(params=IN_ORDER)
def in_order_engine(request: pytest.FixtureRequest) -> Iterator[pargrad.Engine]:
    """Like ``engine``, over the engines that run nodes in reverse creation order."""
    yield from _use(request.param)

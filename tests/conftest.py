"""Shared fixtures: hypothesis profiles and the engines every engine test runs on."""

from __future__ import annotations

import os
import signal
import sys
import time
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
    # handoff_branch=0: its small graphs stay on the calling thread without the GIL too.
    "threaded-1": lambda: pargrad.ThreadedEngine(workers=1, handoff_branch=0),
    "threaded-4-handoff": lambda: pargrad.ThreadedEngine(workers=4, handoff_threshold=2),
    "threaded-deterministic": lambda: pargrad.ThreadedEngine(
        workers=3, deterministic=True, handoff_threshold=2),
    # Small nodes handed off at forks whose branches have 3 nodes or more: the policy
    # that a free-threaded Python uses by default (at 32 nodes), on every interpreter.
    "threaded-branches": lambda: pargrad.ThreadedEngine(workers=2, handoff_branch=3),
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


# ----- Ctrl-C: tests that send SIGINT get Python's own handler -----
# A process started with SIGINT ignored (a background job, some CI runners) passes that
# on, and pargrad rightly leaves an ignored SIGINT alone: the tests that check what a
# Ctrl-C does are marked ``sigint`` and run with Python's default handler installed.

def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "sigint: sends SIGINT; runs with Python's default SIGINT handler")


@pytest.fixture(autouse=True)
def _default_sigint_for_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("sigint") is None:
        yield
        return
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, found)


# ----- race rounds: the concurrency tests again, under a tiny switch interval -----
# Every test of these files is run again RACE_ROUNDS times with
# sys.setswitchinterval(1e-6) (the interpreter switches threads about every bytecode, so
# interleavings that are rare at the default 5 ms happen), after the whole suite, round by
# round (round 1 of every test before round 2 of any), within a time budget: a round's
# copy is skipped once PARGRAD_RACE_BUDGET seconds (default 200: all 10 rounds take about
# 150 s on this 2-core machine; 0 turns the rounds off) have gone to race rounds, or if
# its test took over RACE_SLOW s in the normal run.
RACE_FILES = {"test_async.py", "test_concurrency.py", "test_threaded.py",
              "test_engine_lifecycle.py", "test_blas_gate.py", "test_reliability.py",
              "test_intra_op.py", "test_memory_budget.py", "test_optim.py", "test_undo.py",
              "test_memory.py", "test_capture.py"}
RACE_ROUNDS = 10
RACE_SLOW = 1.0
_race_round = pytest.StashKey[int]()
_race_spent = [0.0]
_normal_took: dict[str, float] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if float(os.environ.get("PARGRAD_RACE_BUDGET", "200")) <= 0:
        return
    rounds: list[list[pytest.Item]] = [[] for _ in range(RACE_ROUNDS)]
    for item in items:
        if not isinstance(item, pytest.Function) or item.path.name not in RACE_FILES:
            continue
        for k in range(1, RACE_ROUNDS + 1):
            copy = pytest.Function.from_parent(
                item.parent, name=f"{item.name}@race{k}",
                callspec=getattr(item, "callspec", None), callobj=item.obj,
                keywords=item.keywords, fixtureinfo=item._fixtureinfo,
                originalname=item.originalname)
            copy.stash[_race_round] = k
            rounds[k - 1].append(copy)
    for copies in rounds:
        items.extend(copies)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    k = item.stash.get(_race_round, 0)
    if not k:
        start = time.monotonic()
        try:
            return (yield)
        finally:
            _normal_took[item.nodeid] = time.monotonic() - start
    normal = item.nodeid.replace(f"@race{k}", "")
    budget = float(os.environ.get("PARGRAD_RACE_BUDGET", "200"))
    if _normal_took.get(normal, RACE_SLOW + 1) > RACE_SLOW:
        pytest.skip("race round: the test is too slow for the race budget (or did not run)")
    if _race_spent[0] >= budget:
        pytest.skip(f"race rounds: the {budget:.0f} s budget is spent")
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    start = time.monotonic()
    try:
        return (yield)
    finally:
        sys.setswitchinterval(previous)
        _race_spent[0] += time.monotonic() - start

"""The peer suite: PyTorch's own engine tests, ported, run on every engine configuration.

Every test in this folder runs once per entry of ``ENGINES`` (an autouse fixture makes
the engine current for the test's thread): the reference, the threaded engine as users
get it, and the threaded engine handing every node to its workers (so nodes of one
backward really run concurrently, also for these tests' tiny graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import pargrad

ENGINES: dict[str, Callable[[], pargrad.Engine]] = {
    "sequential": pargrad.SequentialEngine,
    "threaded": pargrad.ThreadedEngine,
    "threaded-handoff1": lambda: pargrad.ThreadedEngine(handoff_threshold=1),
}


@pytest.fixture(params=list(ENGINES), autouse=True)
def engine(request: pytest.FixtureRequest) -> Iterator[pargrad.Engine]:
    """The engine the test's backward calls run on (current for the test's thread and
    the process-wide default, so that threads a test starts use it too)."""
    eng = ENGINES[request.param]()
    previous = pargrad.get_default_engine()
    pargrad.set_default_engine(eng)
    try:
        with pargrad.use_engine(eng):
            yield eng
    finally:
        pargrad.set_default_engine(previous)
        if isinstance(eng, pargrad.ThreadedEngine):
            eng.shutdown()

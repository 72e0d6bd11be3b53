"""The parity suite: what a ``torch.autograd`` user relies on, checked on every engine.

Each test here states one behaviour that pargrad shares with ``torch.autograd`` (or, when
marked ``differs``, one place where pargrad deliberately behaves otherwise: the test then
checks pargrad's own behaviour, and docs/autograd.md gives the reason). torch is never
imported: the expected values are worked out by hand or by plain numpy.

Every test runs once per entry of ``ENGINES``, made both the thread's engine and the
process-wide default (so that threads a test starts use it too):

- ``sequential``: the reference engine;
- ``threaded``: ``ThreadedEngine()`` as users get it (small graphs stay on the caller);
- ``threaded-handoff1``: every node handed to the workers' ready queue, so that the
  nodes of one backward really run on several threads, even in these tiny graphs.
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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "differs(reason): checks a deliberate difference from torch.autograd "
        "(listed in docs/autograd.md's table)")


@pytest.fixture(params=list(ENGINES), autouse=True)
def engine(request: pytest.FixtureRequest) -> Iterator[pargrad.Engine]:
    """The engine under test, current for this thread and the default for others."""
    made = ENGINES[request.param]()
    before = pargrad.get_default_engine()
    pargrad.set_default_engine(made)
    try:
        with pargrad.use_engine(made):
            yield made
    finally:
        pargrad.set_default_engine(before)
        if isinstance(made, pargrad.ThreadedEngine):
            made.shutdown()

"""examples/async_training.py: the asynchronous loop (next batch prepared during the
backward, SGD in post-accumulate-grad hooks) ends where the synchronous loop ends.
examples/digits.py: pargrad.nn learns scikit-learn's digits."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

import pargrad
from examples.async_training import Task, async_loop, sync_loop
from tests.conftest import ENGINES

SMALL = Task(batch=16, sizes=(12, 8, 8, 3), augment=1)


def train(loop: object, engine: pargrad.Engine) -> tuple[list[float], list[np.ndarray]]:
    params = SMALL.parameters()
    losses = loop(SMALL, params, 4, engine)  # type: ignore[operator]
    return losses, [p.data for p in params]


def test_async_loop_is_bitwise_the_sync_loop_on_the_deterministic_engine() -> None:
    with pargrad.ThreadedEngine(workers=2, deterministic=True, handoff_threshold=2) as eng:
        sync_losses, sync_params = train(sync_loop, pargrad.SequentialEngine())
        async_losses, async_params = train(async_loop, eng)
    assert async_losses == sync_losses
    for a, s in zip(async_params, sync_params):
        np.testing.assert_array_equal(a, s)
    assert sync_losses[-1] < sync_losses[0]  # it trains


@pytest.mark.parametrize("name", list(ENGINES))
def test_async_loop_matches_the_sync_loop_on_every_engine(name: str) -> None:
    engine = ENGINES[name]()
    try:
        sync_losses, sync_params = train(sync_loop, pargrad.SequentialEngine())
        async_losses, async_params = train(async_loop, engine)
    finally:
        if isinstance(engine, pargrad.ThreadedEngine):
            engine.shutdown()
    np.testing.assert_allclose(async_losses, sync_losses, rtol=1e-5)
    for a, s in zip(async_params, sync_params):
        np.testing.assert_allclose(a, s, rtol=1e-4, atol=1e-6)


# ----- examples/digits.py: pargrad.nn on scikit-learn's bundled 8x8 digits -----
def test_digits_reaches_a_real_test_accuracy_in_a_few_epochs() -> None:
    pytest.importorskip("sklearn")
    from examples.digits import train

    model, history = train(epochs=4, progress=False)
    assert len(history.loss) == len(history.test_accuracy) == 4
    assert history.test_accuracy[-1] >= 0.93  # of 450 held-out images; 10 classes
    assert history.loss[-1] < 0.5 * history.loss[0]
    assert not model.training  # evaluated in eval mode: dropout off


def test_digits_prints_its_accuracy_and_saves_the_plot(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    from examples.digits import main

    plot = tmp_path / "digits.png"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["--epochs", "2", "--plot", str(plot)]) == 0
    assert re.search(r"test accuracy 0\.\d{3} after 2 epochs", out.getvalue())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

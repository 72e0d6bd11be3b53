"""``pargrad.autograd.queue_undo``: what a post-accumulate-grad hook queues runs when its
backward fails (newest first, before the early ``.grad`` commits are restored), never
when it succeeds, and raises where it is called outside such a hook; ``undo_may_run``
says which of those it is. Every test that runs a backward runs on every engine, but
the one that cancels (on a threaded engine)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError

import numpy as np
import pytest

import pargrad
from pargrad.autograd import queue_undo, undo_may_run
from tests.helpers import Boom, blocking_function, release_once_cancelled

WAIT = 30  # seconds: a generous bound on anything these tests wait for


def fail() -> None:
    raise ValueError("late failure")


def failing_at_the_end(loss: pargrad.Tensor) -> pargrad.Tensor:
    """``loss``, whose backward fails once every node and hook of it has run."""
    loss.register_hook(lambda g: pargrad.queue_callback(fail))
    return loss


def test_queue_undo_outside_a_hook_raises() -> None:
    with pytest.raises(RuntimeError, match="only be called from a post-accumulate-grad hook"):
        queue_undo(lambda: None)
    with pytest.raises(RuntimeError, match="undo_may_run can only be called from a post-"):
        undo_may_run()
    with pytest.raises(TypeError, match="takes a callable, got int"):
        queue_undo(3)  # type: ignore[arg-type]
    x = pargrad.tensor([1.0], requires_grad=True)
    x.register_hook(lambda g: queue_undo(lambda: None))  # a tensor hook is not one
    with pytest.raises(pargrad.BackwardError, match="only be called from a post-accumulate"):
        (x * 2).sum().backward()


def test_nothing_is_undone_after_a_success(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    undone: list[str] = []
    w.register_post_accumulate_grad_hook(lambda t: queue_undo(lambda: undone.append("w")))
    (w * 3).sum().backward()
    assert undone == [] and w.grad.data.tolist() == [3.0, 3.0]


def test_a_failure_runs_the_queued_functions_newest_first_before_grads_are_restored(
        engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    old = pargrad.tensor([10.0, 10.0])
    w.grad = old
    seen: list[tuple[str, list[float] | None]] = []

    def grad_now() -> list[float] | None:
        return None if w.grad is None else w.grad.data.tolist()

    def hook(t: pargrad.Tensor) -> None:
        queue_undo(lambda: seen.append(("first", grad_now())))
        queue_undo(lambda: seen.append(("second", grad_now())))

    w.register_post_accumulate_grad_hook(hook)
    with pytest.raises(ValueError, match="late failure"):
        failing_at_the_end((w * 3).sum()).backward()
    # undone newest first, while .grad still holds the early commit; then restored
    assert seen == [("second", [13.0, 13.0]), ("first", [13.0, 13.0])]
    assert w.grad is old and old.data.tolist() == [10.0, 10.0]


def test_an_undo_that_puts_back_a_cleared_grad_lets_the_restore_see_it(
        engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0], requires_grad=True)

    def hook(t: pargrad.Tensor) -> None:
        grad = t.grad
        queue_undo(lambda: setattr(t, "grad", grad))
        t.grad = None  # as an optimizer's update during backward frees it

    w.register_post_accumulate_grad_hook(hook)
    (w * 2).sum().backward()
    assert w.grad is None  # success: cleared
    old = pargrad.tensor([5.0])
    w.grad = old
    with pytest.raises(ValueError):
        failing_at_the_end((w * 2).sum()).backward()
    assert w.grad is old  # the undo put back the early commit, the restore the old one


def test_a_raising_undo_still_lets_the_others_run(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0], requires_grad=True)
    ran: list[str] = []

    def broken() -> None:
        ran.append("broken")
        raise KeyError("undo failed")

    def hook(t: pargrad.Tensor) -> None:
        queue_undo(lambda: ran.append("older"))
        queue_undo(broken)

    w.register_post_accumulate_grad_hook(hook)
    with pytest.raises(KeyError, match="undo failed") as raised:
        failing_at_the_end((w * 2).sum()).backward()
    assert ran == ["broken", "older"] and w.grad is None
    assert isinstance(raised.value.__context__, ValueError)  # the backward's own error


@pytest.mark.parametrize("undo, error", [(lambda: None, ValueError),
                                         (lambda: {}["missing"], KeyError)])
def test_async_failures_run_the_undo_and_resolve_the_future(
        engine: pargrad.Engine, undo: Callable[[], object], error: type) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    ran: list[bool] = []

    def hook(t: pargrad.Tensor) -> None:
        queue_undo(lambda: (ran.append(True), undo()))

    w.register_post_accumulate_grad_hook(hook)
    future = pargrad.backward_async(failing_at_the_end((w * 2).sum()))
    assert isinstance(future.exception(timeout=30), error)  # resolved, also when the
    assert ran == [True] and w.grad is None                 # undo raised


def test_a_node_failing_undoes_the_hooks_that_ran(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    changed, undone = [], []

    def hook(t: pargrad.Tensor) -> None:
        queue_undo(lambda: undone.append(True))
        changed.append(True)

    w.register_post_accumulate_grad_hook(hook)
    bad = Boom.apply(pargrad.tensor(np.ones(2), requires_grad=True)).sum()
    with pytest.raises(pargrad.BackwardError, match="BoomBackward"):
        (bad + (w * 2).sum()).backward()  # w's nodes are newer: may run before Boom's
    assert undone == changed and w.grad is None


def test_undo_may_run_until_the_backward_commits_or_is_undone(engine: pargrad.Engine) -> None:
    w = pargrad.tensor([1.0], requires_grad=True)
    asked: list[Callable[[], bool]] = []
    answers: list[tuple[str, bool]] = []

    def hook(t: pargrad.Tensor) -> None:
        queue_undo(lambda: answers.append(("undoing", asked[-1]())))
        asked.append(undo_may_run())
        answers.append(("hook", asked[-1]()))

    w.register_post_accumulate_grad_hook(hook)
    (w * 2).sum().backward()
    assert answers == [("hook", True)] and not asked[0]()  # committed: never runs now
    with pytest.raises(ValueError, match="late failure"):
        failing_at_the_end((w * 2).sum()).backward()
    assert answers[1:] == [("hook", True), ("undoing", True)]
    assert not asked[1]()  # undone: it has run
    assert not asked[0]()


def test_a_cancel_whose_undo_raises_resolves_with_that_error() -> None:
    """cancel() returns True, yet the future is not cancelled: it carries the undo's
    exception, whose context says that it was cancelled."""
    block = blocking_function(WAIT)
    w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    hooked = threading.Event()

    def broken() -> None:
        raise KeyError("undo failed")

    def hook(t: pargrad.Tensor) -> None:
        queue_undo(broken)
        hooked.set()

    w.register_post_accumulate_grad_hook(hook)
    try:
        with pargrad.ThreadedEngine(workers=2, handoff_threshold=1) as engine:
            slow = block.apply(pargrad.tensor(np.ones(3), requires_grad=True)).sum()
            future = pargrad.backward_async(slow + (w * 2).sum(), engine=engine)
            assert block.started.wait(WAIT) and hooked.wait(WAIT)  # still in flight
            release_once_cancelled(future, block)
            assert future.cancel()
            assert future.done() and not future.cancelled()
            error = future.exception()
            assert repr(error) == "KeyError('undo failed')"
            assert isinstance(error.__context__, CancelledError)
            with pytest.raises(KeyError, match="undo failed"):
                future.result()
    finally:
        block.release.set()
    assert w.grad is None  # the early commit was restored all the same

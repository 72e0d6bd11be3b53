"""Fork safety (issue #18 item 3, pargrad/fork.py): a child process made by os.fork or a
multiprocessing fork pool uses the default engine and the engines it inherited, even
when the parent was busy with backward calls at the moment of the fork. Every child is
waited for under a deadline: a hang is a failure, never a hung test run."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Tensor
from tests.helpers import blocking_function, run_python

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

CHILD_DEADLINE = 20.0  # seconds a child may take before it counts as hung


def leaf(value: Any) -> Tensor:
    return pargrad.tensor(value, requires_grad=True)


def child_work() -> int:
    """What each child does: a backward on the default engine with a node on device
    cpu:1 (whose workers were the parent's), and an asynchronous backward that nobody
    helps (only polled). Returns 0 if every gradient is right."""
    x = leaf([1.0, 2.0, 3.0])
    ((x.to("cpu:1") * 2).to("cpu") * x).sum().backward()
    if not np.array_equal(x.grad.data, [4.0, 8.0, 12.0]):
        return 3
    y = leaf([1.0, 2.0])
    future = pargrad.backward_async((y * y).sum())
    deadline = time.monotonic() + CHILD_DEADLINE / 2
    while not future.done():  # nobody waits in result(): only the workers run it
        if time.monotonic() > deadline:
            return 4
        time.sleep(0.001)
    return 0 if np.array_equal(y.grad.data, [2.0, 4.0]) else 5


def wait_child(pid: int) -> int | None:
    """The child's exit status, or None if it did not exit in time (then it is killed)."""
    deadline = time.monotonic() + CHILD_DEADLINE
    try:
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.002)
    except BaseException:  # the test itself timed out: leave no child behind
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


HUNG: list[str] = []  # the stacks of hung children, for the failure message


def fork_and_run(work: Any) -> int | None:
    with tempfile.TemporaryFile("w+") as stacks:
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:  # a hung child writes its stacks before the parent kills it
                faulthandler.dump_traceback_later(CHILD_DEADLINE * 0.75, exit=True,
                                                  file=stacks)
                code = work()
            finally:
                os._exit(code)
        code = wait_child(pid)
        if code is None or code == 1:
            stacks.seek(0)
            HUNG.append(stacks.read()[-3000:])
        return code


def busy_parent(stop: threading.Event) -> None:
    """Backward calls on the default engine, back to back, that take every global lock
    (commit, hooks, a cpu:1 node, create_graph records nodes under grad_lock)."""
    w = leaf(np.ones(64))
    while not stop.is_set():
        h = w.register_hook(lambda g: g)
        loss = ((w.to("cpu:1") * w.to("cpu:1")).to("cpu") * w).sum()
        pargrad.backward(loss, create_graph=True)
        h.remove()
        pargrad.backward_async((w * 3).sum()).result(timeout=30)
        w.grad = None


def test_fork_while_another_thread_runs_backward_100_times() -> None:
    assert child_work() == 0  # the parent's own engines have started their workers
    stop = threading.Event()
    thread = threading.Thread(target=busy_parent, args=(stop,), daemon=True)
    thread.start()
    outcomes: dict[int | None, int] = {}
    try:
        for _ in range(100):
            code = fork_and_run(child_work)
            outcomes[code] = outcomes.get(code, 0) + 1
    finally:
        stop.set()
        thread.join(30)
    assert outcomes == {0: 100}, f"child exit codes (None: hung): {outcomes}\n{HUNG[:1]}"


Block = blocking_function(30)


def test_a_future_of_the_parent_fails_in_the_child_with_a_clear_error() -> None:
    Block.started.clear()
    Block.release.clear()
    x = leaf([1.0, 2.0])
    with pargrad.ThreadedEngine(workers=1) as engine:
        future = pargrad.backward_async(Block.apply(x).sum(), engine=engine)
        called: list[BaseException | None] = []
        assert Block.started.wait(30)

        def child() -> int:
            future.add_done_callback(lambda f: called.append(f.exception()))
            try:
                future.result(timeout=CHILD_DEADLINE / 2)
            except RuntimeError as exc:
                if "forked" not in str(exc) or len(called) != 1:
                    return 6
            except BaseException:
                return 7  # the old behaviour: TimeoutError, the backward never ends
            else:
                return 8
            if x.grad is not None:
                return 9
            # the engine it inherited runs a new backward, and shuts down
            y = leaf([3.0])
            (y * y).sum().backward(engine=engine)
            engine.shutdown()
            return 0 if np.array_equal(y.grad.data, [6.0]) else 10

        try:
            assert fork_and_run(child) == 0
        finally:
            Block.release.set()
        assert future.result(timeout=30) is None  # the parent's is unaffected
    np.testing.assert_array_equal(x.grad.data, [1.0, 1.0])


def pool_job(k: int) -> float:
    x = leaf([float(k), 1.0])
    ((x.to("cpu:1") * x.to("cpu:1")).to("cpu")).sum().backward()
    future = pargrad.backward_async((x * 2).sum())
    deadline = time.monotonic() + CHILD_DEADLINE / 2
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    return float(x.grad.data[0]) if future.done() else -1.0


def test_multiprocessing_fork_pool_runs_backward_jobs() -> None:
    assert child_work() == 0  # start the parent's workers, cpu:1's included
    context = multiprocessing.get_context("fork")
    with context.Pool(2) as pool:
        result = pool.map_async(pool_job, range(4))
        got = result.get(timeout=CHILD_DEADLINE * 2)
    assert got == [2.0 * k + 2.0 for k in range(4)]


def test_fork_while_a_parent_thread_holds_a_future_and_global_locks() -> None:
    """A parent thread inside a future's condition (resolving it, say) at the moment of
    the fork: the child's fork handler must not wait for it."""
    x = leaf([1.0, 2.0])
    future = pargrad.backward_async((x * x).sum())
    future.result(timeout=30)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with future._condition:  # type: ignore[attr-defined]
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert holding.wait(30)
    try:
        assert fork_and_run(child_work) == 0, HUNG[-1:]
    finally:
        release.set()
        thread.join(30)


def test_the_child_counts_only_its_own_thread_in_the_mode_counts() -> None:
    # A parent thread sits in no_grad under anomaly mode across the fork; it does not
    # exist in the child, so the child's counts are its own thread's alone.
    from pargrad import anomaly, grad_mode

    inside, release = threading.Event(), threading.Event()

    def parked() -> None:
        with pargrad.no_grad(), pargrad.detect_anomaly():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=parked, daemon=True)
    thread.start()
    assert inside.wait(10)

    def work() -> int:
        if (grad_mode.off, anomaly.on) != (0, 0):
            return 2
        with pargrad.no_grad():
            if (grad_mode.off, pargrad.is_grad_enabled()) != (1, False):
                return 3
        return 0 if (leaf(1.0) * 2).grad_fn is not None and grad_mode.off == 0 else 4

    try:
        assert fork_and_run(work) == 0
    finally:
        release.set()
        thread.join(10)


SWITCHING_HANDLERS = """
import os, sys

def switch_modes():  # what another library's fork handler might do
    import pargrad
    with pargrad.no_grad(), pargrad.detect_anomaly():
        pass

# Registered before pargrad's handlers: its before handler runs after pargrad's (while
# pargrad holds its global locks), its after_in_child handler before pargrad's (safe here,
# where no other thread holds a mode count's lock at the fork; fork.py's docstring).
os.register_at_fork(before=switch_modes, after_in_parent=switch_modes,
                    after_in_child=switch_modes)

import numpy as np
import pargrad
from pargrad import anomaly, grad_mode

x = pargrad.tensor([1.0, 2.0], requires_grad=True)
(x * x).sum().backward()
pid = os.fork()
if pid == 0:
    x.grad = None
    (x * 3).sum().backward()
    ok = np.array_equal(x.grad.data, [3.0, 3.0]) and (grad_mode.off, anomaly.on) == (0, 0)
    os._exit(0 if ok else 2)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_fork_handler_registered_before_pargrads_may_switch_modes() -> None:
    # The mode counts' locks are not taken before the fork, so a before handler that
    # runs after pargrad's (and so while pargrad holds its global locks) may enter
    # no_grad and detect_anomaly without deadlocking. A hang fails by the timeout.
    done = run_python(SWITCHING_HANDLERS, timeout=CHILD_DEADLINE * 3)
    assert done.returncode == 0, done.stderr[-3000:]

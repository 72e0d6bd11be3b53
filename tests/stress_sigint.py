"""Random Ctrl-C against the threaded engine (issue #18): SIGINT at random moments while
the main thread runs backward calls (a commit of many leaves, a graph of sleeping
nodes, ``backward_async`` + ``result()``) and a second thread runs its own on the same
engine. Counts hangs (a step past its deadline), partial commits, wrong gradients,
and how long a Ctrl-C took to reach the main thread's caller.

    python -m tests.stress_sigint --interrupts 300     # from the repository root

Exits non-zero on any hang, partial commit or wrong gradient. ``tests/test_interrupts``
runs a short version in the suite.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import pargrad
from pargrad import Tensor
from tests.helpers import sleeping_function

DEADLINE = 60.0  # seconds without progress that count as a hang (the run then exits)


Sleep = sleeping_function(0.002)


@dataclass
class Tally:
    interrupts: int = 0  # SIGINTs sent
    raised_in_backward: int = 0  # reached the caller as KeyboardInterrupt from the call
    after_call: int = 0  # landed after the call had returned
    committed_whole: int = 0  # interrupted calls whose .grad was committed whole
    committed_none: int = 0  # interrupted calls that committed nothing
    partial: int = 0
    wrong: int = 0
    other_calls: int = 0
    other_interrupted: int = 0  # the other caller's backward failed: main ran its node
    hangs: list[str] = field(default_factory=list)  # what did not complete in DEADLINE s
    latency_ms: list[float] = field(default_factory=list)  # SIGINT sent -> caught (sleeping)


def leaves_of(n: int, rng: np.random.Generator) -> list[Tensor]:
    return [pargrad.tensor(rng.normal(size=2), requires_grad=True) for _ in range(n)]


def workload(kind: str, rng: np.random.Generator) -> tuple[list[Tensor], Tensor, list[np.ndarray]]:
    """Leaves, a loss, and the gradient each leaf should get."""
    if kind == "commit":  # many leaves: the commit itself takes a while
        leaves = leaves_of(2000, rng)
        loss = pargrad.stack([(t * t).sum() for t in leaves]).sum()
        return leaves, loss, [2 * t.data for t in leaves]
    leaves = leaves_of(6, rng)  # sleeping nodes: most time is inside nodes or waits
    loss = sum((Sleep.apply(t * 3).sum() for t in leaves), pargrad.tensor(0.0))
    assert isinstance(loss, Tensor)
    return leaves, loss, [np.full(2, 3.0) for _ in leaves]


def other_caller(engine: pargrad.ThreadedEngine, stop: threading.Event, tally: Tally,
                 progress: list[float]) -> None:
    rng = np.random.default_rng(7)
    while not stop.is_set():
        leaves, loss, want = workload("sleep", rng)
        try:
            pargrad.backward(loss, engine=engine)
        except pargrad.BackwardError as exc:
            assert "interrupted by KeyboardInterrupt" in str(exc), exc
            tally.other_interrupted += 1
        else:
            if not all(np.array_equal(t.grad.data, w) for t, w in zip(leaves, want)):
                tally.wrong += 1
            tally.other_calls += 1
        progress[0] = time.monotonic()


def bounded(fn: Any) -> bool:
    """Run ``fn`` on a daemon thread; whether it returned within DEADLINE s."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    return not thread.is_alive()


def run(interrupts: int, seed: int = 0, workers: int = 2, watchdog: bool = True) -> Tally:
    """Send ``interrupts`` SIGINTs; with ``watchdog``, a step that makes no progress for
    DEADLINE s dumps every thread's stack and exits the process (a hang)."""
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    tally = Tally()
    main = threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    engine = pargrad.ThreadedEngine(workers=workers)
    stop = threading.Event()
    progress = [time.monotonic()]
    other = threading.Thread(target=other_caller, args=(engine, stop, tally, progress),
                             daemon=True)
    other.start()
    try:
        took = {}  # how long each kind of call takes: the interrupts spread over it
        for kind in ("commit", "sleep"):
            _, loss, _ = workload(kind, rng)
            start = time.monotonic()
            pargrad.backward(loss, engine=engine)
            took[kind] = time.monotonic() - start
        took["async"] = took["sleep"]
        while tally.interrupts < interrupts:
            if watchdog:  # re-armed each step: DEADLINE s without progress is a hang
                faulthandler.dump_traceback_later(DEADLINE, exit=True)
            kind = pick.choice(["commit", "sleep", "async"])
            leaves, loss, want = workload("sleep" if kind == "async" else kind, rng)
            delay = pick.uniform(0.0, 1.2 * took[kind])
            go, sent = threading.Event(), threading.Event()
            sent_at = [0.0]

            def send(delay: float = delay, go: threading.Event = go,
                     sent: threading.Event = sent, sent_at: list[float] = sent_at) -> None:
                go.wait()
                time.sleep(delay)
                sent_at[0] = time.monotonic()
                signal.pthread_kill(main.ident or 0, signal.SIGINT)
                sent.set()

            sender = threading.Thread(target=send, daemon=True)
            interrupted = False
            sender.start()
            go.set()
            try:
                if kind == "async":
                    pargrad.backward_async(loss, engine=engine).result(timeout=DEADLINE)
                else:
                    pargrad.backward(loss, engine=engine)
            except KeyboardInterrupt:
                caught = time.monotonic()
                interrupted = True
                tally.raised_in_backward += 1
                if kind != "commit":
                    tally.latency_ms.append((caught - sent_at[0]) * 1000.0)
            while not interrupted:  # it lands after the call returned
                try:
                    sent.wait(DEADLINE)
                    time.sleep(0.001)
                    break
                except KeyboardInterrupt:
                    tally.after_call += 1
                    break
            sender.join()
            tally.interrupts += 1
            changed = [t.grad is not None for t in leaves]
            if any(changed) and not all(changed):
                tally.partial += 1
            elif all(changed):
                if not all(np.array_equal(t.grad.data, w) for t, w in zip(leaves, want)):
                    tally.wrong += 1
                tally.committed_whole += interrupted
            else:
                tally.committed_none += 1
        if watchdog:
            faulthandler.cancel_dump_traceback_later()
        stop.set()
        other.join(DEADLINE)
        if other.is_alive():
            tally.hangs.append("the other caller")
        x = pargrad.tensor([1.0, 2.0], requires_grad=True)
        if not bounded(lambda: (x * x).sum().backward(engine=engine)):
            tally.hangs.append("the next backward")
        elif not np.array_equal(x.grad.data, [2.0, 4.0]):
            tally.wrong += 1
        if not bounded(lambda: engine.shutdown(wait=True)):
            tally.hangs.append("shutdown(wait=True)")
    finally:
        if watchdog:
            faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGINT, previous)
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interrupts", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.monotonic()
    tally = run(args.interrupts, args.seed)
    lat = sorted(tally.latency_ms)
    print(f"pid {os.getpid()}: {tally.interrupts} SIGINTs in {time.monotonic() - start:.1f} s; "
          f"hangs: {tally.hangs or 'none'} (a hang mid-run exits after {DEADLINE:.0f} s)")
    print(f"  raised from the call: {tally.raised_in_backward}, landed after it returned: "
          f"{tally.after_call}")
    print(f"  interrupted calls that committed everything: {tally.committed_whole}, "
          f"calls that committed nothing: {tally.committed_none}, partial commits: "
          f"{tally.partial}, wrong gradients: {tally.wrong}")
    print(f"  other caller: {tally.other_calls} backward calls right, "
          f"{tally.other_interrupted} failed because the main thread was interrupted in "
          f"one of its nodes")
    if lat:
        print(f"  Ctrl-C to KeyboardInterrupt on sleeping-node backward calls: median "
              f"{statistics.median(lat):.1f} ms, max {lat[-1]:.1f} ms ({len(lat)} calls)")
    return 1 if tally.partial or tally.wrong or tally.hangs else 0


if __name__ == "__main__":
    sys.exit(main())

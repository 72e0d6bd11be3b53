"""The callers workload: two threads, each running forward and backward of a graph of its
own on the default engine (no ``engine=``), against one thread doing the same.

Figures, as throughput of two threads over one (2 x one thread's time for its steps / the
time two threads take for as many steps each, medians of interleaved repeats):
- ``pargrad``: each step builds a chain of small ops (tanh, times a constant) on a
  100-element leaf, sums it, and calls ``backward()``;
- ``plain python``: the same number of steps of a loop of Python arithmetic, no numpy:
  the ceiling two threads of Python reach on this machine now;
- ``plain numpy``: the numpy calls of a step (forward and backward kernels), no pargrad.

With the GIL, none of the three gains from a second thread (about 1.0); without it, the
plain loops show what two cores give, and pargrad's ratio against them shows what its own
state shared between threads (sequence numbers, engine and pool bookkeeping) costs.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import pargrad
from benchmarks.measure import collected
from pargrad.ops.elementwise import tanh

NAME = "callers"
STEPS = {"full": 40, "quick": 20, "smoke": 2}  # per thread and repeat
OPS = 150  # ops per step's chain


def pargrad_step(x: np.ndarray) -> None:
    leaf = pargrad.tensor(x, requires_grad=True)
    h = leaf
    for i in range(OPS):
        h = pargrad.tanh(h) if i % 2 == 0 else h * 1.0001
    h.sum().backward()


_TANH_RULE = tanh.rules[0]


def numpy_step(x: np.ndarray) -> None:
    values = []
    h = x
    for i in range(OPS):
        if i % 2 == 0:
            h = np.tanh(h)
            values.append(h)
        else:
            h = h * 1.0001
    g = np.ones_like(h)
    for i in reversed(range(OPS)):
        g = _TANH_RULE(g, values[i // 2], None) if i % 2 == 0 else g * 1.0001


def python_step(_: np.ndarray) -> None:
    total = 0
    for i in range(20000):
        total += i * i % 7


STEP_FUNCTIONS: dict[str, Callable[[np.ndarray], None]] = {
    "pargrad": pargrad_step, "plain numpy": numpy_step, "plain python": python_step}
REPEAT = {"pargrad": 1, "plain numpy": 5, "plain python": 1}
"""Steps per pargrad step, so that each runs about as long (tens of ms on 2 cores): a
short run is mostly thread start-up and the machine's noise."""


def _run(step: Callable[[np.ndarray], None], threads: int, steps: int) -> float:
    """Seconds for ``threads`` threads to run ``steps`` steps each, all started together."""
    start = threading.Barrier(threads + 1)

    def body(seed: int) -> None:
        x = np.random.default_rng(seed).uniform(-1, 1, 100)
        start.wait()
        for _ in range(steps):
            step(x)

    pool = [threading.Thread(target=body, args=(k,)) for k in range(threads)]
    with collected():
        for thread in pool:
            thread.start()
        start.wait()
        began = time.perf_counter()
        for thread in pool:
            thread.join()
        return time.perf_counter() - began


def run_callers(mode: str, repeats: int) -> dict[str, Any]:
    """Medians of one and two threads per step function, and the two-thread speed-ups."""
    steps = STEPS[mode]
    times: dict[str, dict[int, list[float]]] = {
        name: {1: [], 2: []} for name in STEP_FUNCTIONS}
    for step in STEP_FUNCTIONS.values():  # warm: plans, caches, the workers
        _run(step, 2, 1)
    for _ in range(max(3, repeats)):
        for name, step in STEP_FUNCTIONS.items():
            for threads in (1, 2):
                times[name][threads].append(_run(step, threads, steps * REPEAT[name]))
    out: dict[str, Any] = {"steps": steps, "ops": OPS, "engine": repr(pargrad.get_default_engine())}
    for name, by_threads in times.items():
        one, two = statistics.median(by_threads[1]), statistics.median(by_threads[2])
        out[name] = {"one_thread_s": one, "two_threads_s": two, "speedup": 2 * one / two}
    out["pargrad / plain python"] = out["pargrad"]["speedup"] / out["plain python"]["speedup"]
    out["pargrad / plain numpy"] = out["pargrad"]["speedup"] / out["plain numpy"]["speedup"]
    return out


def print_callers(c: dict[str, Any]) -> None:
    print(f"\n{NAME}: each thread runs {c['steps']} steps (forward and backward of its own "
          f"{c['ops']}-op chain on {c['engine']}); throughput of two threads over one")
    for name in STEP_FUNCTIONS:
        row = c[name]
        print(f"  {name:14s} one thread {row['one_thread_s'] * 1e3:8.1f} ms   two threads "
              f"{row['two_threads_s'] * 1e3:8.1f} ms   speed-up {row['speedup']:.2f}x")
    print(f"  pargrad's speed-up / plain python's {c['pargrad / plain python']:.2f}, "
          f"/ plain numpy's {c['pargrad / plain numpy']:.2f}")

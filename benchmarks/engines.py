"""Backward-pass timings of pargrad's engines, measured against each other in one run.

Run: ``python -m benchmarks.engines [--quick] [--json FILE]``.

Only the backward pass is timed (``time.perf_counter`` around ``loss.backward``); the
forward graph is built fresh before every repeat, outside the timed region. Contenders
take turns within each repeat, after warm-up repeats, and each reports the median and
min/max over the repeats.

Contenders: ``SequentialEngine()`` (the reference), ``ThreadedEngine(workers=1)``,
``ThreadedEngine(workers=2)`` and ``ThreadedEngine(workers=1, limit_blas=True)`` (BLAS
limited to ``cores // (workers + 1)`` threads for the duration of each backward call).
``workers`` counts pool threads per device; the thread that calls backward runs nodes
too while it waits, so ``workers=1`` already means two threads executing nodes.

The ceiling. For each branchy workload, the "ceiling" runs exactly the numpy kernels of
its backward with no engine at all (and is checked to compute SequentialEngine's
gradient of ``x``), in three variants:

- ``ceiling(1 thread)``: inline on the calling thread, BLAS at its default;
- ``ceiling(2 threads)``: on 2 plain ``threading.Thread``s that each take half of the
  branches, BLAS at its default;
- ``ceiling(2 threads, BLAS 1)``: the same 2 threads inside
  ``threadpoolctl``'s ``limit(limits=1, user_api="blas")`` (what
  ``threadpool_limits(limits=1, user_api="blas")`` does, with the BLAS libraries looked
  up once before timing instead of on every call), set on entry and restored on exit by
  the calling thread, inside the timed region.

The ceiling's speed-up is SequentialEngine's median divided by the smaller median of
the two 2-thread variants: what two threads can give over the reference *as a user runs
it*, with BLAS at its default. Why this definition: comparing 1 with 2 ceiling threads at
default BLAS is no ceiling where BLAS already uses every core (two threads that each run
a multi-threaded matmul oversubscribe the cores and can be slower than one), while
comparing both at BLAS 1 would measure the speed-up over a slowed-down reference. The
raw ``ceiling(1 thread) / ceiling(2 threads...)`` ratios are reported too. Each ceiling
repeat starts after a pause of ``SETTLE_S`` (untimed) on workloads that call BLAS,
because OpenBLAS's own threads keep spinning for about 0.1-0.3 s after a multi-threaded
call and would otherwise slow the plain threads that follow the previous contender: the
ceiling is the most that two threads can give, from quiet cores. The engine contenders
get no such pause (their backward follows their forward, as a user runs it), so
``limit_blas`` still shares the cores with BLAS threads spun up by the forward.

For every ThreadedEngine contender, "threaded speed-up over sequential / ceiling
speed-up" (equivalently best 2-thread ceiling median / threaded median) should be >= 0.9.

Workloads:

- wide-matmul: 8 independent branches from one shared input leaf ``x`` (256x256
  float64); each branch is 6 x (matmul with its own weight leaf, then tanh), and the
  loss is the sum of the branches' ``.sum()``. Ceiling kernels: tanh rule
  ``g * (1 - ans*ans)``, matmul rules ``g @ w.T`` and ``x.T @ g``, the sum of the
  branch gradients into ``x``.
- wide-elementwise: 8 independent branches from one shared input leaf ``x``
  (1,000,000 float64 elements); each branch is 4 x (``tanh``, then ``* c_k`` with a
  constant of its own), and the loss is the sum of the branches' ``.sum()``. Ceiling
  kernels: multiply rule ``g * c_k``, tanh rule ``g * (1 - ans*ans)``, the sum of the
  branch gradients into ``x``. No BLAS: what limits two threads here is the GIL-free
  share of numpy's loops and memory bandwidth.
- tiny-chain: 3000 ops on 100-element arrays (``tanh`` and ``* 1.0001`` alternately):
  array work is negligible, so this measures engine overhead per node.
  ThreadedEngine / SequentialEngine should be <= 1.05.

The figures are ratios from a single run on a shared, noisy machine: compare numbers
within one run, not across runs or machines. BLAS threading changes the ceiling a lot
(see the machine facts printed first; try ``OPENBLAS_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController, threadpool_info

import pargrad

Backward = Callable[[], object]
"""The timed region: one backward pass."""
Setup = Callable[[], Backward]
"""Builds what one repeat needs (untimed) and returns its backward."""

BRANCHES, DEPTH, SIZE = 8, 6, 256
EW_BRANCHES, EW_DEPTH, EW_SIZE = 8, 4, 1_000_000
CHAIN_OPS, CHAIN_SIZE = 3000, 100
CHAIN_NODES = CHAIN_OPS + 1  # the ops and the final sum (leaf AccumulateGrad not counted)
SETTLE_S = 0.3
"""Untimed pause before each ceiling repeat of a BLAS workload (OpenBLAS threads spin)."""

SEQUENTIAL, THREADED_1, THREADED_2 = "sequential", "threaded(workers=1)", "threaded(workers=2)"
THREADED_1_BLAS = "threaded(workers=1, limit_blas)"
CEILING_1, CEILING_2 = "ceiling(1 thread)", "ceiling(2 threads)"
CEILING_2_BLAS1 = "ceiling(2 threads, BLAS 1)"
CEILINGS_2 = (CEILING_2, CEILING_2_BLAS1)

_blas = ThreadpoolController()


def machine_facts() -> dict[str, Any]:
    """Cores, Python, numpy and BLAS threading of this process."""
    facts: dict[str, Any] = {
        "cores": len(os.sched_getaffinity(0)),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "gil_enabled": getattr(sys, "_is_gil_enabled", lambda: True)(),
        "numpy": np.__version__,
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
    }
    facts["blas"] = [{key: pool.get(key) for key in
                      ("internal_api", "version", "architecture", "num_threads")}
                     for pool in threadpool_info()]
    return facts


def measure(contenders: dict[str, Setup], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per backward of each contender; contenders alternate within a repeat."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(warmup + repeats):
        for name, setup in contenders.items():
            backward = setup()
            gc.collect()
            start = time.perf_counter()
            backward()
            elapsed = time.perf_counter() - start
            if repeat >= warmup:
                samples[name].append(elapsed)
    return samples


# ----- the ceiling, shared by the branchy workloads -----
class Branchy:
    """A workload of ``branches`` independent branches from one leaf ``x``; subclasses
    give ``_branches``, the backward kernels of some of the branches without an engine."""

    branches: int
    calls_blas: bool

    def _branches(self, which: range, out: list[np.ndarray]) -> None:
        raise NotImplementedError

    def _run(self, threads: int) -> np.ndarray:
        parts: list[np.ndarray] = []
        shares = [range(i, self.branches, threads) for i in range(threads)]
        if threads == 1:
            self._branches(shares[0], parts)
        else:
            workers = [threading.Thread(target=self._branches, args=(share, parts))
                       for share in shares]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def run_ceiling(self, threads: int, blas_1: bool = False) -> np.ndarray:
        """The backward's kernels without an engine, inline for 1 thread, else on
        ``threads`` threading.Threads that take an equal share of the branches each;
        with ``blas_1``, inside a BLAS limit of 1 thread. Returns the gradient of x."""
        if blas_1:
            with _blas.limit(limits=1, user_api="blas"):
                return self._run(threads)
        return self._run(threads)

    def ceiling(self, threads: int, blas_1: bool = False) -> Setup:
        def setup() -> Backward:
            if self.calls_blas:
                time.sleep(SETTLE_S)  # let BLAS threads of earlier contenders go idle
            return functools.partial(self.run_ceiling, threads, blas_1)
        return setup

    def ceilings(self) -> dict[str, Setup]:
        return {CEILING_1: self.ceiling(1), CEILING_2: self.ceiling(2),
                CEILING_2_BLAS1: self.ceiling(2, blas_1=True)}


# ----- wide-matmul -----
class Wide(Branchy):
    """The wide-matmul workload: its arrays, and its backward with and without engines."""

    branches, calls_blas = BRANCHES, True

    def __init__(self, rng: np.random.Generator) -> None:
        self.x = rng.standard_normal((SIZE, SIZE))
        self.weights = [[rng.standard_normal((SIZE, SIZE)) / np.sqrt(SIZE)
                         for _ in range(DEPTH)] for _ in range(BRANCHES)]
        self.x_leaf = pargrad.tensor(self.x, requires_grad=True)
        self.w_leaves = [[pargrad.tensor(w, requires_grad=True) for w in branch]
                         for branch in self.weights]
        # Forward values for the ceiling: each layer's input and tanh output, per branch.
        self.values: list[list[tuple[np.ndarray, np.ndarray]]] = []
        for branch in self.weights:
            h, layers = self.x, []
            for w in branch:
                out = np.tanh(h @ w)
                layers.append((h, out))
                h = out
            self.values.append(layers)

    def engine(self, engine: pargrad.Engine) -> Setup:
        def setup() -> Backward:
            self.x_leaf.grad = None
            loss: pargrad.Tensor | None = None
            for branch in self.w_leaves:
                h = self.x_leaf
                for w in branch:
                    w.grad = None
                    h = pargrad.tanh(h @ w)
                # A left-deep chain of adds, as a loop summing the branches builds it.
                loss = h.sum() if loss is None else loss + h.sum()
            assert loss is not None
            return lambda: loss.backward(engine=engine)
        return setup

    def _branches(self, which: range, out: list[np.ndarray]) -> None:
        """The backward kernels of the branches ``which``; appends their summed x grad."""
        grad_x: np.ndarray | None = None
        weight_grads = []  # kept alive, as an engine keeps the leaves' gradients
        for b in which:
            g: np.ndarray = np.broadcast_to(np.float64(1.0), (SIZE, SIZE))  # sum rule
            for w, (h, ans) in zip(reversed(self.weights[b]), reversed(self.values[b])):
                g = g * (1 - ans * ans)       # tanh
                weight_grads.append(h.T @ g)  # matmul, right operand
                g = g @ w.T                   # matmul, left operand
            grad_x = g if grad_x is None else grad_x + g
        assert grad_x is not None
        out.append(grad_x)


# ----- wide-elementwise -----
class WideElementwise(Branchy):
    """The wide-elementwise workload: 8 branches of 4 x (tanh, * c_k) on 1e6 elements."""

    branches, calls_blas = EW_BRANCHES, False

    def __init__(self, rng: np.random.Generator) -> None:
        self.x = rng.standard_normal(EW_SIZE)
        self.constants = [0.9 + 0.025 * k for k in range(EW_BRANCHES)]
        self.x_leaf = pargrad.tensor(self.x, requires_grad=True)
        # Forward values for the ceiling: each layer's tanh output, per branch.
        self.values: list[list[np.ndarray]] = []
        for c in self.constants:
            y, layers = self.x, []
            for _ in range(EW_DEPTH):
                ans = np.tanh(y)
                layers.append(ans)
                y = ans * c
            self.values.append(layers)

    def engine(self, engine: pargrad.Engine) -> Setup:
        def setup() -> Backward:
            self.x_leaf.grad = None
            loss: pargrad.Tensor | None = None
            for c in self.constants:
                y = self.x_leaf
                for _ in range(EW_DEPTH):
                    y = pargrad.tanh(y) * c
                loss = y.sum() if loss is None else loss + y.sum()
            assert loss is not None
            return lambda: loss.backward(engine=engine)
        return setup

    def _branches(self, which: range, out: list[np.ndarray]) -> None:
        """The backward kernels of the branches ``which``; appends their summed x grad."""
        grad_x: np.ndarray | None = None
        for b in which:
            c = self.constants[b]
            g: np.ndarray = np.broadcast_to(np.float64(1.0), (EW_SIZE,))  # sum rule
            for ans in reversed(self.values[b]):
                g = g * c                 # multiply by the constant
                g = g * (1 - ans * ans)   # tanh
            grad_x = g if grad_x is None else grad_x + g
        assert grad_x is not None
        out.append(grad_x)


# ----- tiny-chain -----
def chain(engine: pargrad.Engine) -> Setup:
    x = pargrad.tensor(np.linspace(-1.0, 1.0, CHAIN_SIZE), requires_grad=True)

    def setup() -> Backward:
        x.grad = None
        y = x
        for i in range(CHAIN_OPS):
            y = pargrad.tanh(y) if i % 2 == 0 else y * 1.0001
        loss = y.sum()
        return lambda: loss.backward(engine=engine)
    return setup


# ----- report -----
def summary(samples: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    return {name: {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s),
                   "samples_s": s} for name, s in samples.items()}


def print_table(title: str, stats: dict[str, dict[str, Any]]) -> None:
    reference = stats[SEQUENTIAL]["median_s"]
    print(f"\n{title}")
    print(f"  {'contender':<33}{'median ms':>11}{'min ms':>10}{'max ms':>10}"
          f"{'seq/this':>10}")
    for name, s in stats.items():
        print(f"  {name:<33}{s['median_s'] * 1e3:>11.2f}{s['min_s'] * 1e3:>10.2f}"
              f"{s['max_s'] * 1e3:>10.2f}{reference / s['median_s']:>10.3f}")


def check_ceiling(workload: Wide | WideElementwise, sequential: pargrad.Engine) -> None:
    """The ceiling must compute what the engines compute."""
    workload.engine(sequential)()()
    assert workload.x_leaf.grad is not None
    expected = workload.x_leaf.grad.numpy()
    for threads, blas_1 in ((1, False), (2, False), (2, True)):
        np.testing.assert_allclose(workload.run_ceiling(threads, blas_1), expected,
                                   rtol=1e-10)
    workload.x_leaf.grad = None


def branchy_ratios(prefix: str, stats: dict[str, dict[str, Any]],
                   threaded: list[str]) -> tuple[dict[str, float], float]:
    """The ceiling figures of a branchy workload and each threaded contender against
    them; also returns the raw ceiling(1 thread) / ceiling(2 threads) ratio."""
    med = {name: s["median_s"] for name, s in stats.items()}
    best_2 = min(med[name] for name in CEILINGS_2)
    ceiling = med[SEQUENTIAL] / best_2
    raw = med[CEILING_1] / med[CEILING_2]
    ratios: dict[str, float] = {
        f"{prefix} ceiling(1 thread) / ceiling(2 threads)": raw,
        f"{prefix} ceiling(1 thread) / ceiling(2 threads, BLAS 1)":
            med[CEILING_1] / med[CEILING_2_BLAS1],
        f"{prefix} sequential / ceiling(1 thread)": med[SEQUENTIAL] / med[CEILING_1],
        f"{prefix} ceiling speed-up (sequential / best 2-thread ceiling)": ceiling,
    }
    for name in threaded:
        speedup = med[SEQUENTIAL] / med[name]
        ratios[f"{prefix} {name} speed-up over sequential"] = speedup
        ratios[f"{prefix} {name} speed-up / ceiling speed-up (target >= 0.9)"] = (
            speedup / ceiling)
    return ratios, raw


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    args = parser.parse_args(argv)
    repeats, warmup = (3, 1) if args.quick else (7, 2)

    facts = machine_facts()
    print("machine:")
    for key, value in facts.items():
        print(f"  {key}: {value}")
    print(f"repeats: {repeats} (after {warmup} warm-up), backward only, medians")

    sequential = pargrad.SequentialEngine()
    threaded = {THREADED_1: pargrad.ThreadedEngine(workers=1),
                THREADED_2: pargrad.ThreadedEngine(workers=2),
                THREADED_1_BLAS: pargrad.ThreadedEngine(workers=1, limit_blas=True)}
    engines: dict[str, pargrad.Engine] = {SEQUENTIAL: sequential, **threaded}
    try:
        wide = Wide(np.random.default_rng(0))
        check_ceiling(wide, sequential)
        wide_stats = summary(measure(
            {name: wide.engine(e) for name, e in engines.items()} | wide.ceilings(),
            repeats, warmup))
        del wide
        elementwise = WideElementwise(np.random.default_rng(1))
        check_ceiling(elementwise, sequential)
        ew_stats = summary(measure(
            {name: elementwise.engine(e) for name, e in engines.items()}
            | elementwise.ceilings(), repeats, warmup))
        del elementwise
        chain_stats = summary(measure({name: chain(e) for name, e in engines.items()},
                                      repeats, warmup))
    finally:
        for engine in threaded.values():
            engine.shutdown()

    wide_ratios, wide_raw = branchy_ratios("wide", wide_stats, list(threaded))
    ew_ratios, _ = branchy_ratios("elementwise", ew_stats, list(threaded))
    ratios = wide_ratios | ew_ratios
    for name, s in chain_stats.items():
        ratios[f"chain {name} us per node"] = s["median_s"] / CHAIN_NODES * 1e6
        if name != SEQUENTIAL:
            ratios[f"chain {name} / sequential (target <= 1.05)"] = (
                s["median_s"] / chain_stats[SEQUENTIAL]["median_s"])

    print_table(f"wide-matmul: {BRANCHES} branches x {DEPTH} x ({SIZE}x{SIZE} matmul + tanh)",
                wide_stats)
    print_table(f"wide-elementwise: {EW_BRANCHES} branches x {EW_DEPTH} x (tanh + * c) on "
                f"{EW_SIZE:,}-element arrays", ew_stats)
    print_table(f"tiny-chain: {CHAIN_OPS} ops on {CHAIN_SIZE}-element arrays", chain_stats)
    if wide_raw < 1:
        print("\nnote: wide ceiling(2 threads) at default BLAS is slower than 1 thread (BLAS"
              " threads already use\n      the cores, see 'blas' above); the ceiling speed-up"
              " uses the best 2-thread variant")
    print("\nratios:")
    width = max(len(key) for key in ratios) + 2
    for key, value in ratios.items():
        print(f"  {key:<{width}}{value:>8.3f}")

    if args.json:
        figures = {"machine": facts, "repeats": repeats, "warmup": warmup,
                   "settle_s": SETTLE_S, "wide-matmul": wide_stats,
                   "wide-elementwise": ew_stats, "tiny-chain": chain_stats,
                   "ratios": ratios}
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

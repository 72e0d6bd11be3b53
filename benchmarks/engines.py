"""Backward-pass timings of pargrad's engines, measured against each other in one run.

Run: ``python -m benchmarks.engines [--quick] [--json FILE]``.

Only the backward pass is timed (``time.perf_counter`` around ``loss.backward``); the
forward graph is built fresh before every repeat, outside the timed region. Contenders
take turns within each repeat, after warm-up repeats, and each reports the median and
min/max over the repeats.

Contenders: ``SequentialEngine()`` (the reference), ``ThreadedEngine(workers=1)`` and
``ThreadedEngine(workers=2)``. ``workers`` counts pool threads per device; the thread
that calls backward runs nodes too while it waits, so ``workers=1`` already means two
threads executing nodes.

Workloads:

- wide-matmul: 8 independent branches from one shared input leaf ``x`` (256x256
  float64); each branch is 6 x (matmul with its own weight leaf, then tanh), and the
  loss is the sum of the branches' ``.sum()``. The "ceiling" runs exactly the numpy
  kernels of this backward (tanh rule ``g * (1 - ans*ans)``, matmul rules ``g @ w.T``
  and ``x.T @ g``) with no engine: on 1 thread, and on 2 plain ``threading.Thread``s
  that each take half of the branches. Its speed-up is the most that two threads can
  give on this machine; "threaded speed-up / ceiling speed-up" should be >= 0.9.
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
import importlib
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

import pargrad

Backward = Callable[[], object]
"""The timed region: one backward pass."""
Setup = Callable[[], Backward]
"""Builds what one repeat needs (untimed) and returns its backward."""

BRANCHES, DEPTH, SIZE = 8, 6, 256
CHAIN_OPS, CHAIN_SIZE = 3000, 100
CHAIN_NODES = CHAIN_OPS + 1  # the ops and the final sum (leaf AccumulateGrad not counted)

SEQUENTIAL, THREADED_1, THREADED_2 = "sequential", "threaded(workers=1)", "threaded(workers=2)"
CEILING_1, CEILING_2 = "ceiling(1 thread)", "ceiling(2 threads)"


def machine_facts() -> dict[str, Any]:
    """Cores, Python, numpy and BLAS threading of this process."""
    facts: dict[str, Any] = {
        "cores": len(os.sched_getaffinity(0)),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "gil_enabled": getattr(sys, "_is_gil_enabled", lambda: True)(),
        "numpy": np.__version__,
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
    }
    try:
        threadpoolctl = importlib.import_module("threadpoolctl")
    except ImportError:
        facts["blas"] = "threadpoolctl not installed"
    else:
        facts["blas"] = [{key: pool.get(key) for key in
                          ("internal_api", "version", "architecture", "num_threads")}
                         for pool in threadpoolctl.threadpool_info()]
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


# ----- wide-matmul -----
class Wide:
    """The wide-matmul workload: its arrays, and its backward with and without engines."""

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

    def run_ceiling(self, threads: int) -> np.ndarray:
        """The backward's kernels without an engine, inline for 1 thread, else on
        ``threads`` threading.Threads that take an equal share of the branches each.
        Returns the gradient of x."""
        parts: list[np.ndarray] = []
        shares = [range(i, BRANCHES, threads) for i in range(threads)]
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

    def ceiling(self, threads: int) -> Setup:
        return lambda: functools.partial(self.run_ceiling, threads)


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
    print(f"  {'contender':<22}{'median ms':>11}{'min ms':>10}{'max ms':>10}"
          f"{'seq/this':>10}")
    for name, s in stats.items():
        print(f"  {name:<22}{s['median_s'] * 1e3:>11.2f}{s['min_s'] * 1e3:>10.2f}"
              f"{s['max_s'] * 1e3:>10.2f}{reference / s['median_s']:>10.3f}")


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
                THREADED_2: pargrad.ThreadedEngine(workers=2)}
    engines: dict[str, pargrad.Engine] = {SEQUENTIAL: sequential, **threaded}
    try:
        wide = Wide(np.random.default_rng(0))
        # The ceiling must compute what the engines compute.
        wide.engine(sequential)()()
        assert wide.x_leaf.grad is not None
        np.testing.assert_allclose(wide.run_ceiling(2), wide.x_leaf.grad.numpy(), rtol=1e-10)

        wide_contenders = {name: wide.engine(e) for name, e in engines.items()}
        wide_contenders |= {CEILING_1: wide.ceiling(1), CEILING_2: wide.ceiling(2)}
        wide_stats = summary(measure(wide_contenders, repeats, warmup))
        chain_stats = summary(measure({name: chain(e) for name, e in engines.items()},
                                      repeats, warmup))
    finally:
        for engine in threaded.values():
            engine.shutdown()

    med = {name: s["median_s"] for name, s in wide_stats.items()}
    ceiling = med[CEILING_1] / med[CEILING_2]
    ratios: dict[str, float] = {"wide ceiling speed-up (1 thread / 2 threads)": ceiling,
                                "wide sequential / ceiling(1 thread)": med[SEQUENTIAL]
                                / med[CEILING_1]}
    for name in threaded:
        speedup = med[SEQUENTIAL] / med[name]
        ratios[f"wide {name} speed-up over sequential"] = speedup
        ratios[f"wide {name} speed-up / ceiling speed-up (target >= 0.9)"] = speedup / ceiling
    for name, s in chain_stats.items():
        ratios[f"chain {name} us per node"] = s["median_s"] / CHAIN_NODES * 1e6
        if name != SEQUENTIAL:
            ratios[f"chain {name} / sequential (target <= 1.05)"] = (
                s["median_s"] / chain_stats[SEQUENTIAL]["median_s"])

    print_table(f"wide-matmul: {BRANCHES} branches x {DEPTH} x ({SIZE}x{SIZE} matmul + tanh)",
                wide_stats)
    print_table(f"tiny-chain: {CHAIN_OPS} ops on {CHAIN_SIZE}-element arrays", chain_stats)
    if ceiling < 1:
        print("\nnote: the 2-thread ceiling is slower than 1 thread (BLAS threads already use"
              " the cores?\n      see 'blas' above); rerun with OPENBLAS_NUM_THREADS=1")
    print("\nratios:")
    for key, value in ratios.items():
        print(f"  {key:<68}{value:>8.3f}")

    if args.json:
        figures = {"machine": facts, "repeats": repeats, "warmup": warmup,
                   "wide-matmul": wide_stats, "tiny-chain": chain_stats, "ratios": ratios}
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

"""Per-rule speed on large and small arrays: ``python -m benchmarks.rules [--quick]``.

Each row times one gradient rule three ways on the same float64 arrays, interleaved
call by call (medians over the rounds; ratios of medians):

- ``operators``: the rule written with operators, one temporary per operator (the form
  the rules had before issue 13, and still take below ``large.OUT_MIN`` elements);
- ``out=``: pargrad's rule with the fused kernels off (one fresh buffer from OUT_MIN up);
- ``fused``: pargrad's rule with the fused kernels on (numba installed only).

At 100 elements (10 rows of 10 for the row-wise rules) it shows what the rule's size
check costs the small arrays; from 10^5 up what one buffer and one pass save. Every
call allocates its result, as in a backward. A program, not a test (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pargrad.ops import elementwise as e
from pargrad.ops import fused, nn, reductions
from pargrad.ops.core import Op

# name -> (op, argument, the operator form of its rule, row-wise (a 2-D input))
CASES: dict[str, tuple[Op, int, Callable[..., Any], bool]] = {
    "tanh": (e.tanh, 0, lambda g, ans, x: g * (1 - ans * ans), False),
    "sigmoid": (e.sigmoid, 0, lambda g, ans, x: g * (ans * (1 - ans)), False),
    "relu": (e.relu, 0, lambda g, ans, x: g * (x > 0), False),
    "exp": (e.exp, 0, lambda g, ans, x: g * ans, False),
    "square": (e.square, 0, lambda g, ans, x: g * 2 * x, False),
    "divide/y": (e.divide, 1, lambda g, ans, x, y: -g * x / (y * y), False),
    "softmax": (nn._softmax_op, 0,
                lambda g, ans, x, *, axis: ans * (g - np.sum(g * ans, axis=axis, keepdims=True)),
                True),
    "log_softmax": (nn._log_softmax_op, 0,
                    lambda g, ans, x, *, axis: g - np.exp(ans) * np.sum(g, axis=axis,
                                                                        keepdims=True),
                    True),
    "logsumexp": (reductions._logsumexp_op, 0,
                  lambda g, ans, x, *, axis, keepdims:
                      np.expand_dims(g, axis) * np.exp(x - np.expand_dims(ans, axis)), True),
}


def _inputs(name: str, n: int, rng: np.random.Generator) -> tuple[tuple[Any, ...], Any, Any,
                                                                  dict[str, Any]]:
    op, _, _, row_wise = CASES[name]
    width = 10 if n <= 1000 else 1000
    shape = (n // width, width) if row_wise else (n,)
    args: tuple[Any, ...] = (rng.uniform(-2, 2, shape),)
    if name == "divide/y":
        args = (args[0], rng.uniform(0.5, 2, shape))
    params: dict[str, Any] = ({"axis": 1} if name in ("softmax", "log_softmax")
                              else {"axis": (1,), "keepdims": False} if name == "logsumexp"
                              else {})
    ans = np.asarray(op.forward(*args, **params))
    return args, ans, rng.standard_normal(ans.shape), params


def measure(name: str, n: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each way of running rule ``name`` on ``n`` elements."""
    op, argnum, operators, _ = CASES[name]
    args, ans, g, params = _inputs(name, n, np.random.default_rng(0))
    rule = op.rules[argnum]
    ways: dict[str, tuple[Callable[..., Any], bool]] = {"operators": (operators, False),
                                                        "out=": (rule, False)}
    if fused.available():
        ways["fused"] = (rule, True)
    calls = max(1, 2_000_000 // n)  # about 10 ms per timing on the small arrays
    times: dict[str, list[float]] = {way: [] for way in ways}
    order = list(ways)
    for _ in range(rounds + 1):  # the first round warms up (and compiles the kernels)
        order = order[1:] + order[:1]  # each way goes first in turn
        for way in order:
            run, on = ways[way]
            fused.set_enabled(on)
            start = time.perf_counter()
            for _ in range(calls):
                run(g, ans, *args, **params)
            times[way].append((time.perf_counter() - start) / calls)
    return {way: statistics.median(t[1:]) for way, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes 100 and 10^6, 5 rounds")
    parser.add_argument("--only", metavar="RULE,...", help=f"of: {', '.join(CASES)}")
    args = parser.parse_args()
    sizes = (100, 10**6) if args.quick else (100, 10**5, 10**6, 4 * 10**6)
    rounds = 5 if args.quick else 21
    names = args.only.split(",") if args.only else list(CASES)
    previous = fused.enabled()
    print(f"load average {os.getloadavg()[0]:.2f}; numba "
          f"{'installed' if fused.available() else 'not installed'}; medians of {rounds}")
    print(f"{'rule':<13}{'elements':>10}{'operators us':>14}{'out= us':>10}{'fused us':>10}"
          f"{'ops/out=':>10}{'ops/fused':>10}")
    try:
        for n in sizes:
            for name in names:
                t = measure(name, n, rounds)
                ops, out = t["operators"], t["out="]
                fast = t.get("fused")
                print(f"{name:<13}{n:>10,}{ops * 1e6:>14.2f}{out * 1e6:>10.2f}"
                      f"{'' if fast is None else f'{fast * 1e6:.2f}':>10}{ops / out:>10.2f}"
                      f"{'' if fast is None else f'{ops / fast:.2f}':>10}")
    finally:
        fused.set_enabled(previous)


if __name__ == "__main__":
    main()

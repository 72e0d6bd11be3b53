"""Python bytecode run per op and per node: ``python -m benchmarks.opcodes``.

Counts the bytecode instructions the interpreter executes (``sys.settrace`` with
``f_trace_opcodes``) for one recorded op of each kind the tiny-chain workload uses
(``tanh(x)``, ``x * 1.0001``) and ``x * w`` of two Tensors, and per node of a chain's
backward on the reference engine and on ``ThreadedEngine(workers=1)`` (which runs a chain
inline). numpy's own C work is not counted: only the Python around it.

Unlike a time, the count is the same on every run and on a busy machine, so it shows at
once what a hot-path change removed where timing noise (here ±20%) hides a 5% change. It
is a guide, not a time: on this machine the hot path's instructions average about 10 ns,
but a call, an allocation (and the garbage collection it brings) costs far more than a
tight loop's instruction (docs/performance.md); confirm a change by interleaved timing.
A program, not a test.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np

import pargrad


def count(call: Callable[[], Any]) -> collections.Counter[str]:
    """The bytecode instructions ``call()`` runs, by ``file:function``."""
    counts: collections.Counter[str] = collections.Counter()

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        # Set here too: from 3.12 on, the flag set at the call event takes effect only
        # once the frame's own trace function sets it (at its first line, before any opcode).
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"] += 1
        return local

    def start(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return local

    previous = sys.gettrace()  # a debugger's or coverage's, put back after
    sys.settrace(start)
    try:
        call()
    finally:
        sys.settrace(previous)
    return counts


def _chain(x: pargrad.Tensor, ops: int) -> pargrad.Tensor:
    y = x
    for i in range(ops):
        y = pargrad.tanh(y) if i % 2 == 0 else y * 1.0001
    return y.sum()


def measure(ops: int = 200) -> dict[str, tuple[float, collections.Counter[str]]]:
    """Per case: instructions per op (or node), and their split by function (totals)."""
    x = pargrad.tensor(np.linspace(-1.0, 1.0, 100), requires_grad=True)
    w = pargrad.tensor(np.linspace(0.5, 1.5, 100), requires_grad=True)
    y = pargrad.tanh(x)
    # Plans, interned metadata and w's accumulator made once, as in any longer run.
    warm = [pargrad.tanh(y), y * 1.0001, y * w]
    cases: dict[str, tuple[float, collections.Counter[str]]] = {}
    for name, call in (("forward tanh(x)", lambda: pargrad.tanh(y)),
                       ("forward x * 1.0001", lambda: y * 1.0001),
                       ("forward x * w", lambda: y * w)):
        counts = count(call)
        cases[name] = (sum(counts.values()) - counts["opcodes.py:<lambda>"], counts)
    for name, engine in (("backward per node, reference", pargrad.SequentialEngine()),
                         ("backward per node, threaded(1)", pargrad.ThreadedEngine(workers=1))):
        loss = _chain(x, ops)
        counts = count(lambda: loss.backward(engine=engine))  # noqa: B023 (called at once)
        cases[name] = (sum(counts.values()) / (ops + 1), counts)  # ops + the sum's node
    del warm
    return cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.opcodes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=6, help="functions shown per case")
    args = parser.parse_args(argv)
    for name, (per, counts) in measure().items():
        print(f"{name:32s} {per:7.1f} instructions")
        for where, n in counts.most_common(args.top):
            if where != "opcodes.py:<lambda>":
                print(f"    {where:40s} {n:8d}")


if __name__ == "__main__":
    main()

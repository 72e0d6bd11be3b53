"""``python -m benchmarks.training``: what updating the parameters during backward
(``Optimizer.step_in_backward``) buys over ``backward(); step(); zero_grad()``.

Two training steps (forward, backward and Adam's update, float32): an MLP, whose
layers' updates can overlap the backward of the layers below them, and a wide model
of independent branches, whose updates can also run beside each other. Each runs on
the reference engine (``SequentialEngine``) and on ``ThreadedEngine()`` as users get
it. The two ways of updating take turns within each repeat (interleaved, so that a
noisy stretch of time hits both alike), each on its own copy of the model; the first
repeats are dropped. The table gives the median time of a whole step and the ratio of
medians, plain / during backward (above 1: updating during backward is faster), and
checks that both copies end with the same bits; the page faults of a step (median,
each way) show memory the allocator gave back and touched again. The machine's facts (cores, numpy's
SIMD level, BLAS threads) come first. ``--json PATH`` saves everything; ``--tiny``
runs tiny sizes (the test suite's smoke test). Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import pargrad
from benchmarks.measure import cpu_model, minor_faults, simd
from pargrad.optim import Adam, Optimizer

Params = list[pargrad.Tensor]


@dataclass
class Workload:
    """A model: its parameters (made the same for the same seed), its loss on a batch,
    and the batches a run cycles through."""

    name: str
    make: Callable[[int], Params]
    loss: Callable[[Params, tuple[np.ndarray, np.ndarray]], pargrad.Tensor]
    batches: list[tuple[np.ndarray, np.ndarray]]


def _layers(rng: np.random.Generator, sizes: list[int]) -> Params:
    params = []
    for n_in, n_out in itertools.pairwise(sizes):
        params.append(pargrad.tensor(rng.normal(0, n_in ** -0.5, (n_in, n_out))
                                     .astype(np.float32), requires_grad=True))
        params.append(pargrad.zeros(n_out, dtype=np.float32, requires_grad=True))
    return params


def _forward(params: Params, h: pargrad.Tensor) -> pargrad.Tensor:
    for i in range(0, len(params), 2):
        h = h @ params[i] + params[i + 1]
        if i + 2 < len(params):
            h = pargrad.tanh(h)
    return h


def _mse(out: pargrad.Tensor, target: np.ndarray) -> pargrad.Tensor:
    error = out - pargrad.tensor(target)
    return (error * error).mean()


def mlp(batch: int, sizes: list[int]) -> Workload:
    """A deep MLP: one chain, so an update can only overlap the layers below it."""
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(batch, sizes[0])).astype(np.float32),
                rng.normal(size=(batch, sizes[-1])).astype(np.float32)) for _ in range(4)]
    return Workload("MLP " + "-".join(map(str, sizes)),
                    lambda seed: _layers(np.random.default_rng(seed), sizes),
                    lambda params, b: _mse(_forward(params, pargrad.tensor(b[0])), b[1]),
                    batches)


def wide(batch: int, branches: int, sizes: list[int]) -> Workload:
    """Independent branches on one input, their outputs summed: their backwards, and
    their updates, can run side by side."""
    per_branch = 2 * (len(sizes) - 1)
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(batch, sizes[0])).astype(np.float32),
                rng.normal(size=(batch, sizes[-1])).astype(np.float32)) for _ in range(4)]

    def make(seed: int) -> Params:
        generator = np.random.default_rng(seed)
        return [p for _ in range(branches) for p in _layers(generator, sizes)]

    def loss(params: Params, b: tuple[np.ndarray, np.ndarray]) -> pargrad.Tensor:
        x = pargrad.tensor(b[0])
        outs = [_forward(params[i:i + per_branch], x)
                for i in range(0, len(params), per_branch)]
        return _mse(sum(outs[1:], start=outs[0]), b[1])

    return Workload(f"wide: {branches} branches " + "-".join(map(str, sizes)), make, loss,
                    batches)


class Contender:
    """One copy of a model and its optimizer, trained one way."""

    def __init__(self, workload: Workload, engine: pargrad.Engine, in_backward: bool) -> None:
        self.workload = workload
        self.engine = engine
        self.params = workload.make(0)
        self.optimizer: Optimizer = Adam(self.params, lr=1e-3)
        self.handle = self.optimizer.step_in_backward() if in_backward else None
        self.steps = 0

    def step(self) -> tuple[float, int]:
        """One training step; its seconds and the process's minor page faults in it."""
        batch = self.workload.batches[self.steps % len(self.workload.batches)]
        self.steps += 1
        gc.collect()
        faults = minor_faults() or 0
        start = time.perf_counter()
        loss = self.workload.loss(self.params, batch)
        loss.backward(engine=self.engine)
        if self.handle is None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return time.perf_counter() - start, (minor_faults() or 0) - faults


def compare(workload: Workload, engine: pargrad.Engine, repeats: int,
            warmup: int) -> dict[str, Any]:
    """Both ways on ``engine``, interleaved; medians, their ratio, and whether the two
    copies ended with the same bits."""
    plain = Contender(workload, engine, in_backward=False)
    during = Contender(workload, engine, in_backward=True)
    times: dict[str, list[float]] = {"plain": [], "in_backward": []}
    faults: dict[str, list[int]] = {"plain": [], "in_backward": []}
    for repeat in range(warmup + repeats):
        for name, contender in (("plain", plain), ("in_backward", during)):
            seconds, faulted = contender.step()
            if repeat >= warmup:
                times[name].append(seconds)
                faults[name].append(faulted)
    same = all(np.array_equal(p.data, q.data) for p, q in zip(plain.params, during.params))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"workload": workload.name, "engine": type(engine).__name__,
            "median_s": medians, "ratio": medians["plain"] / medians["in_backward"],
            "median_faults": {name: statistics.median(v) for name, v in faults.items()},
            "same_bits": same, "samples_s": times}


def machine() -> dict[str, Any]:
    """The facts that move these figures."""
    from threadpoolctl import threadpool_info
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "simd": simd(),
            "numpy": np.__version__,
            "blas_threads": [pool.get("num_threads") for pool in threadpool_info()],
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--json", metavar="PATH", help="save the results there")
    args = parser.parse_args(argv)
    if args.tiny:
        workloads = [mlp(4, [8, 16, 4]), wide(4, 3, [8, 8, 2])]
        args.repeats, args.warmup = 3, 1
    else:
        workloads = [mlp(128, [784, 1024, 1024, 1024, 10]), wide(64, 8, [256, 512, 256])]
    facts = machine()
    found = simd() or {}
    print(f"machine: {facts['cpu']}, {facts['cores']} cores, numpy {facts['numpy']}, "
          f"BLAS threads {facts['blas_threads']}, load average {facts['load_average']}")
    print(f"numpy SIMD: baseline {' '.join(found.get('baseline', []))}; found "
          f"{' '.join(found.get('found', []))}; not found {' '.join(found.get('not_found', []))}")
    print(f"Adam, float32; median seconds of a whole step over {args.repeats} interleaved "
          f"repeats ({args.warmup} dropped); ratio = backward+step / step_in_backward")
    print(f"{'workload':<34} {'engine':<17} {'backward+step':>14} {'step_in_backward':>17} "
          f"{'ratio':>6} {'page faults':>13}  same bits")
    results = []
    for workload in workloads:
        for engine in (pargrad.SequentialEngine(), pargrad.ThreadedEngine()):
            row = compare(workload, engine, args.repeats, args.warmup)
            results.append(row)
            median = row["median_s"]
            faulted = row["median_faults"]
            print(f"{row['workload']:<34} {row['engine']:<17} {median['plain']:>14.4f} "
                  f"{median['in_backward']:>17.4f} {row['ratio']:>6.2f} "
                  f"{faulted['plain']:>6.0f} {faulted['in_backward']:>6.0f}  {row['same_bits']}")
            if isinstance(engine, pargrad.ThreadedEngine):
                engine.shutdown()
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": facts, "results": results}, file, indent=1)
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()

"""Training an MLP with an asynchronous backward (docs/async.md).

Two loops over the same batches from the same start, which end with the same weights:

- ``sync_loop``: prepare a batch, forward, ``backward``, then an SGD step on every
  parameter: each phase waits for the one before.
- ``async_loop``: forward, ``backward_async``, and while the engine's workers run the
  backward this thread prepares the next batch; each parameter's SGD step runs in its
  post-accumulate-grad hook, on the worker, as soon as its gradient is final
  ("optimizer in backward"), so the weights are updated when the future resolves.

With ``ThreadedEngine(deterministic=True)`` the two end bitwise equal (the gradients are
the reference's and the step is the same arithmetic); otherwise to rounding.

Run: ``python -m examples.async_training`` from the repository root.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import pargrad
from pargrad import Tensor

LEARNING_RATE = 0.05


@dataclass(frozen=True)
class Task:
    """A classification task: ``batch`` inputs of ``sizes[0]`` features, ``sizes[-1]``
    classes; every batch is remade from its seed by ``prepare`` (with its cost)."""

    batch: int = 256
    sizes: tuple[int, ...] = (784, 512, 512, 10)
    augment: int = 6  # passes of the input pipeline over each raw batch

    def parameters(self, seed: int = 0) -> list[Tensor]:
        rng = np.random.default_rng(seed)
        params = []
        for fan_in, fan_out in itertools.pairwise(self.sizes):
            w = rng.standard_normal((fan_in, fan_out)) * np.sqrt(2 / fan_in)
            params.append(pargrad.tensor(w.astype(np.float32), requires_grad=True))
            params.append(pargrad.tensor(np.zeros(fan_out, np.float32), requires_grad=True))
        return params

    def prepare(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``step``: made from its seed, then normalised and augmented (what a
        data pipeline does on the CPU between two steps; numpy, so it runs beside the
        engine's threads)."""
        rng = np.random.default_rng(1000 + step)
        raw = rng.standard_normal((self.batch * 4, self.sizes[0])).astype(np.float32)
        for _ in range(self.augment):  # jitter, clip, renormalise
            raw = np.clip(raw + 0.01 * np.sin(raw), -3.0, 3.0)
            raw = (raw - raw.mean(axis=0)) / (raw.std(axis=0) + 1e-5)
        labels = rng.integers(0, self.sizes[-1], self.batch)
        return raw[::4].copy(), labels

    def loss(self, params: list[Tensor], batch: tuple[np.ndarray, np.ndarray]) -> Tensor:
        x, labels = batch
        h = pargrad.tensor(x)
        for i in range(0, len(params) - 2, 2):
            h = pargrad.relu(h @ params[i] + params[i + 1])
        log_probs = pargrad.log_softmax(h @ params[-2] + params[-1], 1)
        return -pargrad.mean(log_probs[np.arange(len(labels)), labels])


def sgd_step(p: Tensor) -> None:
    """One SGD step on ``p`` from its ``.grad``, which it then clears."""
    with pargrad.no_grad():
        p -= LEARNING_RATE * p.grad
    p.grad = None


def sync_loop(task: Task, params: list[Tensor], steps: int, engine: pargrad.Engine,
              on_step: Callable[[float], None] = lambda seconds: None) -> list[float]:
    """Prepare, forward, backward, step: one after another. Returns the losses;
    ``on_step`` gets each step's seconds."""
    losses = []
    for k in range(steps):
        start = time.perf_counter()
        batch = task.prepare(k)
        loss = task.loss(params, batch)
        loss.backward(engine=engine)
        for p in params:
            sgd_step(p)
        losses.append(loss.item())
        on_step(time.perf_counter() - start)
    return losses


def async_loop(task: Task, params: list[Tensor], steps: int, engine: pargrad.Engine,
               on_step: Callable[[float], None] = lambda seconds: None) -> list[float]:
    """The same training with the next batch prepared while the backward runs and the
    SGD step of each parameter in its post-accumulate-grad hook."""
    handles = [p.register_post_accumulate_grad_hook(sgd_step) for p in params]
    losses = []
    try:
        batch = task.prepare(0)
        for k in range(steps):
            start = time.perf_counter()
            loss = task.loss(params, batch)
            future = pargrad.backward_async(loss, engine=engine)
            if k + 1 < steps:
                batch = task.prepare(k + 1)  # overlaps the backward
            future.result()  # the weights are updated once it resolves
            losses.append(loss.item())
            on_step(time.perf_counter() - start)
    finally:
        for handle in handles:
            handle.remove()
    return losses


def main() -> None:
    task = Task()
    steps = 8
    with pargrad.ThreadedEngine(deterministic=True) as engine:
        timed: dict[str, list[float]] = {"sync": [], "async": []}
        params_sync, params_async = task.parameters(), task.parameters()
        losses_sync = sync_loop(task, params_sync, steps, engine, timed["sync"].append)
        losses_async = async_loop(task, params_async, steps, engine, timed["async"].append)
    same = all(np.array_equal(a.data, b.data) for a, b in zip(params_sync, params_async))
    print(f"losses: {losses_sync[0]:.4f} -> {losses_sync[-1]:.4f}; "
          f"weights bitwise equal: {same}")
    sync_s, async_s = np.median(timed["sync"]), np.median(timed["async"])
    print(f"median step: sync {sync_s * 1e3:.1f} ms, async {async_s * 1e3:.1f} ms, "
          f"sync / async {sync_s / async_s:.2f}")
    assert losses_sync == losses_async and same


if __name__ == "__main__":
    main()

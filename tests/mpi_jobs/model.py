"""The model, data and single-process reference shared by the MPI jobs and the tests.

A 4-8-8-3 tanh MLP with a mean cross-entropy loss over a global batch of 12 (which 2
and 3 ranks split evenly, so the mean of the ranks' shard means is the batch mean).
"""

from __future__ import annotations

import itertools

import numpy as np

import pargrad
from pargrad import Tensor

BATCH = 12
SIZES = (4, 8, 8, 3)
LEARNING_RATE = 0.1


def parameters(dtype: type, seed: int = 0) -> list[Tensor]:
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in itertools.pairwise(SIZES):
        params.append(pargrad.tensor(rng.standard_normal((fan_in, fan_out)).astype(dtype),
                                     requires_grad=True))
        params.append(pargrad.tensor(rng.standard_normal(fan_out).astype(dtype),
                                     requires_grad=True))
    return params


def batch(dtype: type, step: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return (rng.standard_normal((BATCH, SIZES[0])).astype(dtype),
            rng.integers(0, SIZES[-1], BATCH))


def loss(params: list[Tensor], x: np.ndarray, y: np.ndarray) -> Tensor:
    h = pargrad.tensor(x)
    for i in range(0, len(params) - 2, 2):
        h = pargrad.tanh(h @ params[i] + params[i + 1])
    log_probs = pargrad.log_softmax(h @ params[-2] + params[-1], axis=1)
    return -log_probs[np.arange(len(y)), y].mean()


def sgd(params: list[Tensor]) -> None:
    with pargrad.no_grad():
        for p in params:
            assert p.grad is not None
            p -= LEARNING_RATE * p.grad
            p.grad = None


def reference(dtype: type, steps: int) -> list[np.ndarray]:
    """The gradients of the last of ``steps`` whole-batch steps, in one process."""
    params = parameters(dtype)
    engine = pargrad.SequentialEngine()
    for step in range(steps):
        if step:
            sgd(params)
        loss(params, *batch(dtype, step)).backward(engine=engine)
    return [p.grad.data.copy() for p in params]  # type: ignore[union-attr]

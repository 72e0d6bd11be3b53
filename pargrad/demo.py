"""A short demo: train a small MLP on synthetic data and check its gradients.

Run with ``python -m pargrad.demo``. It prints the loss as it falls, then checks the
backward of the same loss against finite differences, and exits non-zero if the loss
did not fall or the gradients disagree.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np

import pargrad
from pargrad import Tensor


def make_data(rng: np.random.Generator, n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """Three interleaved spirals in the plane: points and their class labels."""
    labels = np.repeat(np.arange(3), n // 3)
    radius = rng.uniform(0.1, 1.0, labels.size)
    angle = 4 * radius + labels * 2 * np.pi / 3 + rng.normal(0, 0.15, labels.size)
    points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return points, labels


def init_params(rng: np.random.Generator, sizes: list[int]) -> list[Tensor]:
    params = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        w = rng.normal(0, np.sqrt(2 / fan_in), (fan_in, fan_out))
        params += [pargrad.tensor(w, requires_grad=True),
                   pargrad.tensor(np.zeros(fan_out), requires_grad=True)]
    return params


def logits_fn(params: list[Tensor], x: np.ndarray) -> Tensor:
    """The MLP: tanh hidden layers, then a linear layer to one logit per class."""
    h = pargrad.tensor(x)
    for i in range(0, len(params) - 2, 2):
        h = pargrad.tanh(h @ params[i] + params[i + 1])
    return h @ params[-2] + params[-1]


def loss_fn(params: list[Tensor], x: np.ndarray, y: np.ndarray) -> Tensor:
    """Mean cross-entropy of the MLP's predictions."""
    log_probs = pargrad.log_softmax(logits_fn(params, x), axis=1)
    return -log_probs[np.arange(len(y)), y].mean()


def main() -> int:
    rng = np.random.default_rng(0)
    x, y = make_data(rng)
    params = init_params(rng, [2, 32, 32, 3])
    print(f"training a 2-32-32-3 MLP on {len(y)} points with {pargrad.current_engine()}")
    first = last = float("nan")
    for step in range(301):
        loss = loss_fn(params, x, y)
        loss.backward()
        with pargrad.no_grad():
            for p in params:
                assert p.grad is not None
                p -= 0.5 * p.grad
                p.grad = None
        if step == 0:
            first = loss.item()
        last = loss.item()
        if step % 50 == 0:
            with pargrad.no_grad():
                accuracy = np.mean(np.argmax(logits_fn(params, x).numpy(), axis=1) == y)
            print(f"step {step:3d}  loss {last:.4f}  accuracy {accuracy:.2f}")

    print("checking the gradients against finite differences...")
    small_x, small_y = x[::30], y[::30]
    pargrad.gradcheck(lambda *ps: loss_fn(list(ps), small_x, small_y), params)
    print("gradients match finite differences")
    if not last < 0.5 * first:
        print(f"the loss did not fall enough: {first:.4f} -> {last:.4f}", file=sys.stderr)
        return 1
    print(f"loss fell from {first:.4f} to {last:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

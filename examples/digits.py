"""Train an MLP on scikit-learn's 8x8 handwritten digits with ``pargrad.nn``.

The 1797 images that ship with scikit-learn (``sklearn.datasets.load_digits``, no
download) are split into 75% for training and 25% for testing; a 64-128-10 MLP with
ReLU and dropout learns them with minibatch SGD and momentum (``pargrad.optim.SGD``) on
``pargrad.cross_entropy``. A progress bar shows each epoch's loss and test accuracy; at
the end the script prints the test accuracy and saves a plot of loss and accuracy per
epoch.

Run from the repository root (``pip install -e '.[examples]'`` brings scikit-learn, tqdm
and matplotlib): ``python examples/digits.py [--epochs 30] [--plot digits.png]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import pargrad
from pargrad import nn


@dataclass
class History:
    """What each epoch ended with."""

    loss: list[float] = field(default_factory=list)  # mean training loss over the epoch
    train_accuracy: list[float] = field(default_factory=list)
    test_accuracy: list[float] = field(default_factory=list)


def load(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits as (x_train, y_train, x_test, y_test): pixels scaled to [0, 1], a split
    stratified by class."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.25, random_state=seed,
        stratify=digits.target)
    return x_train, y_train, x_test, y_test


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with pargrad.no_grad():
        predicted = np.argmax(model(x).numpy(), axis=1)
    return float(np.mean(predicted == y))


def train(epochs: int = 30, batch_size: int = 32, lr: float = 0.05, seed: int = 0,
          progress: bool = True) -> tuple[nn.Sequential, History]:
    """Train a fresh model for ``epochs`` epochs; the same ``seed`` gives the same run.
    ``progress``: a tqdm progress bar (tqdm is needed only then)."""
    x_train, y_train, x_test, y_test = load(seed)
    pargrad.random.seed(seed)  # the initial weights and the dropout masks
    shuffle = np.random.default_rng(seed)
    model = make_model()
    optimizer = pargrad.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    history = History()
    bar = progress_bar(epochs) if progress else None
    for _ in range(epochs):
        model.train()
        losses = []
        order = shuffle.permutation(len(y_train))
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            loss = pargrad.cross_entropy(model(x_train[batch]), y_train[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        history.loss.append(float(np.mean(losses)))
        history.train_accuracy.append(accuracy(model, x_train, y_train))
        history.test_accuracy.append(accuracy(model, x_test, y_test))
        if bar is not None:
            bar.update()
            bar.set_postfix(loss=f"{history.loss[-1]:.4f}",
                            test=f"{history.test_accuracy[-1]:.3f}")
    if bar is not None:
        bar.close()
    return model, history


def progress_bar(epochs: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=epochs, desc="digits", unit="epoch")


def plot(history: History, path: Path) -> None:
    """Save the loss and the accuracies per epoch side by side to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = np.arange(1, len(history.loss) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(epochs, history.loss)
    left.set(title="training loss", xlabel="epoch", ylabel="cross-entropy", yscale="log")
    right.plot(epochs, history.train_accuracy, label="train")
    right.plot(epochs, history.test_accuracy, label="test")
    right.set(title="accuracy", xlabel="epoch", ylabel="fraction correct")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="train an MLP on the 8x8 digits")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--plot", type=Path, default=Path("digits.png"),
                        help="where to save the plot of loss and accuracy (PNG)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model, history = train(args.epochs, seed=args.seed)
    seconds = time.perf_counter() - started
    print(model)
    print(f"test accuracy {history.test_accuracy[-1]:.3f} after {args.epochs} epochs "
          f"({seconds:.1f} s)")
    plot(history, args.plot)
    print(f"saved the loss and accuracy per epoch to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loss functions, built from pargrad's ops (so their gradients are those ops' rules):
``mse_loss``, ``nll_loss``, ``cross_entropy`` and ``binary_cross_entropy_with_logits``.

Classes lie along ``axis`` (numpy's name; default the last axis, where torch uses
``dim=1``). ``reduction`` is ``"mean"`` (default), ``"sum"`` or ``"none"``, as in torch.
Integer class targets are plain values (arrays, lists or integer Tensors): they get no
gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.ops import core, elementwise, nn, reductions
from pargrad.replay import recorder
from pargrad.tensor import Tensor

REDUCTIONS = ("mean", "sum", "none")


def _reduce(losses: Tensor, reduction: str, name: str) -> Tensor:
    if reduction == "mean":
        return reductions.mean(losses)
    if reduction == "sum":
        return reductions.sum(losses)
    if reduction == "none":
        return losses
    raise ValueError(f"{name}: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def mse_loss(input: Any, target: Any, reduction: str = "mean") -> Tensor:
    """The squared error ``(input - target)**2``, reduced; differentiable in both.

    >>> import pargrad
    >>> pargrad.mse_loss(pargrad.tensor([1.0, 2.0]), pargrad.tensor([1.0, 4.0]))
    tensor(2., dtype=float64)
    """
    diff = elementwise.subtract(input, target)
    return _reduce(elementwise.square(diff), reduction, "mse_loss")


def nll_loss(log_probs: Any, target: Any, axis: int = -1, reduction: str = "mean") -> Tensor:
    """The negative log-likelihood ``-log_probs[..., target, ...]`` of integer class
    ``target`` (one class index per sample; ``log_probs`` has the classes along ``axis``).

    Raises ValueError for a target that is not an integer class in ``[0, classes)``.

    >>> import pargrad
    >>> log_probs = pargrad.tensor([[-0.5, -1.0], [-2.0, -0.1]])
    >>> pargrad.nll_loss(log_probs, [0, 1])
    tensor(0.3, dtype=float64)
    """
    axis = core.normalize_axis(axis, core.ndim_of(log_probs), "nll_loss")
    shape = np.shape(core.array_of(log_probs))
    classes = shape[axis]
    expected = shape[:axis] + shape[axis + 1:]

    def pick(target_array: Any) -> np.ndarray:
        """One-hot along the class axis (checked): picks each sample's class."""
        labels = np.asarray(target_array)
        if labels.dtype.kind not in "iu":
            raise ValueError(f"nll_loss: target must hold integer class indices, got dtype "
                             f"{labels.dtype} (for probabilities use cross_entropy)")
        if labels.shape != expected:
            raise ValueError(f"nll_loss: target has shape {labels.shape}, but log_probs of "
                             f"shape {shape} with classes along axis {axis} "
                             f"need one class per sample: shape {expected}")
        if labels.size and (labels.min() < 0 or labels.max() >= classes):
            raise ValueError(f"nll_loss: target holds classes {labels.min()}..{labels.max()}"
                             f", but there are {classes} classes (along axis {axis})")
        along = [1] * len(shape)
        along[axis] = classes
        return np.expand_dims(labels, axis) == np.arange(classes).reshape(along)

    one_hot = pick(core.array_of(target))
    if recorder.active:  # pargrad.capture: a replay picks its own target's classes
        recorder.derived(pick, (target,), one_hot)
    # Differentiable in log_probs.
    picked = reductions.sum(elementwise.multiply(log_probs, one_hot), axis=axis)
    return _reduce(elementwise.negative(picked), reduction, "nll_loss")


def cross_entropy(logits: Any, target: Any, axis: int = -1, reduction: str = "mean") -> Tensor:
    """``nll_loss(log_softmax(logits, axis), target)`` for integer class targets; for a
    float ``target`` of ``logits``' shape (class probabilities),
    ``-sum(target * log_softmax(logits, axis), axis)``. Never overflows.

    >>> import pargrad
    >>> logits = pargrad.tensor([[2.0, 0.0], [0.0, 2.0]], requires_grad=True)
    >>> loss = pargrad.cross_entropy(logits, [0, 1])
    >>> round(loss.item(), 4)
    0.1269
    """
    log_probs = nn.log_softmax(logits, axis=axis)
    labels = core.array_of(target)
    if np.asarray(labels).dtype.kind == "f":
        if np.shape(labels) != log_probs.shape:
            raise ValueError(f"cross_entropy: a float target holds class probabilities and "
                             f"must have the logits' shape {log_probs.shape}, got "
                             f"{np.shape(labels)}")
        picked = reductions.sum(elementwise.multiply(log_probs, target), axis=axis)
        return _reduce(elementwise.negative(picked), reduction, "cross_entropy")
    return nll_loss(log_probs, target, axis=axis, reduction=reduction)


def binary_cross_entropy_with_logits(logits: Any, target: Any,
                                     reduction: str = "mean") -> Tensor:
    """``-(target·log(sigmoid(x)) + (1 - target)·log(1 - sigmoid(x)))`` for logits ``x``,
    computed as ``softplus(x) - target·x``, which never overflows nor takes the log of 0. The
    gradient is ``sigmoid(x) - target`` (also at ``x = 0``).

    >>> import pargrad
    >>> pargrad.binary_cross_entropy_with_logits(pargrad.tensor([1000.0, -1000.0]),
    ...                                          pargrad.tensor([1.0, 0.0]))
    tensor(0., dtype=float64)
    """
    losses = elementwise.subtract(elementwise.softplus(logits),
                                  elementwise.multiply(target, logits))
    return _reduce(losses, reduction, "binary_cross_entropy_with_logits")

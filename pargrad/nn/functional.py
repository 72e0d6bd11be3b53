"""The layers' computations as functions (PyTorch's ``torch.nn.functional``): ``linear``,
``dropout``, ``layer_norm``, ``embedding``, and pargrad's activations and losses under
the names a PyTorch user looks for (``relu``, ``tanh``, ``sigmoid``, ``softmax``,
``log_softmax``, ``mse_loss``, ``cross_entropy``, ...).

Each is built from pargrad's ops, so its gradient is theirs. Axes follow numpy's names
(``axis``), and the losses take the classes along the last axis, as ``pargrad.losses``.

>>> import pargrad
>>> from pargrad.nn import functional as F
>>> F.relu(F.linear(pargrad.tensor([[1.0, -2.0]]), pargrad.tensor([[1.0, 1.0], [0.0, -1.0]])))
tensor([[0., 2.]], dtype=float64)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad import random
from pargrad.losses import binary_cross_entropy_with_logits, cross_entropy, mse_loss, nll_loss
from pargrad.ops.functions import relu, sigmoid, softplus, sqrt, tanh
from pargrad.ops.linalg import matmul, transpose
from pargrad.ops.nn import log_softmax, softmax
from pargrad.ops.reductions import mean
from pargrad.ops.shape import getitem
from pargrad.replay import recorder
from pargrad.tensor import Tensor

__all__ = ["binary_cross_entropy_with_logits", "cross_entropy", "dropout", "embedding",
           "layer_norm", "linear", "log_softmax", "mse_loss", "nll_loss", "relu", "sigmoid",
           "softmax", "softplus", "tanh"]


def _array(x: Any) -> np.ndarray:
    return x.data if isinstance(x, Tensor) else np.asarray(x)


def linear(x: Any, weight: Any, bias: Any = None) -> Tensor:
    """``x @ weight.T + bias``: ``weight`` has shape ``(out_features, in_features)``,
    ``x`` any number of leading axes and ``in_features`` last.

    >>> import pargrad
    >>> pargrad.nn.functional.linear(pargrad.ones((1, 2)), pargrad.ones((3, 2)), [0.0, 1, 2])
    tensor([[2., 3., 4.]], dtype=float64)
    """
    out = matmul(x, transpose(weight))
    return out if bias is None else out + bias


def dropout(x: Any, p: float = 0.5, training: bool = True,
            generator: random.Generator | None = None) -> Tensor:
    """In training, each element of ``x`` zeroed with probability ``p`` and the others
    multiplied by ``1/(1-p)`` (so the expected value is ``x``); the gradient flows only
    through the kept elements, scaled alike. Not training, or ``p = 0``: ``x`` itself.
    The mask is drawn from ``generator`` (default: ``pargrad.random``'s, so
    ``pargrad.random.seed`` reproduces it).

    Raises ValueError for ``p`` outside ``[0, 1]``.

    >>> import pargrad
    >>> pargrad.random.seed(0)
    >>> pargrad.nn.functional.dropout(pargrad.ones(6), p=0.5)
    tensor([2., 0., 0., 0., 2., 2.], dtype=float64)
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p is a probability in [0, 1], got {p}")
    if not training or p == 0.0:
        return x if isinstance(x, Tensor) else Tensor(x)
    array = _array(x)
    source = generator or random.default_generator
    scale = array.dtype.type(0.0 if p == 1.0 else 1.0 / (1.0 - p))
    shape, dtype = array.shape, array.dtype

    def mask() -> np.ndarray:
        draws = source.draw("uniform", (0.0, 1.0, shape), np.float64)
        return (draws >= p).astype(dtype) * scale

    if not isinstance(x, Tensor):
        if recorder.active:
            recorder.fail("dropout of a numpy array inside the function (its values would "
                          "be the first call's)")
        return random.drawn(lambda: array * mask())
    return x * random.drawn(mask)  # drawn afresh on every replay of pargrad.capture


def layer_norm(x: Any, normalized_shape: int | tuple[int, ...], weight: Any = None,
               bias: Any = None, eps: float = 1e-5) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias``, the mean and (biased) variance
    taken over the last axes, those of ``normalized_shape``; ``weight`` and ``bias``
    (that shape, or None) scale and shift the result.

    Raises ValueError if ``x``'s last axes are not ``normalized_shape``.

    >>> import pargrad
    >>> pargrad.nn.functional.layer_norm(pargrad.tensor([[1.0, 3.0]]), 2, eps=0.0)
    tensor([[-1.,  1.]], dtype=float64)
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    x_shape = _array(x).shape
    if x_shape[len(x_shape) - len(shape):] != shape:
        raise ValueError(f"layer_norm: the input's last axes must be normalized_shape {shape}, "
                         f"but the input has shape {x_shape}")
    axes = tuple(range(-len(shape), 0))
    centred = x - mean(x, axis=axes, keepdims=True)
    out = centred / sqrt(mean(centred * centred, axis=axes, keepdims=True) + eps)
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def embedding(indices: Any, weight: Any) -> Tensor:
    """The rows of ``weight`` at integer ``indices``: ``weight[indices]``, of shape
    ``indices.shape + (embedding_dim,)``. The gradient of a row used several times is
    the sum of its uses' gradients.

    Raises TypeError for indices that are not integers, IndexError for one outside
    ``[0, num_embeddings)``.

    >>> import pargrad
    >>> pargrad.nn.functional.embedding([2, 0], pargrad.tensor([[0.0, 1], [2, 3], [4, 5]]))
    tensor([[4., 5.],
            [0., 1.]], dtype=float64)
    """
    rows = _array(weight).shape[0]

    def checked(indices: Any) -> np.ndarray:
        index = np.asarray(indices)
        if index.dtype.kind not in "iu":
            raise TypeError(f"embedding: indices must be integers, got dtype {index.dtype}")
        if index.size and (index.min() < 0 or index.max() >= rows):
            raise IndexError(f"embedding: indices {index.min()}..{index.max()} are out of "
                             f"range for {rows} embeddings")
        return index

    index = checked(_array(indices))
    if recorder.active:  # pargrad.capture: a replay checks and copies its own indices
        recorder.derived(checked, (indices,), index)
    return getitem(weight, index)

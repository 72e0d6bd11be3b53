"""Embedding: a table of vectors looked up by integer index (words, tokens, ids).

>>> import pargrad
>>> table = pargrad.nn.Embedding(10, 3)
>>> table([[1, 2], [2, 9]]).shape
(2, 2, 3)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad import random
from pargrad.grad_mode import no_grad
from pargrad.nn import functional
from pargrad.nn.module import Module
from pargrad.nn.parameter import Parameter, empty_parameter
from pargrad.tensor import Tensor


class Embedding(Module):
    """``Embedding(num_embeddings, embedding_dim)``: ``weight`` of shape
    ``(num_embeddings, embedding_dim)``, standard normal at first (PyTorch's default,
    from ``pargrad.random``'s generator); calling it with integer indices of any shape
    gives their rows, of shape ``indices.shape + (embedding_dim,)``. A row looked up
    several times gets the sum of their gradients.
    """

    weight: Parameter

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: Any = np.float64,
                 device: Any = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = empty_parameter((num_embeddings, embedding_dim), dtype, device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw ``weight`` again from the standard normal."""
        with no_grad():
            self.weight[...] = random.normal(size=self.weight.shape, dtype=self.weight.dtype).data

    def forward(self, indices: Any) -> Tensor:
        return functional.embedding(indices, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"

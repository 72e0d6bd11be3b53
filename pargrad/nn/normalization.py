"""LayerNorm: normalise each sample over its last axes, then scale and shift.

>>> import pargrad
>>> norm = pargrad.nn.LayerNorm(4)
>>> y = norm(pargrad.tensor([[1.0, 2.0, 3.0, 4.0]]))
>>> round(float(y.mean().item()), 6), round(float(y.var().item()), 3)
(0.0, 1.0)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.grad_mode import no_grad
from pargrad.nn import functional
from pargrad.nn.module import Module
from pargrad.nn.parameter import Parameter, empty_parameter
from pargrad.tensor import Tensor


class LayerNorm(Module):
    """``LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)``: each sample's
    last axes (of shape ``normalized_shape``, an int for one axis) normalised to mean 0
    and variance 1 (``(x - mean) / sqrt(var + eps)``, the biased variance), then
    multiplied by ``weight`` and shifted by ``bias`` (both of ``normalized_shape``,
    starting at ones and zeros; None without ``elementwise_affine``, or only ``bias``
    None with ``bias=False``).
    """

    weight: Parameter | None
    bias: Parameter | None

    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *,
                 dtype: Any = np.float64, device: Any = None) -> None:
        super().__init__()
        self.normalized_shape = ((normalized_shape,) if isinstance(normalized_shape, int)
                                 else tuple(normalized_shape))
        self.eps, self.elementwise_affine = eps, elementwise_affine
        affine = empty_parameter if elementwise_affine else lambda *_: None
        self.weight = affine(self.normalized_shape, dtype, device)
        self.bias = affine(self.normalized_shape, dtype, device) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``weight`` back to ones and ``bias`` to zeros."""
        with no_grad():
            for param, value in ((self.weight, 1.0), (self.bias, 0.0)):
                if param is not None:
                    param.fill_(value)

    def forward(self, x: Any) -> Tensor:
        return functional.layer_norm(x, self.normalized_shape, self.weight, self.bias,
                                     self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")

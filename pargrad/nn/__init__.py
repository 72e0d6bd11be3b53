"""Neural-network modules in the shape of PyTorch's ``torch.nn``: ``Module`` and
``Parameter``, the containers ``Sequential`` and ``ModuleList``, the layers ``Linear``,
``Embedding``, ``LayerNorm``, ``Dropout``, the activations ``ReLU``, ``Tanh``,
``Sigmoid``, and the losses ``MSELoss``, ``CrossEntropyLoss``; ``functional`` has the
same computations as functions. Code written for ``torch.nn`` ports by changing the
import (docs/training.md lists the differences).

>>> import pargrad
>>> from pargrad import nn
>>> pargrad.random.seed(0)
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
>>> loss = nn.CrossEntropyLoss()(model(pargrad.randn(5, 4)), [0, 1, 2, 1, 0])
>>> loss.backward()
>>> model[0].weight.grad.shape
(8, 4)
"""

from pargrad.nn import functional
from pargrad.nn.activation import ReLU, Sigmoid, Tanh
from pargrad.nn.containers import ModuleList, Sequential
from pargrad.nn.dropout import Dropout
from pargrad.nn.embedding import Embedding
from pargrad.nn.linear import Linear
from pargrad.nn.loss import CrossEntropyLoss, MSELoss
from pargrad.nn.module import IncompatibleKeys, Module
from pargrad.nn.normalization import LayerNorm
from pargrad.nn.parameter import Parameter

__all__ = ["CrossEntropyLoss", "Dropout", "Embedding", "IncompatibleKeys", "LayerNorm",
           "Linear", "MSELoss", "Module", "ModuleList", "Parameter", "ReLU", "Sequential",
           "Sigmoid", "Tanh", "functional"]

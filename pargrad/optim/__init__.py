"""``pargrad.optim``: optimizers and learning-rate schedulers, as ``torch.optim``'s.

``SGD``, ``Adam``, ``AdamW`` and ``RMSprop`` update leaf Tensors in place from their
``.grad``, step for step as PyTorch's implementation of each computes it, so that
results agree with torch's to rounding. Where pseudo-code PyTorch has published
differs from that (SGD's maximize with weight decay, Adam's amsgrad), the
implementation is followed; the classes' docstrings say how. ``lr_scheduler`` has
``StepLR``, ``CosineAnnealingLR`` and ``LambdaLR``. ``Optimizer.step_in_backward()``
makes the updates happen during backward, each as soon as its parameter's gradient is
final (docs/training.md).

>>> import pargrad
>>> w = pargrad.tensor([1.0, -1.0], requires_grad=True)
>>> opt = pargrad.optim.SGD([w], lr=0.25)
>>> for _ in range(3):
...     opt.zero_grad()
...     (w * w).sum().backward()
...     opt.step()
>>> w                                          # halved each step
tensor([ 0.125, -0.125], dtype=float64, requires_grad=True)
"""

from pargrad.optim import lr_scheduler
from pargrad.optim.adam import Adam, AdamW
from pargrad.optim.in_backward import StepInBackward
from pargrad.optim.optimizer import Optimizer
from pargrad.optim.rmsprop import RMSprop
from pargrad.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "RMSprop", "StepInBackward", "lr_scheduler"]

"""The peers: what a user would pick instead of pargrad, on the same graphs.

- ``torch``: PyTorch's CPU autograd (``loss.backward()``), with ``torch.set_num_threads``
  at the thread count the suite gives it (the cores: what numpy's BLAS and pargrad's
  default engine use). PyTorch runs the CPU nodes of one backward one at a time on the
  calling thread; its kernels use its own intra-op threads. ``torch(1)``: the same at
  one intra-op thread, on the workloads of tiny nodes only (where more threads are
  erratic; the targets take the faster of the two). Each trial sets its thread count,
  untimed, before its forward. The random DAGs run their PyTorch translation
  (``benchmarks/torch_recipes.py``).
- ``hips``: HIPS autograd (``autograd.grad``), which records the forward inside
  ``grad``: its trials are *fused* (forward and backward timed together).

Both build the workload's own ``graph(ops, leaves)`` from the workload's own arrays
(``torch.from_numpy`` shares their memory), so the graphs are the same op for op.
Install them with ``pip install -e '.[peers]'``; ``load`` says why any is skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks import torch_recipes
from benchmarks.workloads import Ops, RandomDag, Trial, Workload

PEERS = ("torch", "hips")
TORCH = ("torch", "torch(1)")  # the names of PyTorch's contenders


def load(threads: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The peers that import, and a reason for each one skipped."""
    found: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    try:
        import torch
    except ImportError as exc:
        skipped["torch"] = _missing(exc, "torch")
    else:
        torch.set_num_threads(threads)
        found["torch"] = torch
        if threads > 1:
            found["torch(1)"] = torch
    try:
        import autograd
        import autograd.numpy
        import autograd.scipy.special
    except ImportError as exc:  # autograd.scipy needs scipy: the extra brings autograd[scipy]
        skipped["hips"] = _missing(exc, "autograd")
    else:
        found["hips"] = autograd
    return found, skipped


def _missing(exc: ImportError, importing: str) -> str:
    """Why a peer is skipped: the package that did not import (``importing`` unless the
    error names another, as autograd's does for scipy), and how to get it."""
    package = (exc.name or importing).split(".")[0]
    return f"not installed: needs {package} ({exc}); pip install -e '.[peers]'"


def versions(found: dict[str, Any]) -> dict[str, Any]:
    """Versions and thread settings of the peers found, for the machine facts."""
    facts: dict[str, Any] = {}
    if "torch" in found:
        torch = found["torch"]
        facts["torch"] = {"version": torch.__version__, "threads": torch.get_num_threads(),
                          "interop_threads": torch.get_num_interop_threads(),
                          "blas": _torch_blas(torch)}
    if "hips" in found:
        from importlib.metadata import version
        facts["hips_autograd"] = {"version": version("autograd")}
    return facts


def _torch_blas(torch: Any) -> str:
    config = torch.__config__.show()
    for line in config.splitlines():
        if "BLAS_INFO=" in line:
            return line.split("BLAS_INFO=")[1].split(",")[0]
    return "unknown"


def trial(peer: str, module: Any, workload: Workload, cores: int) -> Trial | str | None:
    """``workload`` on ``peer`` (``cores``: the intra-op threads of ``torch``), the
    reason it cannot run there, or None where ``peer`` is not meant to run it."""
    if peer == "torch(1)" and not workload.tiny_nodes:
        return None
    threads = 1 if peer == "torch(1)" else cores
    if peer in TORCH and isinstance(workload, RandomDag):
        return torch_recipes.trial(module, workload, threads)
    if not workload.portable:
        return "its graph is built by the test suite's recipe in pargrad ops only"
    if peer in TORCH:
        return _torch_trial(module, workload, threads)
    return _hips_trial(module, workload)


def _torch_trial(torch: Any, workload: Workload, threads: int) -> Trial:
    ops = Ops(const=torch.from_numpy, tanh=torch.tanh, relu=torch.relu, sum=torch.sum,
              mean=torch.mean, log_softmax=lambda x, axis: torch.log_softmax(x, dim=axis),
              exp=torch.exp)
    leaves = [torch.from_numpy(a).requires_grad_() for a in workload.arrays]

    def forward() -> Any:
        for leaf in leaves:
            leaf.grad = None
        return workload.graph(ops, leaves)

    def backward(loss: Any) -> np.ndarray:
        loss.backward()
        return leaves[0].grad.numpy()
    return Trial(forward, backward, prepare=lambda: torch.set_num_threads(threads))


def _hips_trial(autograd: Any, workload: Workload) -> Trial:
    anp = autograd.numpy
    logsumexp = autograd.scipy.special.logsumexp
    ops = Ops(const=lambda a: a, tanh=anp.tanh, relu=lambda x: anp.maximum(x, 0.0),
              sum=anp.sum, mean=anp.mean,
              log_softmax=lambda x, axis: x - logsumexp(x, axis=axis, keepdims=True),
              exp=anp.exp)
    gradient = autograd.grad(lambda leaves: workload.graph(ops, leaves))

    def backward(_: Any) -> np.ndarray:
        return np.asarray(gradient(list(workload.arrays))[0])
    return Trial(lambda: None, backward, fused=True)

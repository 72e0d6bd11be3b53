"""When a gradient rule writes into one fresh buffer instead of a temporary per operator.

A rule written with operators (``g * (1 - ans * ans)``) allocates one array per
operator; on large arrays each is a fresh mapping whose pages fault in on first touch,
and that, not the arithmetic, is most of the rule's time. So above ``OUT_MIN`` elements
the rules of the elementwise ops, softmax, log_softmax and the reductions allocate one
fresh array (their result) and do every step in it with numpy's ``out=``. They never
write into an array they did not allocate: the incoming gradient may be the caller's
``grad_output``, a retained or hooked gradient, or a ``.grad``. A new buffer per call
(none kept by a node) keeps ``retain_graph``'s second backward from overwriting the
first one's result.

Below ``OUT_MIN`` the operator form is cheaper (each ``out=`` step is one more Python
call) and runs unchanged. With ``create_graph`` the rules get Tensors and take the
operator form too (numpy cannot write into a Tensor).
"""

from __future__ import annotations

from typing import Any

import numpy as np

OUT_MIN = 1 << 14
"""Elements from which a rule writes into one buffer. Measured (benchmarks/rules.py):
tanh's rule with out= costs 1.14x the operator form at 100 elements, the same at 4,000,
0.8x at 16,000 and 0.1-0.4x from 65,536 up (where every temporary is a fresh mapping)."""

_ndarray = np.ndarray


def large(g: Any, *others: Any) -> bool:
    """Whether a rule takes its one-buffer form: ``g`` is a plain array of at least
    ``OUT_MIN`` elements and each of ``others`` is a plain array too (not a Tensor)."""
    if type(g) is not _ndarray or g.size < OUT_MIN:
        return False
    return all(type(other) is _ndarray for other in others)

"""Devices: where a tensor's data lives and which ready queue runs its backward nodes.

pargrad has one array backend today, numpy, and one device type, ``cpu``. A CPU can be
split into *logical* devices, ``cpu:0`` (the default, printed ``cpu``), ``cpu:1`` and so
on: their arrays are all numpy arrays in the same memory, but the threaded engine gives
each its own ready queue and worker threads, so a part of a model placed on ``cpu:1``
runs its backward on threads of its own. ``Tensor.to(device)`` moves a tensor (a
differentiable copy).

The interface is kept open for another array backend (CuPy on a GPU, say): a device
names its array module in ``xp``. Nothing reads ``xp`` yet: the rest of pargrad calls
numpy directly (Tensor's arrays, the ops and their rules, ``Node.apply``'s zeros and
``sum_to``, accumulation in ``engine/buffer.py``, creation and random). Such a backend
means a new device type here, a copy between array modules in ``to``, and those calls
made through ``xp``; the engines' scheduling would not change.
"""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType
from typing import Any

import numpy as np

DEVICE_TYPES = ("cpu",)


class Device:
    """A device: a type (``"cpu"``) and an index. Compare with ``==``; hashable.

    Devices are interned: ``pargrad.device("cpu:1") is pargrad.device("cpu:1")``.

    >>> import pargrad
    >>> pargrad.device("cpu"), pargrad.device("cpu:1")
    (device('cpu'), device('cpu:1'))
    >>> pargrad.device("cpu:0") is pargrad.device("cpu")
    True
    """

    __slots__ = ("index", "type")

    type: str
    index: int

    def __init__(self, type: str, index: int) -> None:
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "index", index)
        if _devices:  # every Device but the interned cpu, made directly or by device()
            global cpu_only
            cpu_only = False

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Device objects are immutable")

    @property
    def xp(self) -> ModuleType:
        """The array module that holds this device's data (numpy for ``cpu``)."""
        return np

    def __str__(self) -> str:
        return self.type if self.index == 0 else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device('{self}')"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (device, (str(self),))


# Guards _devices: interning must hand every thread the same object for one name.
_devices_lock = threading.Lock()
_devices: dict[tuple[str, int], Device] = {}
cpu_only = True
"""Whether no Device but the interned ``cpu`` has been made yet: then every node is on
``cpu`` (the engines' checks of every node's device may be skipped). Set False, once and
for good, by ``Device.__init__`` of any other Device (through ``device()`` or made
directly), before the new Device is handed out, so a thread that holds a tensor on
another device (and so was handed it after it was made) reads False."""
_named: dict[str, Device] = {}
"""Every name ``device()`` has parsed, with its Device: ``x.to("cpu")`` in a loop reads
this, without the lock (a dict's get and set are each atomic; two threads parsing one
name at once store the same interned Device)."""


def device(spec: str | Device) -> Device:
    """The device named by ``spec``: ``"cpu"``, ``"cpu:N"`` (N >= 0) or a Device.

    Raises ValueError for an unknown device type or a malformed index, and TypeError
    for anything that is not a string or a Device. Thread-safe.
    """
    if type(spec) is str:
        found = _named.get(spec)
        if found is not None:
            return found
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a device is named by a string such as 'cpu:1', got {spec!r}")
    kind, _, index_text = spec.strip().partition(":")
    if kind not in DEVICE_TYPES:
        raise ValueError(
            f"unknown device type {kind!r} in {spec!r}; pargrad has "
            f"{', '.join(repr(t) for t in DEVICE_TYPES)} devices ('cpu', 'cpu:1', ...)"
        )
    if index_text == "":
        index = 0
    elif index_text.isdigit():
        index = int(index_text)
    else:
        raise ValueError(f"device index in {spec!r} must be a non-negative integer")
    with _devices_lock:
        found = _devices.get((kind, index))
        if found is None:
            found = _devices[(kind, index)] = Device(kind, index)
    _named[spec] = found
    return found


def gil_enabled() -> bool:
    """Whether the GIL is on now: always before 3.13; on a free-threaded 3.13+ build off,
    until an extension module that does not support running without it is imported."""
    check = getattr(sys, "_is_gil_enabled", None)
    return True if check is None else bool(check())


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity masks on this platform
        return os.cpu_count() or 1


CPU = device("cpu")
"""The default device: tensors are made here unless a device is given."""


def common_device(values: Any, where: str) -> Device:
    """The one device of the Tensors among ``values`` (CPU if there are none).

    Raises RuntimeError, naming ``where``, if Tensors on different devices are mixed.
    Anything without a ``device`` attribute (arrays, numbers) fits any device.
    """
    found: Device | None = None
    for v in values:
        d = getattr(v, "_device", None)
        if d is None or d is found:
            continue
        if found is None:
            found = d
        else:
            raise RuntimeError(
                f"{where}: expected all tensors on one device, but found {found} and {d}; "
                f"move them with .to(device)"
            )
    return CPU if found is None else found

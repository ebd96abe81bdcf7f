"""Where the layer engine computes: in numpy on the host, or on the device of a backend that computes GPU arrays.

A backend with ``gpu_arrays``, ``to_device``, ``to_host`` and an ``array_module`` (backends/contract.py: the cupy
backend) has a layer's whole pass computed on its device: the inputs and weights are copied there once (``put``),
the recomputed forward, the schedule's reordering, the gradient and the merges of directions and layers run on
device arrays with that module's functions, and the gradients are copied back once (``back``).  The small index
arrays a schedule is made of are computed on the host and copied over once each.  Every other backend computes
the layer engine on the host, numpy's arrays (its gradient on whatever it computes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends import on_gpu, takes_gpu_arrays


@dataclass(frozen=True)
class Device:
    xp: Any = np  # the array module computing there
    to_device: Callable | None = None  # None: the host
    to_host: Callable | None = None

    @property
    def on_host(self) -> bool:
        return self.to_device is None

    def put(self, a):
        """``a`` (an array, or None) where this computes: a host array copied to the device, once."""
        if a is None or self.to_device is None or on_gpu(a):
            return a
        return self.to_device(a)

    def back(self, a):
        """A result computed here as a host (numpy) array."""
        return a if self.to_host is None else self.to_host(a)


HOST = Device()


def of(backend) -> Device:
    """Where the layer engine computes for ``backend`` (an object): its device where it offers what that takes,
    else the host."""
    if not takes_gpu_arrays(backend):
        return HOST
    parts = [getattr(backend, name, None) for name in ("array_module", "to_device", "to_host")]
    return HOST if any(p is None for p in parts) else Device(*parts)

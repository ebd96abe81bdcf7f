"""What lstmgrad asks of a compute backend: the ``Backend`` protocol, every argument the ops pass included.

A backend is registered by name (``BUILTIN`` in ``backends/__init__.py``, or a plugin under the entry-point group
``lstmgrad.backends`` whose target is a class or factory returning one) and must pass
``backends.conformance.check`` (``lstmgrad backends --check`` runs it on every installed backend; a plugin's own
tests can too).  Optional abilities are attributes a backend may have (``OPTIONAL``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..results import BlockLSTMGradOutputs
from ..spec import SeqTensors

# What a backend may also offer, and what lstmgrad does with it.
OPTIONAL = {
    "gpu_arrays": "True: it computes arrays already on a GPU (cupy's, DLPack's), and returns its results there",
    "build_kernels": "a method building its kernels ahead of a job (lstmgrad backends --check); returns how many",
    "to_device": "with gpu_arrays: a method copying a host array to the device (lstmgrad forward then computes "
                 "there: ops/forward.py is written against the array's module)",
    "to_host": "with gpu_arrays: a method copying a device array back to a numpy array",
    "array_module": "with gpu_arrays, to_device and to_host: the module of its device arrays (cupy), numpy's "
                    "functions for them; the layer engine (Keras and PyTorch layers) then computes there too",
}


@runtime_checkable
class Backend(Protocol):
    """The backward pass of BlockLSTMGrad(V2) on one problem, checked already (ops/validation.py)."""

    name: str  # as the registry knows it
    version: str  # of the library it runs on, exactly: outputs record it (the last bits depend on it)

    def block_lstm_grad(self, tensors: SeqTensors, *, seq_len_max: int, use_peephole: bool, layout: str,
                        compute_dtype: np.dtype, chunk_steps: int | None = None, return_dgates: bool = False,
                        x_grad_out: Any = None,
                        observe: Callable[[int, Any, Any], None] | None = None) -> Any:
        """The gradients of ``tensors`` as ``BlockLSTMGradOutputs`` in x's dtype (and, with ``return_dgates``, the
        gate gradients of every step [seq_len_max, B, 4C] in the compute dtype, as a pair).

        - ``tensors``: ``SeqTensors`` whose time-major ones ([T, B, ...]) may be lazy arrays read by slicing (an
          HDF5 input: ``io.LazyDataset``, with ``read_into``), to be read a chunk of steps at a time so memory
          stays bounded; ``h`` is None for one cell step (LSTMBlockCellGrad never reads it).
        - ``seq_len_max``: the steps computed (0 to T); x_grad beyond it is zeros.  ``layout``: a key of
          ``spec.LAYOUTS``.  ``compute_dtype``: every elementwise operation rounds to it, in TF's bracketing
          (float16 is TF's CPU per-op half rounding).  ``chunk_steps``: time steps per chunk (None: the backend's).
        - ``x_grad_out``: None, or a zero-filled writable [T, B, I] array-like (an HDF5 dataset) that receives
          x_grad and is returned as the outputs' x_grad.
        - ``observe(t, carried_h, carried_cs)``: called after each step t (last first) with the gradients carried
          into h and cs of step t - 1 (``--per-step``), arrays on the backend's device (``to_host`` copies them).
        """
        ...


def outputs_of(result, return_dgates: bool) -> tuple[BlockLSTMGradOutputs, Any]:
    """(outputs, gate gradients or None) of what ``block_lstm_grad`` returned."""
    return result if return_dgates else (result, None)

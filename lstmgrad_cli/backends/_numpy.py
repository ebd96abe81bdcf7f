"""The numpy backend: the shared array code (``_xp``) run on host arrays with numpy's BLAS."""

from __future__ import annotations

import numpy as np

from . import cpu_blas
from ._xp import XpGradient


class NumpyBackend:
    name = "numpy"

    def __init__(self, overlap: bool | None = None):
        self._gradient = XpGradient(np, overlap)

    @property
    def version(self) -> str:
        return np.__version__ + cpu_blas.version_note()

    def block_lstm_grad(self, tensors, *, seq_len_max, use_peephole, layout, compute_dtype,
                        chunk_steps=None, return_dgates=False, x_grad_out=None, observe=None):
        with np.errstate(all="ignore"):  # NaN/Inf in inputs are computed through, as TF does
            return self._gradient.block_lstm_grad(
                tensors, seq_len_max, use_peephole, layout, compute_dtype, chunk_steps, return_dgates,
                x_grad_out=x_grad_out, observe=observe,
            )

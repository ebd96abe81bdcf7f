"""The result types of the op functions, in TensorFlow's output order and names.

They are NamedTuples: index them, unpack them, or take ``._asdict()`` to write them (``np.savez``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class BlockLSTMGradOutputs(NamedTuple):
    """Outputs of BlockLSTMGrad / BlockLSTMGradV2, in TensorFlow's order and names."""

    x_grad: np.ndarray
    cs_prev_grad: np.ndarray
    h_prev_grad: np.ndarray
    w_grad: np.ndarray
    wci_grad: np.ndarray
    wcf_grad: np.ndarray
    wco_grad: np.ndarray
    b_grad: np.ndarray


class LSTMBlockCellGradOutputs(NamedTuple):
    """Outputs of LSTMBlockCellGrad; ``dicfo`` is [di, dci, df, do] (pre-activation, ICFO)."""

    cs_prev_grad: np.ndarray
    dicfo: np.ndarray
    wci_grad: np.ndarray
    wcf_grad: np.ndarray
    wco_grad: np.ndarray


class LSTMBlockCellGradFullOutputs(NamedTuple):
    """LSTMBlockCellGrad plus the gradients TF's registered cell gradient derived from ``dicfo``."""

    cs_prev_grad: np.ndarray
    dicfo: np.ndarray
    wci_grad: np.ndarray
    wcf_grad: np.ndarray
    wco_grad: np.ndarray
    x_grad: np.ndarray
    h_prev_grad: np.ndarray
    w_grad: np.ndarray
    b_grad: np.ndarray


class BlockLSTMOutputs(NamedTuple):
    """Outputs of LSTMBlockCell / BlockLSTM / BlockLSTMV2."""

    i: np.ndarray
    cs: np.ndarray
    f: np.ndarray
    o: np.ndarray
    ci: np.ndarray
    co: np.ndarray
    h: np.ndarray

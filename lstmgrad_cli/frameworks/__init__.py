"""Keras ``LSTM`` layers and PyTorch ``nn.LSTM`` modules as their users hold them, computed as the ops compute them.

Both frameworks' LSTMs are BlockLSTMV2 without peepholes, forget bias or clipping, in the IFCO gate order, per
layer and direction; what their users hold is a module's weights, its input, maybe initial states, per-example
lengths or a mask, and the gradient arriving at its output.  ``plan`` checks those tensors in the framework's names
and layouts and builds a ``Plan`` (common.py): the whole module to recompute and differentiate (modules.py), and
the way back to the framework's names.  pytorch.py and keras.py say how each framework lays its tensors out, api.py
holds the Python functions (``keras_lstm_grad``, ...), and names.py what the names alone say (whose tensors an input
holds, what to read): only that is loaded with the package, the rest on first use.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import numpy as np

from .names import FRAMEWORKS, FrameworkOptions, check_applicable, detect, file_names, framework_of, without_weights

__all__ = [
    "FRAMEWORKS", "KERAS_WALK_GROUPS", "FrameworkOptions", "KerasCellGradOutputs", "KerasLSTMGradOutputs",
    "KerasLayer", "Plan", "TorchCellGradOutputs", "TorchLSTMGradOutputs", "cells", "check_applicable", "detect",
    "file_names", "framework_of", "keras", "keras_cell_grad", "keras_config", "keras_layers", "keras_lstm_grad",
    "plan", "pytorch", "torch_cell_grad", "torch_lstm_grad", "torch_state_dict_layers", "unused", "weights_files",
    "without_weights",
]


class KerasLSTMGradOutputs(NamedTuple):
    """Gradients of a Keras LSTM layer, in Keras' names and layouts (bias_grad None without a bias)."""

    x_grad: np.ndarray
    kernel_grad: np.ndarray
    recurrent_kernel_grad: np.ndarray
    bias_grad: np.ndarray | None
    h0_grad: np.ndarray
    c0_grad: np.ndarray


class TorchLSTMGradOutputs(NamedTuple):
    """Gradients of one layer and direction of a PyTorch nn.LSTM (bias grads None without biases; equal)."""

    x_grad: np.ndarray
    weight_ih_grad: np.ndarray
    weight_hh_grad: np.ndarray
    bias_ih_grad: np.ndarray | None
    bias_hh_grad: np.ndarray | None
    h0_grad: np.ndarray
    c0_grad: np.ndarray


class TorchCellGradOutputs(NamedTuple):
    """Gradients of one nn.LSTMCell step (bias grads None without biases; equal)."""

    x_grad: np.ndarray
    weight_ih_grad: np.ndarray
    weight_hh_grad: np.ndarray
    bias_ih_grad: np.ndarray | None
    bias_hh_grad: np.ndarray | None
    h0_grad: np.ndarray
    c0_grad: np.ndarray


class KerasCellGradOutputs(NamedTuple):
    """Gradients of one Keras LSTMCell step (bias_grad None without a bias)."""

    x_grad: np.ndarray
    kernel_grad: np.ndarray
    recurrent_kernel_grad: np.ndarray
    bias_grad: np.ndarray | None
    h0_grad: np.ndarray
    c0_grad: np.ndarray


# Loaded on first use, so that the TF op's own tensors, which need only the names above, do not pay for the frameworks'
# modules and the layer engine under them: name -> (module, attribute or None for the module itself).
_LAZY = {
    **{module: (module, None) for module in ("api", "cells", "common", "keras", "keras_config", "keras_masks",
                                              "pytorch", "unused", "weights_files")},
    "Plan": ("common", "Plan"), "KerasLayer": ("keras", "KerasLayer"),
    "KERAS_WALK_GROUPS": ("weights_files", "KERAS_WALK_GROUPS"), "keras_layers": ("weights_files", "keras_layers"),
    "torch_state_dict_layers": ("pytorch", "state_dict_layers"), "torch_layers": ("pytorch", "layers_in"),
    **{name: ("api", name) for name in ("plan", "keras_lstm_grad", "keras_activation", "torch_lstm_grad",
                                        "torch_cell_grad", "keras_cell_grad")},
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _LAZY[name]
    loaded = importlib.import_module(f"{__name__}.{module}")
    value = loaded if attribute is None else getattr(loaded, attribute)
    globals()[name] = value  # (found directly from now on)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

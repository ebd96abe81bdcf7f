"""The activation functions a Keras LSTM layer may be built with, each with the derivative its framework uses.

TF's block-LSTM ops know only tanh (cell input and output) and the logistic sigmoid (gates); a Keras layer can be
made with others (``activation=``, ``recurrent_activation=``).  Each entry gives the function and its derivative
as a function of the pre-activation ``z`` and the value ``y``; at a kink the derivative is the one TensorFlow's
gradient of the framework's own formula gives there (relu and relu6: 0 at their kinks; a clip passes the gradient
at its bounds).

Keras 3 and Keras 2 (tf.keras) mean different functions by ``hard_sigmoid``: ``relu6(z + 3) / 6`` and
``clip(0.2 z + 0.5, 0, 1)``.  ``resolve`` turns a recorded name into the entry for the Keras version that wrote it
(``hard_sigmoid_keras2`` for the older one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from ..messages import cut
from ..ops.forward import sigmoid


@dataclass(frozen=True)
class Activation:
    """``function(z, xp)`` and ``derivative(z, y, xp)`` (dy/dz), computed with the array module ``xp`` (numpy, or
    cupy for device arrays: layers/device.py)."""

    name: str
    function: Callable[..., np.ndarray]
    derivative: Callable[..., np.ndarray]


def _relu6_hard_sigmoid(z, xp=np):  # Keras 3: relu6(z + 3) / 6
    return xp.minimum(xp.maximum(z + z.dtype.type(3), 0), 6) / z.dtype.type(6)


def _relu6_hard_sigmoid_derivative(z, y, xp=np):  # TF's relu6 gradient: 0 at both kinks
    shifted = z + z.dtype.type(3)
    return xp.where((shifted > 0) & (shifted < 6), z.dtype.type(1 / 6), z.dtype.type(0))


def _clip_hard_sigmoid(z, xp=np):  # Keras 2 (tf.keras): clip(0.2 z + 0.5, 0, 1)
    return xp.clip(z * z.dtype.type(0.2) + z.dtype.type(0.5), 0, 1)


def _clip_hard_sigmoid_derivative(z, y, xp=np):  # tf.clip_by_value's gradient passes at its bounds too
    linear = z * z.dtype.type(0.2) + z.dtype.type(0.5)
    return xp.where((linear >= 0) & (linear <= 1), z.dtype.type(0.2), z.dtype.type(0))


ACTIVATIONS: dict[str, Activation] = {
    "tanh": Activation("tanh", lambda z, xp=np: xp.tanh(z), lambda z, y, xp=np: 1 - y * y),
    "sigmoid": Activation("sigmoid", lambda z, xp=np: sigmoid(z, xp), lambda z, y, xp=np: y * (1 - y)),
    "relu": Activation("relu", lambda z, xp=np: xp.maximum(z, 0), lambda z, y, xp=np: (z > 0).astype(z.dtype)),
    "linear": Activation("linear", lambda z, xp=np: z.copy(), lambda z, y, xp=np: xp.ones_like(z)),
    "hard_sigmoid": Activation("hard_sigmoid", _relu6_hard_sigmoid, _relu6_hard_sigmoid_derivative),
    "hard_sigmoid_keras2": Activation("hard_sigmoid_keras2", _clip_hard_sigmoid, _clip_hard_sigmoid_derivative),
}
DEFAULT = ("tanh", "sigmoid")  # (activation, recurrent_activation): Keras' defaults, and what the TF ops compute


def resolve(name, keras_major: int = 3) -> str:
    """The ``ACTIVATIONS`` key of a recorded activation (a name, None for linear, or a Keras serialised object),
    for the Keras major version that wrote it; InvalidArgumentError naming what is not implemented."""
    if isinstance(name, dict):  # Keras 3 may serialise {"module": "keras.activations", "class_name": ..., ...}
        config, class_name = name.get("config"), name.get("class_name")
        if isinstance(config, str):
            name = config
        elif isinstance(class_name, str) and class_name not in ("function", "__lambda__"):
            name = class_name
        else:  # a lambda or a function saved by its code ({"value": [bytecode, ...]}), not by a name
            raise InvalidArgumentError("activation is a Python lambda or function saved by its code, not by a name: "
                                       f"lstmgrad cannot know what it computes (it computes {_known()})")
    if name is None:
        return "linear"
    if not isinstance(name, str):
        raise InvalidArgumentError(f"activation {cut(repr(name))} is not a name lstmgrad knows")
    key = name.strip().lower()
    if key == "hard_sigmoid" and keras_major < 3:
        key = "hard_sigmoid_keras2"
    if key not in ACTIVATIONS:
        raise InvalidArgumentError(f"activation {cut(repr(name))} is not implemented (lstmgrad computes {_known()})")
    return key


def _known() -> str:
    return ", ".join(ACTIVATIONS)

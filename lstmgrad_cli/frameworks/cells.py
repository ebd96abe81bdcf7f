"""One step of a PyTorch ``nn.LSTMCell`` or a Keras ``LSTMCell``, as a loop (a decoder with attention) calls it.

    h1, c1 = cell(x, (h0, c0))            # PyTorch
    out, [h1, c1] = cell(x, [h0, c0])     # Keras (out is h1)

Its user holds the cell's weights (PyTorch: ``weight_ih`` [4C, I], ``weight_hh`` [4C, C], ``bias_ih``,
``bias_hh`` [4C], a state_dict's keys without a layer suffix; Keras: ``kernel`` [I, 4C], ``recurrent_kernel``
[C, 4C], ``bias`` [4C], which a weights file keeps at ``vars/0, 1, 2`` of the cell's group), ``x`` [B, I] (PyTorch
also unbatched [I]), the states ``h0``, ``c0`` [B, C] (zeros when absent: a loop's first step) and the gradients
arriving at h1 and c1, ``h1_grad`` and ``c1_grad`` [B, C] (either may be absent: that output unused).

A step is the layer's recurrence over one step (T = 1): h1_grad is the gradient at its only output, c1_grad the
one at its final cell state.  The gradients come back in the cell's names (``weight_ih_grad``, ...,
``kernel_grad``, ...) with ``x_grad``, ``h0_grad`` and ``c0_grad``, in the shapes the user gave.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from ..layers.modules import Module
from ..layers.recurrence import DirectionGrads, DirectionWeights
from ..layers.schedule import Schedule
from ..messages import Command, Message, Param
from . import pytorch
from .common import Plan, cells, dtyped, rank, shaped
from .keras import KerasLayer
from .names import CELL_KERAS_ALIASES as KERAS_ALIASES
from .names import CELL_STATE_NAMES as STATE_NAMES

# Names a user of a layer, or of the TF op, gives for what a step calls otherwise: ignored, the gradient would be
# wrong, so they are refused with the step's name.
NEAR_MISSES = {"h_grad": "h1_grad", "hn_grad": "h1_grad", "c_grad": "c1_grad", "cn_grad": "c1_grad",
               "h": "h0", "c": "c0", "hx": "h0", "cx": "c0"}
STEP = "h1, c1 = cell(x, (h0, c0))"


MISSING_WEIGHTS = Message.format("the tensors are a cell step's (x, h0, c0, h1_grad, c1_grad), and its weights are "
                                 "missing: an nn.LSTMCell's weight_ih, weight_hh (bias_ih, bias_hh), or a Keras "
                                 "LSTMCell's kernel, recurrent_kernel (bias); give them in the file, or with {}",
                                 Param("weights"))


class CellPlan(Plan):
    def weight_grads(self, k, d, grads: DirectionGrads, xp=np) -> dict:
        I = grads.w_grad.shape[0] - self.module.layers[k][d].H  # noqa: E741
        if self.framework == "torch":
            out = {"weight_ih_grad": xp.ascontiguousarray(grads.w_grad[:I].T),
                   "weight_hh_grad": xp.ascontiguousarray(grads.w_grad[I:].T)}
            if "bias_ih" in self.tensors:
                out.update(bias_ih_grad=grads.b_grad, bias_hh_grad=grads.b_grad.copy())
            return out
        out = {"kernel_grad": grads.w_grad[:I], "recurrent_kernel_grad": grads.w_grad[I:]}
        if "bias" in self.tensors:
            out["bias_grad"] = grads.b_grad
        return out

    @property
    def computed_as(self) -> str:
        return super().computed_as + ", over one step"


def plan(framework: str, tensors: dict, *, keys=(), layer: KerasLayer | None = None) -> CellPlan:
    """Check the tensors of one cell step (``framework`` "torch" or "keras"; ``keys``: every name the user's input
    holds, for names a step would not read) and build what computes its gradients."""
    if framework == "keras":
        tensors = {**{n: tensors[n] for n in STATE_NAMES if n in tensors}, **{
            name: next(tensors[a] for a in aliases if a in tensors) for name, aliases in KERAS_ALIASES.items()
            if any(a in tensors for a in aliases)}}
    _refuse_unread(framework, [*keys, *tensors])
    weights = ("weight_ih", "weight_hh") if framework == "torch" else ("kernel", "recurrent_kernel")
    missing = [n for n in ("x", *weights) if tensors.get(n) is None]
    if missing:
        cell = "an nn.LSTMCell" if framework == "torch" else "a Keras LSTMCell"
        optional = "bias_ih, bias_hh" if framework == "torch" else "bias"
        raise InvalidArgumentError(f"missing tensor{'s' * (len(missing) > 1)} {', '.join(missing)} (one step of "
                                   f"{cell}, {STEP}, needs x, {', '.join(weights)} and h1_grad or c1_grad; "
                                   f"{optional}, h0, c0 are optional)")
    arrays = dtyped(tensors)
    x = arrays["x"]
    unbatched = framework == "torch" and x.ndim == 1
    if x.ndim == 3:
        raise InvalidArgumentError(Message.format("x has shape {}, a sequence: a cell computes one step, x [B, I]; {} "
                                                  "computes a whole layer (an nn.LSTM's weight_ih_l0, ..., a Keras "
                                                  "LSTM's kernel, ...)", list(x.shape), Command("seq")))
    x = rank("x", x[None] if unbatched else x, 2, "[B, I]" + (" (or unbatched [I])" if framework == "torch" else ""))
    B, I = x.shape  # noqa: E741
    layer = layer or KerasLayer()
    direction = _torch_weights(arrays, I, x.dtype) if framework == "torch" else _keras_weights(arrays, I, layer,
                                                                                                  x.dtype)
    C = direction.C
    h0, c0, h1_grad, c1_grad = (_state(n, arrays.get(n), B, C, unbatched) for n in STATE_NAMES[1:])
    if h1_grad is None and c1_grad is None:
        raise InvalidArgumentError(f"missing tensor h1_grad or c1_grad: the gradients arriving at the step's new h "
                                   f"and c ({STEP}; one of them may be absent, that output unused)")
    zeros = np.zeros((B, C), x.dtype)
    notes = []
    if framework == "keras" and not layer.source:
        notes.append("a Keras LSTMCell's options are in no weights file: Keras' defaults assumed, activation=tanh, "
                     "recurrent_activation=sigmoid (keras_cell_grad takes others)")
    what = "PyTorch nn.LSTMCell step" if framework == "torch" else "Keras LSTMCell step"
    if (direction.activation, direction.recurrent_activation) != ("tanh", "sigmoid"):
        what += f", activation={direction.activation}, recurrent_activation={direction.recurrent_activation}"
    return CellPlan(
        framework, Module([[direction]], [Schedule.plain(1, B)]), np.ascontiguousarray(x[None]),
        (zeros if h0 is None else h0)[None], (zeros if c0 is None else c0)[None],
        None if h1_grad is None else h1_grad[None], None, None, None if c1_grad is None else c1_grad[None],
        False, (C,) if unbatched else (B, C), arrays, notes=notes,
        description=what + (", unbatched" if unbatched else ""), unbatched=unbatched, step=True)


def _refuse_unread(framework: str, keys) -> None:
    """A name a step would not read, where it means something the user meant (a layer's h_grad, a loop's h and c,
    an nn.LSTM's weights): refused, with the name the step reads."""
    keys = set(keys)
    if framework == "torch" and any(pytorch.WEIGHT.match(k) for k in keys):
        raise InvalidArgumentError(Message.format("weight_ih_l0, ... are an nn.LSTM's (a whole layer), not an "
                                                  "nn.LSTMCell's (one step, weight_ih without a layer suffix): {} "
                                                  "computes it, a one-step sequence too (x [1, B, I], or unbatched "
                                                  "[T, I])", Command("seq")))
    found = [k for k in NEAR_MISSES if k in keys]
    if found:
        name, means = found[0], NEAR_MISSES[found[0]]
        what = ("the gradient arriving at the step's new h, or c" if "grad" in name else
                "the state the step starts from; the ones it returns are not read")
        raise InvalidArgumentError(f"{name} is there, and one cell step ({STEP}) reads {means}: give {what} as "
                                   f"{means}")
    for name in ("lengths", "mask"):
        if name in keys:
            raise InvalidArgumentError(f"{name} is there, and one cell step has none (every example runs it); "
                                       "a loop that skips an example's step does so outside the cell")


def _torch_weights(arrays: dict, I: int, dtype) -> DirectionWeights:  # noqa: E741
    w_hh = rank("weight_hh", arrays["weight_hh"], 2, "[4C, C]")
    C = cells("weight_hh", w_hh.shape[0], w_hh.shape[1], "PyTorch")
    w_ih = shaped("weight_ih", rank("weight_ih", arrays["weight_ih"], 2, "[4C, I]"), (4 * C, I), "[4C, I]")
    if ("bias_ih" in arrays) != ("bias_hh" in arrays):
        raise InvalidArgumentError("bias_ih and bias_hh come together (bias=True) or not at all (bias=False)")
    b = np.zeros(4 * C, dtype)
    if "bias_ih" in arrays:
        b = shaped("bias_ih", arrays["bias_ih"], (4 * C,), "[4C]") + shaped("bias_hh", arrays["bias_hh"], (4 * C,),
                                                                           "[4C]")
    return DirectionWeights(np.concatenate([w_ih.T, w_hh.T]), b.astype(dtype))


def _keras_weights(arrays: dict, I: int, layer: KerasLayer, dtype) -> DirectionWeights:  # noqa: E741
    recurrent = rank("recurrent_kernel", arrays["recurrent_kernel"], 2, "[C, 4C]")
    C = cells("recurrent_kernel", recurrent.shape[1], recurrent.shape[0], "Keras")
    kernel = shaped("kernel", rank("kernel", arrays["kernel"], 2, "[I, 4C]"), (I, 4 * C), "[I, 4C]")
    b = np.zeros(4 * C, dtype) if "bias" not in arrays else shaped("bias", arrays["bias"], (4 * C,), "[4C]")
    return DirectionWeights(np.concatenate([kernel, recurrent]), b.astype(dtype), layer.activation,
                            layer.recurrent_activation)


def _state(name: str, value, B: int, C: int, unbatched: bool) -> np.ndarray | None:
    """A state or an output's gradient, [B, C] ([C] for an unbatched step, given a batch axis of one)."""
    if value is None:
        return None
    value = np.asarray(value)
    want = (C,) if unbatched else (B, C)
    if value.shape != want:
        label = "[C]" if unbatched else "[B, C]"
        raise InvalidArgumentError(f"{name} has shape {list(value.shape)}, expected {label} = {list(want)}"
                                   + (" (x is unbatched [I])" if unbatched else ""))
    return value.reshape(B, C)

"""One direction of one LSTM layer: the forward pass lstmgrad recomputes, and its backward pass.

With the default activations (tanh for the cell, sigmoid for the gates) a direction is BlockLSTMV2 without
peepholes, forget bias or clipping, in the IFCO gate layout: it is computed by the op functions (ops.py), so by
any backend.  With other activations (a Keras layer made with ``activation='relu'``, ``hard_sigmoid`` gates, ...)
the same recurrence runs here with the activations' own derivatives (activations.py), and so does a projected
one (PyTorch's ``proj_size``: h = (o * tanh(c)) @ projection, P wide, is what the layer outputs and
what its next step reads; the cell state c stays C wide).

Either way the steps each example runs, and where its outputs go, are the ``Schedule``'s (schedule.py): the op
sees x in run order, one example per column, the steps an example does not run at the end, on zeros.

Everything here computes where the schedule's device is (device.py): numpy's arrays on the host, or a GPU
backend's on its device, with its array module (``xp``); the backend's gradient takes and returns them there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import ops
from ..ops import validation
from ..ops.forward import block_lstm_forward
from ..results import BlockLSTMGradOutputs, BlockLSTMOutputs
from ..spec import LAYOUT_V2
from . import activations
from .device import Device
from .schedule import Schedule


@dataclass(frozen=True)
class DirectionWeights:
    """A direction's weights in the op's layout: ``w`` = [input weights; recurrent weights] [I + H, 4C] and ``b``
    [4C], gates in the order i, f, c, o; the activations it applies (``activations.ACTIVATIONS`` keys); and a
    ``projection`` [C, P] of its output (PyTorch's weight_hr transposed), None without one (H = P with it, else C).
    """

    w: np.ndarray
    b: np.ndarray
    activation: str = "tanh"
    recurrent_activation: str = "sigmoid"
    projection: np.ndarray | None = None

    @property
    def C(self) -> int:  # noqa: N802 - the op's name for the cell size
        return self.w.shape[1] // 4

    @property
    def H(self) -> int:  # noqa: N802 - the width of h: the output, and the recurrent input
        return self.C if self.projection is None else self.projection.shape[1]

    @property
    def standard(self) -> bool:
        """Whether this is BlockLSTMV2's maths (the op functions and backends compute it)."""
        return (self.activation, self.recurrent_activation) == activations.DEFAULT and self.projection is None

    def astype(self, dtype) -> DirectionWeights:
        return replace(self, w=self.w.astype(dtype), b=self.b.astype(dtype),
                       projection=None if self.projection is None else self.projection.astype(dtype))

    def placed(self, device: Device) -> DirectionWeights:
        """These weights on ``device`` (copied there once)."""
        if device.on_host:
            return self
        return replace(self, w=device.put(self.w), b=device.put(self.b), projection=device.put(self.projection))


@dataclass
class DirectionPass:
    """What a direction's forward pass leaves for its backward pass."""

    weights: DirectionWeights
    schedule: Schedule
    x: np.ndarray  # [T, B, I] the op's x (run order)
    h0: np.ndarray
    c0: np.ndarray
    outputs: BlockLSTMOutputs  # i, cs, f, o, ci, co [T, B, C], h [T, B, H] (run order; zeros after seq_len_max)
    compute_dtype: np.dtype

    def returned(self) -> np.ndarray:
        """The output sequence the layer returns [T, B, C] (in the order it returns it)."""
        return self.schedule.outputs(self.outputs.h)

    def returned_last(self) -> np.ndarray:
        """The last output the layer returns [B, C] (its output without return_sequences)."""
        return self.schedule.last_output(self.outputs.h, self.h0)

    def final_states(self) -> tuple[np.ndarray, np.ndarray]:
        """(h_n, c_n) [B, C]: each example's state after its last step."""
        return self.schedule.final(self.outputs.h, self.h0), self.schedule.final(self.outputs.cs, self.c0)


@dataclass
class DirectionGrads:
    x_grad: np.ndarray  # [T, B, I] in x's time order
    w_grad: np.ndarray
    b_grad: np.ndarray
    h0_grad: np.ndarray
    c0_grad: np.ndarray
    projection_grad: np.ndarray | None = None  # [C, P], with a projection


def forward(weights: DirectionWeights, schedule: Schedule, x: np.ndarray, h0: np.ndarray, c0: np.ndarray,
            compute_dtype=None) -> DirectionPass:
    """Run one direction over ``x`` [T, B, I] (time-major, x's time order) from the state (h0, c0), where the
    schedule computes (its ``device``; the arrays are there)."""
    xp = schedule.device.xp
    run_x = schedule.run_x(x)
    cdt = validation.resolve_compute_dtype(run_x.dtype, compute_dtype)
    steps = schedule.seq_len_max
    if weights.standard:  # BlockLSTMV2 (ops.block_lstm_v2 without its checks: the framework's are made)
        zeros = xp.zeros(weights.C, run_x.dtype)
        outputs = BlockLSTMOutputs(*block_lstm_forward(
            steps, run_x, c0, h0, weights.w, zeros, zeros, zeros, weights.b,
            forget_bias=0.0, cell_clip=0.0, use_peephole=False, layout=LAYOUT_V2, compute_dtype=cdt, xp=xp))
    else:
        outputs = _forward(weights, run_x, h0, c0, steps, cdt, xp)
    return DirectionPass(weights, schedule, run_x, h0, c0, outputs, cdt)


def backward(state: DirectionPass, h_grad: np.ndarray | None = None, last_grad: np.ndarray | None = None,
             hn_grad: np.ndarray | None = None, cn_grad: np.ndarray | None = None, *,
             backend=None) -> DirectionGrads:
    """The gradients of one direction, from those arriving at its returned outputs (``h_grad`` [T, B, C], in the
    order it returns them; ``last_grad`` [B, C] at the last one) and at its final states."""
    schedule, weights = state.schedule, state.weights
    xp = schedule.device.xp
    dtype = state.x.dtype
    op_h_grad = schedule.run_h_grad(h_grad, last_grad, weights.H, dtype)
    op_cs_grad = xp.zeros((schedule.T, schedule.B, weights.C), dtype)
    schedule.place_final(op_h_grad, hn_grad)
    schedule.place_final(op_cs_grad, cn_grad)
    projection_grad = None
    if weights.standard:
        zeros = xp.zeros(weights.C, dtype)
        grads = ops.block_lstm_grad_v2(schedule.seq_len_max, state.x, state.c0, state.h0, weights.w, zeros, zeros,
                                       zeros, weights.b, *state.outputs, op_cs_grad, op_h_grad, False,
                                       backend=backend, compute_dtype=state.compute_dtype)
    else:
        grads, projection_grad = _backward(state, op_cs_grad, op_h_grad, xp)
    h0_grad, c0_grad = grads.h_prev_grad.copy(), grads.cs_prev_grad.copy()
    schedule.bypass_final(h0_grad, hn_grad)
    schedule.bypass_final(c0_grad, cn_grad)
    return DirectionGrads(schedule.x_grad(grads.x_grad), grads.w_grad, grads.b_grad, h0_grad, c0_grad,
                          projection_grad)


# -- any activations, and a projection: the recurrence on xp's arrays --------------------------------------------------

def _gates(z: np.ndarray, C: int):
    return z[:, :C], z[:, C:2 * C], z[:, 2 * C:3 * C], z[:, 3 * C:]  # IFCO


def _forward(weights: DirectionWeights, x, h0, c0, steps: int, cdt, xp) -> BlockLSTMOutputs:
    """The recurrence with the direction's activations; pre-activations are recomputed by ``_backward``."""
    act = activations.ACTIVATIONS[weights.activation]
    gate = activations.ACTIVATIONS[weights.recurrent_activation]
    T, B, I = x.shape
    C, H = weights.C, weights.H
    w, b = weights.w.astype(cdt), weights.b.astype(cdt)
    projection = None if weights.projection is None else weights.projection.astype(cdt)
    outs = [xp.zeros((T, B, C), x.dtype) for _ in range(6)] + [xp.zeros((T, B, H), x.dtype)]
    h, c = h0.astype(cdt), c0.astype(cdt)
    with np.errstate(all="ignore"):  # NaN/Inf in the inputs are computed through
        zx = x[:steps].astype(cdt) @ w[:I] + b
        for t in range(steps):
            zi, zf, zc, zo = _gates(zx[t] + h @ w[I:], C)
            i, f, o, ci = gate.function(zi, xp), gate.function(zf, xp), gate.function(zo, xp), act.function(zc, xp)
            c = f * c + i * ci
            co = act.function(c, xp)
            h = o * co if projection is None else (o * co) @ projection
            for store, value in zip(outs, (i, c, f, o, ci, co, h), strict=True):
                store[t] = value
            c, h = outs[1][t].astype(cdt), outs[6][t].astype(cdt)  # carried as stored, as the op does
    return BlockLSTMOutputs(*outs)


def _backward(state: DirectionPass, cs_grad, h_grad, xp) -> tuple[BlockLSTMGradOutputs, np.ndarray | None]:
    """The op's gradients, and the projection's ([C, P]; None without one)."""
    weights = state.weights
    act = activations.ACTIVATIONS[weights.activation]
    gate = activations.ACTIVATIONS[weights.recurrent_activation]
    cdt = state.compute_dtype
    x = state.x
    T, B, I = x.shape
    C, H = weights.C, weights.H
    steps = state.schedule.seq_len_max
    w, b = weights.w.astype(cdt), weights.b.astype(cdt)
    projection = None if weights.projection is None else weights.projection.astype(cdt)
    a = {name: getattr(state.outputs, name)[:steps].astype(cdt) for name in ("cs", "h", "i", "f", "o", "ci", "co")}
    h_prev = xp.concatenate([state.h0.astype(cdt)[None], a["h"][:-1]]) if steps else a["h"]
    c_prev = xp.concatenate([state.c0.astype(cdt)[None], a["cs"][:-1]]) if steps else a["cs"]
    dz = xp.zeros((steps, B, 4 * C), cdt)
    dh_next, dc_next = xp.zeros((B, H), cdt), xp.zeros((B, C), cdt)
    projection_grad = None if projection is None else xp.zeros_like(projection)
    with np.errstate(all="ignore"):
        z = x[:steps].astype(cdt) @ w[:I] + h_prev @ w[I:] + b  # the pre-activations, as the forward made them
        for t in range(steps - 1, -1, -1):
            zi, zf, zc, zo = _gates(z[t], C)
            dh = h_grad[t].astype(cdt) + dh_next
            if projection is not None:  # h = r @ projection, r = o * co
                projection_grad += (a["o"][t] * a["co"][t]).T @ dh
                dh = dh @ projection.T
            dc = cs_grad[t].astype(cdt) + dc_next + dh * a["o"][t] * act.derivative(a["cs"][t], a["co"][t], xp)
            di, df, dci, do = _gates(dz[t], C)
            do[:] = dh * a["co"][t] * gate.derivative(zo, a["o"][t], xp)
            di[:] = dc * a["ci"][t] * gate.derivative(zi, a["i"][t], xp)
            df[:] = dc * c_prev[t] * gate.derivative(zf, a["f"][t], xp)
            dci[:] = dc * a["i"][t] * act.derivative(zc, a["ci"][t], xp)
            dh_next = dz[t] @ w[I:].T
            dc_next = dc * a["f"][t]
        x_grad = xp.zeros((T, B, I), x.dtype)
        x_grad[:steps] = dz @ w[:I].T
        flat = dz.reshape(-1, 4 * C)
        w_grad = xp.concatenate([x[:steps].astype(cdt).reshape(-1, I).T @ flat, h_prev.reshape(-1, H).T @ flat])
    zeros = xp.zeros(C, x.dtype)
    grads = BlockLSTMGradOutputs(x_grad, dc_next.astype(x.dtype), dh_next.astype(x.dtype), w_grad.astype(x.dtype),
                                 zeros, zeros, zeros, flat.sum(axis=0).astype(x.dtype))
    return grads, None if projection_grad is None else projection_grad.astype(x.dtype)

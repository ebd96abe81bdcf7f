"""Whole recurrent modules as frameworks build them: layers stacked, each with one or two directions.

A PyTorch ``nn.LSTM(num_layers=L, bidirectional=...)`` feeds each layer the concatenation of the layer below's two
directions; a Keras ``Bidirectional`` merges its two layers' outputs (concat, sum, mul, ave).  A ``Module`` holds
each direction's weights and ``Schedule`` (recurrence.py, schedule.py), recomputes the forward pass layer by layer
and runs the backward pass from the top: the gradient arriving at a layer's input is the one arriving at the
output of the layer below.

Everything here is time-major ([T, B, ...]) and in x's time order; framework layouts are frameworks.py's business.
A module ``placed`` on a GPU backend's device (device.py) computes there: its weights and schedules are copied
once, and the arrays it is given must be there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError
from . import recurrence
from .device import Device
from .recurrence import DirectionWeights
from .schedule import Schedule

MERGE_MODES = ("concat", "sum", "mul", "ave")


@dataclass
class Module:
    """``layers[k][d]``: the weights of layer k, direction d (0 forwards, 1 backwards), with the schedule of each
    direction (the same for every layer: ``schedules[d]``)."""

    layers: list[list[DirectionWeights]]
    schedules: list[Schedule]
    merge: str = "concat"  # how a layer's two directions make its output (PyTorch: always concat)
    passes: list = field(default_factory=list, repr=False)  # the forward pass, for the backward one

    @property
    def directions(self) -> int:
        return len(self.schedules)

    @property
    def C(self) -> int:  # noqa: N802
        return self.layers[-1][0].C

    @property
    def H(self) -> int:  # noqa: N802 - the width of h (the projection's, where the layers project it)
        return self.layers[-1][0].H

    @property
    def device(self) -> Device:
        return self.schedules[0].device

    def placed(self, device: Device) -> Module:
        """This module computing on ``device``: its weights copied there once (itself where it is there)."""
        if device == self.device:
            return self
        return Module([[w.placed(device) for w in layer] for layer in self.layers],
                      [s.placed(device) for s in self.schedules], self.merge)

    def astype(self, dtype) -> Module:
        """The same module with its weights in ``dtype`` (and no forward pass yet)."""
        return Module([[w.astype(dtype) for w in layer] for layer in self.layers], self.schedules, self.merge)

    def forward(self, x: np.ndarray, h0: np.ndarray, c0: np.ndarray, compute_dtype=None) -> np.ndarray:
        """Run every layer on ``x`` [T, B, I] from the initial states ``h0`` [L*D, B, H], ``c0`` [L*D, B, C]
        (PyTorch's order: layer-major); returns the top layer's output sequence (merged directions)."""
        self.passes = []
        inputs = x
        for k, layer in enumerate(self.layers):
            passes = [recurrence.forward(weights, self.schedules[d], inputs, h0[k * self.directions + d],
                                         c0[k * self.directions + d], compute_dtype)
                      for d, weights in enumerate(layer)]
            self.passes.append(passes)
            inputs = self._merged([p.returned() for p in passes])
        return inputs

    def _merged(self, outputs: list[np.ndarray]) -> np.ndarray:
        if len(outputs) == 1:
            return outputs[0]
        if self.merge == "concat":
            return self.device.xp.concatenate(outputs, axis=-1)
        if self.merge == "sum":
            return outputs[0] + outputs[1]
        if self.merge == "mul":
            return outputs[0] * outputs[1]
        return (outputs[0] + outputs[1]) / 2

    def _split(self, grad: np.ndarray, outputs: list[np.ndarray]) -> list[np.ndarray]:
        """The gradient at each direction's output from the gradient at the merged output."""
        if len(outputs) == 1:
            return [grad]
        C = outputs[0].shape[-1]
        if self.merge == "concat":
            return [grad[..., :C], grad[..., C:]]
        if self.merge == "sum":
            return [grad, grad]
        if self.merge == "mul":
            return [grad * outputs[1], grad * outputs[0]]
        return [grad / 2, grad / 2]

    def backward(self, h_grad: np.ndarray | None, last_grad: np.ndarray | None, hn_grad: np.ndarray | None,
                 cn_grad: np.ndarray | None, *, backend=None) -> dict:
        """The gradients from those at the top layer's output (``h_grad`` [T, B, width] the sequence,
        ``last_grad`` [B, width] its last output only) and at the final states (``hn_grad`` [L*D, B, H],
        ``cn_grad`` [L*D, B, C]).  Returns {"x_grad", "h0_grad" ([L*D, B, H]), "c0_grad" ([L*D, B, C]),
        (k, d): DirectionGrads}."""
        D = self.directions
        B = self.schedules[0].B
        dtype = self.passes[0][0].x.dtype
        xp = self.device.xp
        h0_grad = xp.zeros((len(self.layers) * D, B, self.H), dtype)
        c0_grad = xp.zeros((len(self.layers) * D, B, self.C), dtype)
        out: dict = {}
        for k in range(len(self.layers) - 1, -1, -1):
            passes = self.passes[k]
            top = k == len(self.layers) - 1
            seq_grads = self._split(h_grad, [p.returned() for p in passes]) if h_grad is not None else [None] * D
            last_grads = [None] * D
            if top and last_grad is not None:
                last_grads = self._split(last_grad, [p.returned_last() for p in passes])
            x_grad = None
            for d, state in enumerate(passes):
                index = k * D + d
                grads = recurrence.backward(state, seq_grads[d], last_grads[d],
                                            None if hn_grad is None else hn_grad[index],
                                            None if cn_grad is None else cn_grad[index], backend=backend)
                out[(k, d)] = grads
                h0_grad[index], c0_grad[index] = grads.h0_grad, grads.c0_grad
                x_grad = grads.x_grad if x_grad is None else x_grad + grads.x_grad
            h_grad = x_grad  # the gradient at the output of the layer below
        out["x_grad"], out["h0_grad"], out["c0_grad"] = h_grad, h0_grad, c0_grad
        return out


def check_merge(mode) -> str:
    if mode not in MERGE_MODES:
        raise InvalidArgumentError(f"a Bidirectional with merge_mode={mode!r} is not implemented (lstmgrad computes "
                                   f"{', '.join(MERGE_MODES)})")
    return mode

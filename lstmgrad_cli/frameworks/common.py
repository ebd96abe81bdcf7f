"""What the Keras and PyTorch views share: their options, the checks of their tensors, and the ``Plan`` each
builds from a user's tensors (a ``Module`` to compute, and how its gradients are named and laid out)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import backends
from ..errors import InvalidArgumentError
from ..layers import device as devices
from ..layers.modules import Module
from ..layers.recurrence import DirectionGrads
from ..messages import Message, Param
from ..ops import validation
from ..results import BlockLSTMGradOutputs
from .names import FrameworkOptions, check_applicable  # noqa: F401 - (the views' shared options, re-exported)

# Where the layer engine computes a recurrence the op does not (layers/device.py), in words for the summary.
ENGINE = "by lstmgrad's layer engine (numpy; cupy on a GPU backend)"


@dataclass
class Plan:
    """A framework's module as the user holds it, ready to compute: the ``Module`` (modules.py), its inputs
    time-major in x's time order, and how its gradients go back to the user's names and layouts."""

    framework: str  # "keras" | "torch"
    module: Module
    x: np.ndarray  # [T, B, I]
    h0: np.ndarray  # [L*D, B, H] (H: the projection's width, else C)
    c0: np.ndarray  # [L*D, B, C]
    h_grad: np.ndarray | None  # [T, B, width] at the returned output sequence
    last_grad: np.ndarray | None  # [B, width] at its last output only
    hn_grad: np.ndarray | None  # [L*D, B, H]
    cn_grad: np.ndarray | None  # [L*D, B, C]
    batch_major: bool  # x (and x_grad) are [B, T, I] for the user
    state_shape: tuple  # the shape the user's h0 (and so h0_grad) has
    tensors: dict = field(default_factory=dict)  # what the user gave (checked), in their names
    notes: list[str] = field(default_factory=list)  # what was assumed or read from a model's configuration
    warnings: list[str] = field(default_factory=list)  # what may make the gradient not the one the user took
    description: str = ""  # "PyTorch nn.LSTM, 2 layers x 2 directions", for the summary
    c_state_shape: tuple | None = None  # the shape of the user's c0 (and c0_grad); None: ``state_shape``
    unbatched: bool = False  # the user's x (and x_grad) has no batch axis (B = 1 here)
    step: bool = False  # one cell step: the user's x (and x_grad) has no time axis (T = 1 here)
    result_dtypes: dict = field(default_factory=dict)  # gradient -> its dtype, where it is not x's (mixed precision)

    @property
    def single(self) -> bool:
        """One direction of one layer with the op's own maths: computable as one BlockLSTMGradV2 problem."""
        return len(self.module.layers) == 1 and self.module.directions == 1 and self.module.layers[0][0].standard

    @property
    def not_one_op(self) -> str:
        """Why this plan is not one op's problem (for what needs one: per-step norms, the op's gradient check)."""
        if len(self.module.layers) > 1 or self.module.directions > 1:
            return Message.format("this is {}, several layers or directions: give {} (and {}) for one of them",
                                  self.description, Param("layer"), Param("reverse"))
        if self.projected:
            return f"this is {self.description}, whose projection of h is not in the op"
        return f"this is {self.description}, whose activations are not the op's (tanh, sigmoid)"

    @property
    def projected(self) -> bool:
        return any(w.projection is not None for layer in self.module.layers for w in layer)

    @property
    def computed_as(self) -> str:
        """How the gradients are computed, in words for the summary."""
        if self.projected:
            return f"the LSTM recurrence with its projection of h, recomputed and differentiated {ENGINE}"
        if not all(w.standard for layer in self.module.layers for w in layer):
            return f"the LSTM recurrence with the layer's activations, recomputed and differentiated {ENGINE}"
        each = "" if self.single else " per layer and direction"
        return f"BlockLSTMGradV2 of the recomputed BlockLSTMV2{each}"

    @property
    def dims(self) -> tuple[int, int, int, int]:
        T, B, I = self.x.shape
        return T, B, I, self.module.C

    def gradients(self, backend=None, compute_dtype=None, *, on_device: bool = False) -> dict:
        """Every gradient, in the framework's names and layouts.  A compute dtype wider than the tensors' (float64
        for float32 ones; float32, the default, for float16) holds through the whole pass, the recomputed forward
        included: the gradients are rounded to the tensors' dtype once, at the end.

        On a backend that computes GPU arrays (the cupy backend: layers/device.py) the whole pass runs on its
        device: the tensors are copied there once each, the gradients back once each, or, ``on_device`` (the
        caller's tensors were there), left there as the device's arrays."""
        backend = backends.get_backend(backend)
        device = devices.of(backend)
        dtype = self.x.dtype
        cdt = validation.resolve_compute_dtype(dtype, compute_dtype)
        module = self.module.placed(device)
        given = [device.put(a) for a in (self.x, self.h0, self.c0, self.h_grad, self.last_grad, self.hn_grad,
                                         self.cn_grad)]
        if cdt.itemsize <= dtype.itemsize:
            module.forward(*given[:3], compute_dtype)
            grads = self._named(module.backward(*given[3:], backend=backend), device.xp)
        else:
            module = module.astype(cdt)
            wide = [None if a is None else a.astype(cdt) for a in given]
            module.forward(*wide[:3])
            grads = module.backward(*wide[3:], backend=backend)
            grads = {name: value.astype(dtype) for name, value in self._named(grads, device.xp).items()}
        grads = self._retyped(grads)
        if device.on_host or on_device:
            return grads
        return {name: device.back(value) for name, value in grads.items()}

    def _retyped(self, grads: dict) -> dict:
        """Each gradient in its ``result_dtypes`` dtype, from the dtype it was computed and rounded to."""
        return {name: value.astype(self.result_dtypes[name]) if name in self.result_dtypes else value
                for name, value in grads.items()}

    # -- one direction as the op's own problem (per-step reports, checks, chunked and lazy runs) ----------------

    def op_tensors(self) -> tuple[dict, int]:
        """The BlockLSTMGradV2 inputs without activations (they are recomputed) and the seq_len_max to use, for a
        ``single`` plan."""
        weights, schedule = self.module.layers[0][0], self.module.schedules[0]
        C = weights.C
        h_grad = schedule.run_h_grad(self.h_grad, self.last_grad, C, self.x.dtype)
        cs_grad = np.zeros_like(h_grad)
        schedule.place_final(h_grad, None if self.hn_grad is None else self.hn_grad[0])
        schedule.place_final(cs_grad, None if self.cn_grad is None else self.cn_grad[0])
        zeros = np.zeros(C, self.x.dtype)
        op = {"x": schedule.run_x(self.x), "cs_prev": self.c0[0], "h_prev": self.h0[0], "w": weights.w,
              "wci": zeros, "wcf": zeros, "wco": zeros, "b": weights.b, "cs_grad": cs_grad, "h_grad": h_grad}
        return op, schedule.seq_len_max

    def from_op(self, grads: BlockLSTMGradOutputs) -> dict:
        """A ``single`` plan's gradients from the op's."""
        schedule = self.module.schedules[0]
        h0_grad, c0_grad = grads.h_prev_grad.copy(), grads.cs_prev_grad.copy()
        schedule.bypass_final(h0_grad, None if self.hn_grad is None else self.hn_grad[0])
        schedule.bypass_final(c0_grad, None if self.cn_grad is None else self.cn_grad[0])
        direction = DirectionGrads(schedule.x_grad(np.asarray(grads.x_grad)), grads.w_grad, grads.b_grad, h0_grad,
                                   c0_grad)
        return self._retyped(self._named({"x_grad": direction.x_grad, "h0_grad": h0_grad[None],
                                          "c0_grad": c0_grad[None], (0, 0): direction}))

    # -- naming ----------------------------------------------------------------------------------------------

    def _named(self, grads: dict, xp=np) -> dict:
        """The gradients under the framework's names and in its layouts, arrays of ``xp`` (where they are)."""
        x_grad = grads["x_grad"]
        x_grad = xp.swapaxes(x_grad, 0, 1) if self.batch_major else x_grad
        x_grad = x_grad[0] if self.step else x_grad
        out = {"x_grad": xp.ascontiguousarray(x_grad[..., 0, :] if self.unbatched else x_grad)}
        for k, layer in enumerate(self.module.layers):
            for d in range(len(layer)):
                out.update(self.weight_grads(k, d, grads[(k, d)], xp))
        out["h0_grad"] = grads["h0_grad"].reshape(self.state_shape)
        out["c0_grad"] = grads["c0_grad"].reshape(self.c_state_shape or self.state_shape)
        return out

    def weight_grads(self, k: int, d: int, grads: DirectionGrads, xp=np) -> dict:
        """Layer k, direction d's weight gradients under the framework's names (``xp``: the arrays' module)."""
        raise NotImplementedError

    def axes(self) -> dict[str, tuple[str, ...]]:
        """What each axis of x_grad, h0_grad and c0_grad is as the user holds them: "t" time, "b" batch, "i" input,
        "n" layers x directions, "c" cell."""
        x = ("b", "t", "i") if self.batch_major else ("t", "b", "i")
        x = tuple(a for a in x if not (a == "t" and self.step or a == "b" and self.unbatched))
        state = tuple(a for a in ("n", "b", "c") if not (a == "b" and self.unbatched))
        return {"x_grad": x, "h0_grad": state[-len(self.state_shape):],
                "c0_grad": state[-len(self.c_state_shape or self.state_shape):]}


# -- checks of what the user gave ------------------------------------------------------------------------

def dtyped(tensors: dict, exempt=("lengths", "mask")) -> dict:
    """Float arrays of one dtype (as the op needs), said in the framework's names; ``exempt`` tensors (integers,
    booleans) are checked where they are used."""
    arrays = {n: np.asarray(v) for n, v in tensors.items() if v is not None}
    floats = {n: a for n, a in arrays.items() if n not in exempt}
    for name, a in floats.items():
        if a.dtype.kind != "f" or a.dtype.itemsize not in (2, 4, 8):
            raise InvalidArgumentError(f"{name} has dtype {a.dtype}; expected float16, float32 or float64")
    dtypes = {a.dtype for a in floats.values()}
    if len(dtypes) > 1:
        first, *_ = floats
        other = next(n for n, a in floats.items() if a.dtype != floats[first].dtype)
        raise InvalidArgumentError(f"all tensors must have one dtype: {first} is {floats[first].dtype} but {other} "
                                   f"is {floats[other].dtype}")
    return arrays


def rank(name: str, a, expected: int, label: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != expected:
        raise InvalidArgumentError(f"{name} must be rank {expected} {label} but has shape {list(a.shape)}")
    return a


def shaped(name: str, a, shape: tuple, label: str) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != tuple(shape):
        raise InvalidArgumentError(f"{name} has shape {list(a.shape)}, expected {label} = {list(shape)}")
    return a


def nonempty(x_shape: tuple, framework: str) -> None:
    """A module's input must hold examples and features: PyTorch refuses input_size 0, Keras an input of no
    features, and without examples the steps T declares would be run on nothing."""
    T, B, I = x_shape  # noqa: E741
    if B == 0 or I == 0:
        what = "no examples (B = 0)" if B == 0 else "no features (input size 0)"
        raise InvalidArgumentError(f"x holds {what} over {T} time steps: nothing a {framework} LSTM computes "
                                   f"(x is [T, B, I] = {[T, B, I]} time-major)")


def cells(name: str, gates: int, units: int, framework: str) -> int:
    """The cell size C: ``units``, when the recurrent weights have 4C gate rows or columns (i, f, c, o)."""
    if gates != 4 * units or units == 0:
        raise InvalidArgumentError(f"{name} has {gates} gate units for {units} cell units, not 4 * {units}: not an "
                                   f"LSTM of {framework} (a GRU has 3 gates, a plain RNN 1)")
    return units


def states(name: str, value, count: int, B: int, C: int, dtype, what: str) -> np.ndarray:
    """An initial state or a final state's gradient: [count, B, C] (``count`` layer-directions, PyTorch's layout),
    or [B, C] where there is one; zeros when absent (None for an absent gradient: ``dtype`` None)."""
    if value is None:
        return None if dtype is None else np.zeros((count, B, C), dtype)
    value = given = np.asarray(value)
    if value.ndim == 2 and count == 1:
        value = value[None]
    if value.shape != (count, B, C):
        label = f"[{count}, B, C] ({what})" if count > 1 else "[B, C]"
        hint = f" for {count} layer-directions" if count > 1 else ""
        raise InvalidArgumentError(f"{name} has shape {list(given.shape)}, expected {label}"
                                   f"{' = ' + str([count, B, C]) if count > 1 else ' = ' + str([B, C])}{hint}")
    return value


def as_bool_mask(mask, B: int, T: int) -> np.ndarray:
    """A Keras mask [B, T]: booleans, or 0/1 numbers."""
    m = np.asarray(mask)
    if m.shape != (B, T):
        raise InvalidArgumentError(f"mask has shape {list(m.shape)}, expected [B, T] = {[B, T]} (True where a step "
                                   "is used)")
    if m.dtype == bool:
        return m
    if m.dtype.kind not in "iuf" or not np.isin(m, (0, 1)).all():
        raise InvalidArgumentError(f"mask must hold booleans (or 0 and 1), found dtype {m.dtype}"
                                   + (" with other values" if m.dtype.kind in "iuf" else ""))
    return m.astype(bool)


def as_lengths(lengths, B: int, T: int) -> np.ndarray:
    """PyTorch's per-example lengths [B]: integers in [1, T] (0 is taken too: the example runs no step)."""
    n = np.asarray(lengths)
    if n.shape != (B,):
        raise InvalidArgumentError(f"lengths has shape {list(n.shape)}, expected [B] = [{B}] (each example's "
                                   "number of steps)")
    if n.dtype.kind == "f" and np.isfinite(n).all() and (n == np.round(n)).all():
        if B and (n.min() < 0 or n.max() > T):  # (before the cast: 1e20 has no int64)
            raise InvalidArgumentError(f"lengths must be in [0, T] = [0, {T}], found {n.min():g}..{n.max():g}")
        n = n.astype(np.int64)
    if n.dtype.kind not in "iu":
        raise InvalidArgumentError(f"lengths must be integers, found dtype {n.dtype}")
    if B and (n.min() < 0 or n.max() > T):
        raise InvalidArgumentError(f"lengths must be in [0, T] = [0, {T}], found {int(n.min())}..{int(n.max())}")
    return n.astype(np.int64)

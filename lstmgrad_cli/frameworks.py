"""Keras ``LSTM`` and PyTorch ``nn.LSTM`` tensors as their users hold them, turned into BlockLSTMV2 and back.

Both layers compute exactly BlockLSTMV2 without peepholes, forget bias or clipping, in the IFCO gate order
(Keras i, f, c, o; PyTorch i, f, g, o).  What their users hold is the layer's weights, its input, maybe an
initial state and the gradient arriving at its output; a *view* maps those to the op's tensors
(``to_op``: time-major x, ``w = [input weights; recurrent weights]``, ``b``, the state, ``cs_grad`` and
``h_grad`` with the final-state gradients added at the last step) and the op's gradients back to the
framework's names and layouts (``from_op``).  The forward outputs are then recomputed (problem.py).

Keras: ``x`` [B,T,I] (``time_major``: [T,B,I]), ``kernel`` [I,4C], ``recurrent_kernel`` [C,4C], ``bias`` [4C]
(absent: use_bias=False), ``h0``/``c0`` [B,C], ``h_grad`` [B,T,C] (return_sequences) or [B,C] (the last output
only), ``hn_grad``/``cn_grad`` [B,C] at the returned final states.  A Keras 3 weights file keeps a layer's
weights at ``layers/<lstm...>/cell/vars/0, 1, 2``; older tf.keras files at ``.../lstm_cell/kernel[:0]``.
``go_backwards``: the layer runs on x reversed in time and returns its outputs in the order it made them (h_grad
in that order); ``reverse``: the backward layer of a ``Bidirectional``, whose outputs the wrapper turns back
into x's time order (h_grad, its half of the wrapper's output gradient, in x's order).

PyTorch: ``x`` [T,B,I] (``batch_first``: [B,T,I]), ``weight_ih_l{K}`` [4C,I], ``weight_hh_l{K}`` [4C,C],
``bias_ih_l{K}``/``bias_hh_l{K}`` [4C], ``_reverse`` for the backward direction (run on x reversed in time),
``h0``/``c0`` [B,C] of that layer and direction, ``h_grad`` [T,B,C] in x's time order, or [B,C]: the gradient
at the output's last time step (``out[-1]``; for the reverse direction, the first step it runs),
``hn_grad``/``cn_grad`` [B,C].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .errors import InvalidArgumentError

FRAMEWORKS = ("keras", "torch")


@dataclass(frozen=True)
class FrameworkOptions:
    framework: str | None = None  # "keras" | "torch" | "tf" (the op's own names) | None: from the names
    time_major: bool = False  # Keras: x and h_grad are [T, B, ...]
    batch_first: bool = False  # PyTorch: x and h_grad are [B, T, ...]
    layer: int = 0  # PyTorch: which layer's weights (the K of weight_ih_l{K})
    reverse: bool = False  # the backward direction of a bidirectional LSTM (h_grad in x's time order)
    go_backwards: bool = False  # Keras: a layer made with go_backwards=True (h_grad in the order it ran)


# Options that say how one framework's tensors are laid out, and whose they are.  Given for another's, they would
# be ignored and the gradient silently wrong, so they are refused (``check_applicable``).
_OPTIONS = {"time_major": ("--time-major", ("keras",)), "go_backwards": ("--go-backwards", ("keras",)),
            "batch_first": ("--batch-first", ("torch",)), "layer": ("--layer", ("torch",)),
            "reverse": ("--reverse", ("keras", "torch"))}
_WHOSE = {"keras": "a Keras LSTM layer's", "torch": "a PyTorch nn.LSTM's", "tf": "the TF op's own"}


def check_applicable(framework: str, options: FrameworkOptions) -> None:
    """Refuse options given for another framework's tensors than ``framework``'s ("keras", "torch", "tf")."""
    wrong = [(flag, owners) for name, (flag, owners) in _OPTIONS.items()
             if getattr(options, name) != getattr(FrameworkOptions, name) and framework not in owners]
    if wrong:
        said = "; ".join(f"{flag} is for {' and '.join(_WHOSE[o] for o in owners)} tensors" for flag, owners in wrong)
        raise InvalidArgumentError(f"{said}, and this input holds {_WHOSE[framework]} (--framework says whose they "
                                   "are where the names do not tell)")
    if options.reverse and options.go_backwards:
        raise InvalidArgumentError("--reverse and --go-backwards do not go together: --go-backwards is a layer made "
                                   "with go_backwards=True (h_grad in the order it ran), --reverse a Bidirectional's "
                                   "backward layer (h_grad in x's time order)")


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


# -- naming -------------------------------------------------------------------------------------------------

KERAS_NAMES = {  # Keras name -> where files keep it (plain, Keras 3 weights file, older tf.keras HDF5)
    "kernel": ("kernel", "cell/vars/0", "lstm_cell/kernel", "lstm_cell/kernel:0"),
    "recurrent_kernel": ("recurrent_kernel", "cell/vars/1", "lstm_cell/recurrent_kernel",
                         "lstm_cell/recurrent_kernel:0"),
    "bias": ("bias", "cell/vars/2", "lstm_cell/bias", "lstm_cell/bias:0"),
}
STATE_NAMES = ("x", "h0", "c0", "h_grad", "hn_grad", "cn_grad")
_TORCH_WEIGHT = re.compile(r"^weight_ih_l(\d+)(_reverse)?$")


def torch_suffix(options: FrameworkOptions) -> str:
    return f"_l{options.layer}" + ("_reverse" if options.reverse else "")


def torch_names(options: FrameworkOptions) -> dict[str, str]:
    """weight_ih, weight_hh, bias_ih, bias_hh -> their state_dict names for the layer and direction."""
    sfx = torch_suffix(options)
    return {n: f"{n}{sfx}" for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}


def file_names(options: FrameworkOptions) -> list[str]:
    """Every name a Keras or PyTorch input may hold, for reading before the framework is known."""
    keras = [alias for aliases in KERAS_NAMES.values() for alias in aliases]
    sfx = torch_suffix(options)
    return [*STATE_NAMES, *keras, *torch_names(options).values(), f"weight_hr{sfx}"]


def detect(keys, options: FrameworkOptions) -> str:
    """"keras", "torch" or "tf" (the op's own tensors), from ``options.framework`` or the names present."""
    if options.framework:
        return options.framework
    keys = set(keys)
    if {"w", "i", "cs", "cs_prev", "h_prev"} & keys:
        return "tf"
    if "recurrent_kernel" in keys or "cell" in keys or "lstm_cell" in keys or {"kernel", "x"} <= keys:
        return "keras"
    if any(_TORCH_WEIGHT.match(k) for k in keys):
        return "torch"
    return "tf"


def torch_layers(keys) -> list[str]:
    """The layer and direction suffixes of the nn.LSTM weights among ``keys`` ("_l0", "_l1_reverse", ...)."""
    return sorted({f"_l{m.group(1)}{m.group(2) or ''}" for k in keys for m in [_TORCH_WEIGHT.match(k)] if m})


# -- the views ------------------------------------------------------------------------------------------------

class View:
    """How one framework's tensors map to BlockLSTMV2's and its gradients back."""

    framework = ""

    def __init__(self, options: FrameworkOptions):
        self.options = options
        self.with_bias = True
        self.I = 0  # noqa: E741

    def to_op(self, tensors: dict) -> dict:
        raise NotImplementedError

    def from_op(self, grads) -> dict:
        raise NotImplementedError

    def _state(self, tensors: dict, x: np.ndarray, C: int, op: dict) -> None:
        """h_prev/cs_prev from h0/c0 (zeros when absent), cs_grad/h_grad with the final-state gradients.
        ``x`` is the op's: time-major, in the order the layer runs it."""
        T, B = x.shape[:2]
        dtype = x.dtype
        for name, target in (("h0", "h_prev"), ("c0", "cs_prev")):
            value = tensors.get(name)
            op[target] = np.zeros((B, C), dtype) if value is None else _shaped(name, value, (B, C), "[B, C]")
        h_grad = np.zeros((T, B, C), dtype)
        given = tensors.get("h_grad")
        if given is None:
            if tensors.get("hn_grad") is None and tensors.get("cn_grad") is None:
                raise InvalidArgumentError("missing tensor h_grad: the gradient arriving at the layer's output (or "
                                           "hn_grad, cn_grad: those at its final states, where the output is unused)")
        elif np.ndim(given) == 2:  # the last output only (return_sequences=False, out[-1])
            h_grad[self._last_output_step(T)] = _shaped("h_grad", given, (B, C), "[B, C] or a sequence")
        else:
            batch_major = self._batch_major()
            shape, label = ((B, T, C), "[B, T, C]") if batch_major else ((T, B, C), "[T, B, C]")
            given = _shaped("h_grad", given, shape, label)
            h_grad[:] = self._run_order(np.swapaxes(given, 0, 1) if batch_major else given, self._h_grad_reversed())
        cs_grad = np.zeros((T, B, C), dtype)
        if tensors.get("hn_grad") is not None:
            h_grad[T - 1] += _shaped("hn_grad", tensors["hn_grad"], (B, C), "[B, C]")
        if tensors.get("cn_grad") is not None:
            cs_grad[T - 1] += _shaped("cn_grad", tensors["cn_grad"], (B, C), "[B, C]")
        op["h_grad"], op["cs_grad"] = h_grad, cs_grad
        for name in ("wci", "wcf", "wco"):
            op[name] = np.zeros(C, dtype)

    # How the framework lays out a sequence, and in which order the layer runs it.
    def _batch_major(self) -> bool:
        """Whether x and h_grad sequences are [B, T, ...] (else [T, B, ...])."""
        return False

    def _x_reversed(self) -> bool:
        """Whether the layer runs x backwards in time."""
        return False

    def _h_grad_reversed(self) -> bool:
        """Whether an h_grad sequence is in x's time order where the layer runs x backwards."""
        return self._x_reversed()

    def _last_output_step(self, T: int) -> int:
        """The step the op runs at which a [B, C] h_grad (the last output) arrives."""
        return T - 1

    @staticmethod
    def _run_order(a: np.ndarray, reversed_: bool) -> np.ndarray:
        return a[::-1] if reversed_ else a

    def _x_label(self) -> str:
        return "[B, T, I]" if self._batch_major() else "[T, B, I]"

    def _op_x(self, x) -> np.ndarray:
        """The user's x as the op runs it: [T, B, I], first step run first."""
        x = _rank("x", x, 3, self._x_label())
        return self._run_order(np.swapaxes(x, 0, 1) if self._batch_major() else x, self._x_reversed())

    def _framework_x_grad(self, x_grad: np.ndarray) -> np.ndarray:
        """The inverse of ``_op_x``, for the gradient."""
        x_grad = self._run_order(x_grad, self._x_reversed())
        return np.ascontiguousarray(np.swapaxes(x_grad, 0, 1) if self._batch_major() else x_grad)


class KerasView(View):
    framework = "keras"

    def _batch_major(self):
        return not self.options.time_major

    def _x_reversed(self):
        return self.options.go_backwards or self.options.reverse

    def _h_grad_reversed(self):
        # go_backwards: the layer returns its outputs in the order it made them; a Bidirectional (reverse) turns
        # its backward layer's outputs back into x's order.
        return self.options.reverse

    def to_op(self, tensors):
        check_applicable("keras", self.options)
        tensors = _dtyped(tensors)
        missing = [n for n in ("x", "kernel", "recurrent_kernel") if tensors.get(n) is None]
        if missing:
            raise InvalidArgumentError(f"missing tensor{'s' * (len(missing) > 1)} {', '.join(missing)} (a Keras "
                                       "LSTM needs x, kernel, recurrent_kernel, h_grad; bias, h0, c0, hn_grad, "
                                       "cn_grad are optional)")
        x = self._op_x(tensors["x"])
        kernel = _rank("kernel", tensors["kernel"], 2, "[I, 4C]")
        recurrent = _rank("recurrent_kernel", tensors["recurrent_kernel"], 2, "[C, 4C]")
        C = _cells("recurrent_kernel", recurrent.shape[1], recurrent.shape[0], "Keras")
        self.I = x.shape[2]
        _shaped("kernel", kernel, (self.I, 4 * C), "[I, 4C]")
        _shaped("recurrent_kernel", recurrent, (C, 4 * C), "[C, 4C]")
        bias = tensors.get("bias")
        self.with_bias = bias is not None
        op = {"x": np.ascontiguousarray(x), "w": np.concatenate([kernel, recurrent]),
              "b": np.zeros(4 * C, x.dtype) if bias is None else _shaped("bias", bias, (4 * C,), "[4C]")}
        self._state(tensors, x, C, op)
        return op

    def from_op(self, grads) -> dict:
        out = {"x_grad": self._framework_x_grad(grads.x_grad),
               "kernel_grad": grads.w_grad[:self.I],
               "recurrent_kernel_grad": grads.w_grad[self.I:]}
        if self.with_bias:
            out["bias_grad"] = grads.b_grad
        out["h0_grad"], out["c0_grad"] = grads.h_prev_grad, grads.cs_prev_grad
        return out


class TorchView(View):
    framework = "torch"

    def _batch_major(self):
        return self.options.batch_first

    def _x_reversed(self):
        return self.options.reverse  # the reverse direction runs backwards in time

    def _last_output_step(self, T):
        # out[-1]: for the reverse direction, the step it runs first (the gradient at h_n is hn_grad)
        return 0 if self.options.reverse else T - 1

    def to_op(self, tensors):
        check_applicable("torch", self.options)
        names = torch_names(self.options)
        projection = f"weight_hr{torch_suffix(self.options)}"
        if tensors.get(projection) is not None:
            raise InvalidArgumentError(f"{projection} is there: an nn.LSTM with proj_size > 0 projects h, which "
                                       "is not the maths of these ops; lstmgrad does not compute it")
        tensors = _dtyped(tensors)
        missing = [n for n in ("x", names["weight_ih"], names["weight_hh"]) if tensors.get(n) is None]
        if missing:
            raise InvalidArgumentError(
                f"missing tensor{'s' * (len(missing) > 1)} {', '.join(missing)} (layer {self.options.layer}"
                f"{', reverse' if self.options.reverse else ''} of an nn.LSTM; --layer and --reverse choose "
                "another)")
        x = self._op_x(tensors["x"])
        w_ih = _rank(names["weight_ih"], tensors[names["weight_ih"]], 2, "[4C, I]")
        w_hh = _rank(names["weight_hh"], tensors[names["weight_hh"]], 2, "[4C, C]")
        C = _cells(names["weight_hh"], w_hh.shape[0], w_hh.shape[1], "PyTorch")
        self.I = x.shape[2]
        _shaped(names["weight_ih"], w_ih, (4 * C, self.I), "[4C, I]")
        _shaped(names["weight_hh"], w_hh, (4 * C, C), "[4C, C]")
        b_ih, b_hh = tensors.get(names["bias_ih"]), tensors.get(names["bias_hh"])
        if (b_ih is None) != (b_hh is None):
            raise InvalidArgumentError(f"{names['bias_ih']} and {names['bias_hh']} come together (bias=True) or "
                                       "not at all (bias=False)")
        self.with_bias = b_ih is not None
        b = np.zeros(4 * C, x.dtype)
        if self.with_bias:
            b = (_shaped(names["bias_ih"], b_ih, (4 * C,), "[4C]") + _shaped(names["bias_hh"], b_hh, (4 * C,), "[4C]"))
        op = {"x": np.ascontiguousarray(x), "w": np.concatenate([w_ih.T, w_hh.T]), "b": b.astype(x.dtype)}
        self._state(tensors, x, C, op)
        return op

    def from_op(self, grads) -> dict:
        names = torch_names(self.options)
        out = {"x_grad": self._framework_x_grad(grads.x_grad),
               f"{names['weight_ih']}_grad": np.ascontiguousarray(grads.w_grad[:self.I].T),
               f"{names['weight_hh']}_grad": np.ascontiguousarray(grads.w_grad[self.I:].T)}
        if self.with_bias:
            out[f"{names['bias_ih']}_grad"] = grads.b_grad
            out[f"{names['bias_hh']}_grad"] = grads.b_grad.copy()
        out["h0_grad"], out["c0_grad"] = grads.h_prev_grad, grads.cs_prev_grad
        return out


VIEWS = {"keras": KerasView, "torch": TorchView}


def view(framework: str, options: FrameworkOptions) -> View:
    return VIEWS[framework](options)


def keras_tensors(loaded_tensors: dict) -> dict:
    """The Keras names of what a file holds under its own spelling (a weights file's cell/vars/0, ...)."""
    out = {n: loaded_tensors[n] for n in STATE_NAMES if n in loaded_tensors}
    for name, aliases in KERAS_NAMES.items():
        out[name] = next((loaded_tensors[a] for a in aliases if a in loaded_tensors), None)
    return {n: v for n, v in out.items() if v is not None}


# -- checks -----------------------------------------------------------------------------------------------

def _dtyped(tensors: dict) -> dict:
    """Float arrays of one dtype (as the op needs), said in the framework's names."""
    arrays = {n: np.asarray(v) for n, v in tensors.items() if v is not None}
    for name, a in arrays.items():
        if a.dtype.kind != "f" or a.dtype.itemsize not in (2, 4, 8):
            raise InvalidArgumentError(f"{name} has dtype {a.dtype}; expected float16, float32 or float64")
    dtypes = {a.dtype for a in arrays.values()}
    if len(dtypes) > 1:
        first, *_ = arrays
        other = next(n for n, a in arrays.items() if a.dtype != arrays[first].dtype)
        raise InvalidArgumentError(f"all tensors must have one dtype: {first} is {arrays[first].dtype} but {other} "
                                   f"is {arrays[other].dtype}")
    return arrays


def _rank(name: str, a, rank: int, label: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != rank:
        raise InvalidArgumentError(f"{name} must be rank {rank} {label} but has shape {list(a.shape)}")
    return a


def _shaped(name: str, a, shape: tuple, label: str) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != tuple(shape):
        raise InvalidArgumentError(f"{name} has shape {list(a.shape)}, expected {label} = {list(shape)}")
    return a


def _cells(name: str, gates: int, units: int, framework: str) -> int:
    """The cell size C: ``units``, when the recurrent weights have 4C gate rows or columns (i, f, c, o)."""
    if gates != 4 * units or units == 0:
        raise InvalidArgumentError(f"{name} has {gates} gate units for {units} cell units, not 4 * {units}: not an "
                                   f"LSTM of {framework} (a GRU has 3 gates, a plain RNN 1)")
    return units


# -- the Python API ---------------------------------------------------------------------------------------

def keras_lstm_grad(x, kernel, recurrent_kernel, bias=None, *, h_grad=None, h0=None, c0=None, hn_grad=None,
                    cn_grad=None, time_major=False, go_backwards=False, reverse=False, backend=None,
                    compute_dtype=None) -> KerasLSTMGradOutputs:
    """The gradients of a Keras ``LSTM`` layer (tanh, sigmoid: Keras' defaults), as GradientTape gives them.

    ``h_grad`` is the gradient at the layer's output: [B, T, C] with return_sequences, else [B, C];
    ``hn_grad``/``cn_grad`` those at the final states (return_state; without ``h_grad`` where the output itself is
    unused).  Absent h0/c0 are zeros.  ``go_backwards``: the layer was made with go_backwards=True (``h_grad`` in
    the order it returns its outputs, last step of x first); ``reverse``: it is the backward layer of a
    ``Bidirectional`` (``h_grad``, its half of the wrapper's output gradient, in x's time order).
    """
    options = FrameworkOptions("keras", time_major=time_major, go_backwards=go_backwards, reverse=reverse)
    tensors = dict(x=x, kernel=kernel, recurrent_kernel=recurrent_kernel, bias=bias, h0=h0, c0=c0, h_grad=h_grad,
                   hn_grad=hn_grad, cn_grad=cn_grad)
    out = _gradients(KerasView(options), tensors, backend, compute_dtype)
    return KerasLSTMGradOutputs(out["x_grad"], out["kernel_grad"], out["recurrent_kernel_grad"], out.get("bias_grad"),
                                out["h0_grad"], out["c0_grad"])


def torch_lstm_grad(x, weight_ih, weight_hh, bias_ih=None, bias_hh=None, *, h_grad=None, h0=None, c0=None,
                    hn_grad=None, cn_grad=None, batch_first=False, reverse=False, backend=None,
                    compute_dtype=None) -> TorchLSTMGradOutputs:
    """The gradients of one layer and direction of a PyTorch ``nn.LSTM``, as autograd gives them.

    ``h_grad`` is the gradient at that layer-direction's output sequence, or [B, C] at its last time step
    (``out[-1]``); ``reverse`` runs it backwards in time (the second direction of a bidirectional LSTM), with
    ``h_grad`` in x's time order as nn.LSTM returns it.  ``hn_grad``/``cn_grad``: at h_n, c_n (without
    ``h_grad`` where ``out`` is unused).  Absent h0/c0 are zeros.
    """
    options = FrameworkOptions("torch", batch_first=batch_first, reverse=reverse)
    names = torch_names(options)
    tensors = {"x": x, names["weight_ih"]: weight_ih, names["weight_hh"]: weight_hh, names["bias_ih"]: bias_ih,
               names["bias_hh"]: bias_hh, "h0": h0, "c0": c0, "h_grad": h_grad, "hn_grad": hn_grad,
               "cn_grad": cn_grad}
    out = _gradients(TorchView(options), tensors, backend, compute_dtype)
    return TorchLSTMGradOutputs(out["x_grad"], out[f"{names['weight_ih']}_grad"], out[f"{names['weight_hh']}_grad"],
                                out.get(f"{names['bias_ih']}_grad"), out.get(f"{names['bias_hh']}_grad"),
                                out["h0_grad"], out["c0_grad"])


def _gradients(layer: View, tensors: dict, backend, compute_dtype) -> dict:
    from . import ops  # noqa: PLC0415 - ops -> backends; frameworks is imported by problem.py, which ops needs not

    op = layer.to_op({n: v for n, v in tensors.items() if v is not None})
    T = op["x"].shape[0]
    inputs = {n: op[n] for n in ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")}
    activations = ops.block_lstm_v2(T, **inputs, compute_dtype=compute_dtype)
    grads = ops.block_lstm_grad_v2(T, **inputs, **activations._asdict(), cs_grad=op["cs_grad"], h_grad=op["h_grad"],
                                   use_peephole=False, backend=backend, compute_dtype=compute_dtype)
    return layer.from_op(grads)


# -- weights files --------------------------------------------------------------------------------------

KERAS_WALK_GROUPS = 10_000  # groups a weights file is searched through for LSTM layers, at most


def keras_layers(path) -> list[dict]:
    """The LSTM layers of a Keras weights file: for each, its group (what ``--weights-group`` takes), the layer's
    own name and the shapes of kernel, recurrent_kernel and bias.  A Keras 3 file (``model.save_weights``) keeps a
    layer's weights at ``<group>/cell/vars/0, 1, 2``, under ``layers/`` and inside nested models and wrappers
    (``layers/bidirectional/backward_layer``); an older tf.keras or legacy ``.h5`` file at
    ``<group>/lstm_cell/kernel[:0]``.  Only datasets' shapes are read; only hard links are followed, and at most
    ``KERAS_WALK_GROUPS`` groups are looked at."""
    from .io import hdf5  # noqa: PLC0415 - h5py is imported when an HDF5 file is actually read

    layers = []
    with hdf5.open_hdf5(path) as (fh, h5py), hdf5.hdf5_errors(path):
        pending, seen = [("", fh)], 0
        while pending and seen < KERAS_WALK_GROUPS:
            name, group = pending.pop()
            seen += 1
            layer = _keras_lstm(name, group, h5py)
            if layer is not None:
                layers.append(layer)
                continue
            children = [(f"{name}/{k}" if name else k, _hard_child(group, k, h5py)) for k in group.keys()]
            pending.extend(reversed([(n, g) for n, g in children if isinstance(g, h5py.Group)]))
    return layers


def _keras_lstm(name: str, group, h5py) -> dict | None:
    """The LSTM layer whose weights ``group`` holds (Keras 3 or older tf.keras layout), else None."""
    cell = _hard_path(group, ("cell", "vars"), h5py)
    if cell is not None:
        shapes = [_dataset_shape(cell, str(k), h5py) for k in range(3)]
    else:
        cell = _hard_path(group, ("lstm_cell",), h5py)
        if cell is None:
            return None
        shapes = [next((s for s in (_dataset_shape(cell, n, h5py), _dataset_shape(cell, f"{n}:0", h5py)) if s), None)
                  for n in ("kernel", "recurrent_kernel", "bias")]
    if None in shapes[:2] or len(shapes[0]) != 2 or len(shapes[1]) != 2:
        return None
    (I, G), (C, G2) = shapes[0], shapes[1]  # noqa: E741
    if G != G2 or G != 4 * C:
        return None  # a GRU or another cell: not an LSTM's weights
    own = _hard_path(group, ("vars",), h5py)
    label = own.attrs.get("name") if own is not None else None
    label = label.decode("utf-8", "replace") if isinstance(label, bytes) else str(label or name.rsplit("/", 1)[-1])
    return {"group": name, "name": label, "kernel": [I, G], "recurrent_kernel": [C, G],
            "bias": list(shapes[2]) if shapes[2] is not None else None, "input_size": I, "units": C}


def _hard_child(group, name: str, h5py):
    if not isinstance(group, h5py.Group) or name not in group:
        return None
    return group[name] if isinstance(group.get(name, getlink=True), h5py.HardLink) else None


def _hard_path(group, parts, h5py):
    for part in parts:
        group = _hard_child(group, part, h5py)
    return group if isinstance(group, h5py.Group) else None


def _dataset_shape(group, name: str, h5py):
    obj = _hard_child(group, name, h5py)
    return tuple(obj.shape) if isinstance(obj, h5py.Dataset) and obj.shape is not None else None


def torch_state_dict_layers(keys) -> list[dict]:
    """The nn.LSTM layers and directions among a state_dict's keys, with their module prefix."""
    found = []
    for key in keys:
        prefix, _, name = key.rpartition(".")
        match = _TORCH_WEIGHT.match(name)
        if match:
            found.append({"prefix": prefix, "layer": int(match.group(1)), "reverse": bool(match.group(2)),
                          "projection": f"{prefix + '.' if prefix else ''}weight_hr_l{match.group(1)}"
                                        f"{match.group(2) or ''}" in keys})
    return sorted(found, key=lambda d: (d["prefix"], d["layer"], d["reverse"]))

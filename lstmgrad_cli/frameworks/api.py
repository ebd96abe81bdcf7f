"""The frameworks' gradients for Python callers (``keras_lstm_grad``, ``torch_lstm_grad``, the cells'), and
``plan``, which checks a Keras or PyTorch user's tensors and builds what computes them.  Loaded with the package's
other modules on first use (``frameworks/__init__.py``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..backends import get_backend, gpu_array, host_backend_refused, on_gpu, status, takes_gpu_arrays
from ..errors import InvalidArgumentError, LstmGradError
from ..messages import TYPED, Command, Message, Param, cut, message_of
from . import (
    KerasCellGradOutputs,
    KerasLSTMGradOutputs,
    TorchCellGradOutputs,
    TorchLSTMGradOutputs,
    cells,
    keras,
    pytorch,
)
from .common import Plan
from .keras import KerasLayer
from .names import FrameworkOptions


def plan(framework: str, tensors: dict, options: FrameworkOptions, layer: KerasLayer | None = None) -> Plan:
    """Check a Keras or PyTorch user's tensors (as a file holds them) and build what computes their gradients.
    A refusal that the other time layout of x would not give (batch_first for PyTorch, time_major for Keras) says
    so.  One cell step's tensors: ``cells.plan``."""
    try:
        return _plan(framework, tensors, options, layer)
    except InvalidArgumentError as err:
        flipped, hint = _other_layout(framework, tensors, options)
        if flipped is None:
            raise
        try:
            _plan(framework, tensors, flipped, layer)
        except LstmGradError:
            raise err from None
        raise InvalidArgumentError(Message.format("{}; {}", message_of(err), hint)) from None


def _plan(framework: str, tensors: dict, options: FrameworkOptions, layer: KerasLayer | None) -> Plan:
    if framework == "keras":
        held = keras.tensors_of(tensors)
        if np.ndim(held.get("x")) == 2 and "forward_kernel" not in held:
            raise InvalidArgumentError(Message.format(
                "x has shape {}, one step [B, I]: a Keras LSTM layer takes a sequence [B, T, I]; {} computes one step "
                "of an LSTMCell (x, h0, c0 and the gradients at h1, c1 of out, [h1, c1] = cell(x, [h0, c0]) as "
                "h1_grad, c1_grad)", list(np.shape(held['x'])), Command("cell")))
        return keras.plan(held, options, layer)
    return pytorch.plan(tensors, options)


def _other_layout(framework: str, tensors: dict, options: FrameworkOptions) -> tuple:
    """The options with x's other time layout, and words for what it would change; (None, "") where it would change
    nothing (x not a sequence, as long as it is wide)."""
    shape = np.shape(tensors.get("x")) if tensors.get("x") is not None else ()
    if len(shape) != 3 or shape[0] == shape[1]:
        return None, ""
    if framework == "torch":
        flag = Param("batch_first", True)
        hint = (Message.format("without {} (x time-major, [T, B, I]: [{}, {}, ...]) the shapes fit", flag, *shape[:2])
                if options.batch_first else
                Message.format("with {} (x batch-first, [B, T, I]: [{}, {}, ...], as nn.LSTM(batch_first=True) takes "
                               "it) the shapes fit", flag, *shape[:2]))
        return replace(options, batch_first=not options.batch_first), hint
    flag = Param("time_major", True)
    hint = (Message.format("without {} (x batch-first, [B, T, I]: [{}, {}, ...]) the shapes fit", flag, *shape[:2])
            if options.time_major else
            Message.format("with {} (x time-major, [T, B, I]: [{}, {}, ...]) the shapes fit", flag, *shape[:2]))
    return replace(options, time_major=not options.time_major), hint


# -- the Python API ---------------------------------------------------------------------------------------

def keras_lstm_grad(x, kernel=None, recurrent_kernel=None, bias=None, *, weights=None, merge_mode="concat",
                    h_grad=None, h0=None, c0=None, hn_grad=None, cn_grad=None, mask=None, activation="tanh",
                    recurrent_activation="sigmoid", zero_output_for_mask=None, unroll=False, time_major=False,
                    go_backwards=False, reverse=False, backend=None, compute_dtype=None):
    """The gradients of a Keras ``LSTM`` layer, as GradientTape gives them.

    ``h_grad`` is the gradient at the layer's output: [B, T, C] with return_sequences, else [B, C];
    ``hn_grad``/``cn_grad`` those at the final states (return_state; without ``h_grad`` where the output itself is
    unused).  Absent h0/c0 are zeros.  ``mask`` [B, T]: the steps the layer runs (the others carry its state and
    output over, or output zeros with ``zero_output_for_mask``).  ``activation``/``recurrent_activation``: as the
    layer was made (tanh, sigmoid, hard_sigmoid, relu, linear).  ``go_backwards``: the layer was made with
    go_backwards=True (``h_grad`` in the order it returns its outputs, last step of x first); ``reverse``: it is the
    backward layer of a ``Bidirectional`` (``h_grad``, its half of the wrapper's output gradient, in x's time order).
    ``zero_output_for_mask`` None: Keras' default (False; a Bidirectional returning sequences sets it, for its backward
    layer ``reverse`` says so).  ``unroll``: the layer was made with unroll=True (masked and run backwards with zeroed
    outputs, Keras' unrolled loop masks by the mask not reversed: refused).

    With ``weights``, a dict of a whole ``Bidirectional``'s (``forward_kernel``, ``forward_recurrent_kernel``,
    ``forward_bias``, ``backward_...``): both layers, merged by ``merge_mode``; ``h_grad`` is the gradient at the
    merged output, h0, c0, hn_grad, cn_grad are [2, B, C] (forward, backward); returns a dict of every gradient
    (``forward_kernel_grad``, ..., ``x_grad``, ``h0_grad``, ``c0_grad``).
    """
    options = FrameworkOptions("keras", time_major=time_major, go_backwards=go_backwards, reverse=reverse)
    layer = KerasLayer(keras_activation(activation), keras_activation(recurrent_activation),
                       zero_output_for_mask=zero_output_for_mask, unroll=unroll,
                       merge_mode=merge_mode if weights else None, source="the arguments", reverse=reverse)
    given = dict(kernel=kernel, recurrent_kernel=recurrent_kernel, bias=bias)
    if weights is not None:
        if any(v is not None for v in given.values()):
            raise TypeError("keras_lstm_grad takes a Bidirectional's weights dict or kernel/recurrent_kernel/bias, "
                            "not both")
        given = dict(weights)
    held = _Held(dict(x=x, **given, h0=h0, c0=c0, h_grad=h_grad, hn_grad=hn_grad, cn_grad=cn_grad, mask=mask),
                 backend)
    out = held.gradients(plan("keras", held.tensors, options, layer), compute_dtype)
    if weights is not None:
        return out
    return KerasLSTMGradOutputs(out["x_grad"], out["kernel_grad"], out["recurrent_kernel_grad"], out.get("bias_grad"),
                                out["h0_grad"], out["c0_grad"])


def keras_activation(name) -> str:
    from ..layers import activations  # noqa: PLC0415 - (a name check, kept beside its one use)

    return activations.resolve(name)


def torch_lstm_grad(x, weight_ih=None, weight_hh=None, bias_ih=None, bias_hh=None, *, state_dict=None, lengths=None,
                    h_grad=None, h0=None, c0=None, hn_grad=None, cn_grad=None, batch_first=False, layer=None,
                    reverse=False, backend=None, compute_dtype=None):
    """The gradients of a PyTorch ``nn.LSTM``, as autograd gives them.

    With ``state_dict`` (the module's, keys ``weight_ih_l0``, ..., ``_reverse``; a model's with its prefix removed):
    the whole module, every layer and direction, read from the names; ``h_grad`` is the gradient at ``out``
    ([T, B, D*C], or [B, D*C] at ``out[-1]``), ``h0``, ``c0``, ``hn_grad``, ``cn_grad`` [L*D, B, C]; returns a dict of
    the state_dict's names plus ``_grad``, with ``x_grad``, ``h0_grad``, ``c0_grad``.  ``layer``/``reverse`` pick one
    layer and direction of it instead.

    With ``weight_ih``, ``weight_hh`` (and ``bias_ih``, ``bias_hh``): one layer and direction (``reverse``: the
    backward one, run from x's last step), returned as ``TorchLSTMGradOutputs``; h0, c0 and the final-state
    gradients [B, C].  ``lengths`` [B]: a packed batch's per-example lengths (pack_padded_sequence).
    """
    state = dict(x=x, h0=h0, c0=c0, h_grad=h_grad, hn_grad=hn_grad, cn_grad=cn_grad, lengths=lengths)
    if state_dict is not None:
        if weight_ih is not None or weight_hh is not None:
            raise TypeError("torch_lstm_grad takes a state_dict or weight_ih/weight_hh, not both")
        options = FrameworkOptions("torch", batch_first=batch_first, layer=layer, reverse=reverse)
        _refuse_model_state_dict(state_dict)
        held = _Held({**state_dict, **state}, backend)
        return held.gradients(plan("torch", held.tensors, options), compute_dtype)
    options = FrameworkOptions("torch", batch_first=batch_first, layer=0, reverse=reverse)
    names = pytorch.names(0, reverse)
    held = _Held({names["weight_ih"]: weight_ih, names["weight_hh"]: weight_hh, names["bias_ih"]: bias_ih,
                  names["bias_hh"]: bias_hh, **state}, backend)
    out = held.gradients(plan("torch", held.tensors, options), compute_dtype)
    return TorchLSTMGradOutputs(out["x_grad"], out[f"{names['weight_ih']}_grad"], out[f"{names['weight_hh']}_grad"],
                                out.get(f"{names['bias_ih']}_grad"), out.get(f"{names['bias_hh']}_grad"),
                                out["h0_grad"], out["c0_grad"])


def torch_cell_grad(x, weight_ih=None, weight_hh=None, bias_ih=None, bias_hh=None, *, state_dict=None, h0=None,
                    c0=None, h1_grad=None, c1_grad=None, backend=None, compute_dtype=None) -> TorchCellGradOutputs:
    """The gradients of one PyTorch ``nn.LSTMCell`` step, ``h1, c1 = cell(x, (h0, c0))``, as autograd gives them.

    The cell's ``weight_ih`` [4C, I], ``weight_hh`` [4C, C] (and ``bias_ih``, ``bias_hh`` [4C]), or its
    ``state_dict`` (``cell.state_dict()``); ``x`` [B, I] or unbatched [I]; ``h0``, ``c0`` [B, C] (or [C]; zeros when
    absent); ``h1_grad``, ``c1_grad``: the gradients arriving at h1 and c1 (one may be absent: that output unused).
    """
    if state_dict is not None:
        if weight_ih is not None or weight_hh is not None:
            raise TypeError("torch_cell_grad takes a state_dict or weight_ih/weight_hh, not both")
        _refuse_model_state_dict(state_dict, cell=True)
        weights = dict(state_dict)
    else:
        weights = dict(weight_ih=weight_ih, weight_hh=weight_hh, bias_ih=bias_ih, bias_hh=bias_hh)
    held = _Held({**weights, "x": x, "h0": h0, "c0": c0, "h1_grad": h1_grad, "c1_grad": c1_grad}, backend)
    out = held.gradients(cells.plan("torch", held.tensors), compute_dtype)
    return TorchCellGradOutputs(out["x_grad"], out["weight_ih_grad"], out["weight_hh_grad"], out.get("bias_ih_grad"),
                                out.get("bias_hh_grad"), out["h0_grad"], out["c0_grad"])


def keras_cell_grad(x, kernel, recurrent_kernel, bias=None, *, h0=None, c0=None, h1_grad=None, c1_grad=None,
                    activation="tanh", recurrent_activation="sigmoid", backend=None,
                    compute_dtype=None) -> KerasCellGradOutputs:
    """The gradients of one Keras ``LSTMCell`` step, ``out, [h1, c1] = cell(x, [h0, c0])``, as GradientTape gives
    them: ``x`` [B, I], ``kernel`` [I, 4C], ``recurrent_kernel`` [C, 4C], ``bias`` [4C]; ``h0``, ``c0`` [B, C]
    (zeros when absent); ``h1_grad``, ``c1_grad`` the gradients arriving at h1 (out) and c1 (one may be absent).
    ``activation``/``recurrent_activation``: as the cell was made (tanh, sigmoid, hard_sigmoid, relu, linear)."""
    layer = KerasLayer(keras_activation(activation), keras_activation(recurrent_activation), source="the arguments")
    held = _Held(dict(x=x, kernel=kernel, recurrent_kernel=recurrent_kernel, bias=bias, h0=h0, c0=c0,
                      h1_grad=h1_grad, c1_grad=c1_grad), backend)
    out = held.gradients(cells.plan("keras", held.tensors, layer=layer), compute_dtype)
    return KerasCellGradOutputs(out["x_grad"], out["kernel_grad"], out["recurrent_kernel_grad"], out.get("bias_grad"),
                                out["h0_grad"], out["c0_grad"])


def _refuse_model_state_dict(state_dict, cell: bool = False) -> None:
    """A whole model's state_dict (its nn.LSTM's keys behind a prefix, or an nn.LSTMCell's) says where the module is;
    ``cell``: for an nn.LSTMCell's step (its keys weight_ih, ... without a prefix)."""
    keys = list(state_dict)
    own = set(pytorch.CELL_KEYS) <= set(keys) if cell else pytorch.layers_in(keys)
    if own:
        return
    if cell:
        prefixes = [k.removesuffix(".weight_ih") for k in keys if k.endswith(".weight_ih")]
        where = (f"; it keeps nn.LSTMCell weights at {', '.join(prefixes)}: give that cell's state_dict "
                 f"(model.{prefixes[0]}.state_dict()), or its keys without the prefix" if prefixes else "")
        raise InvalidArgumentError(f"state_dict holds no nn.LSTMCell weights of its own (weight_ih, weight_hh){where}")
    prefixes = list(dict.fromkeys(d["prefix"] for d in pytorch.state_dict_layers(keys)))
    if prefixes:
        raise InvalidArgumentError(
            f"state_dict holds no nn.LSTM weights of its own (weight_ih_l0, ...); it keeps nn.LSTM modules at "
            f"{', '.join(cut(p, TYPED) for p in prefixes[:6])}: give that module's state_dict "
            f"(model.{cut(prefixes[0], TYPED)}.state_dict()), or its keys without the prefix")
    cells = pytorch.cells_in(keys)
    if cells:
        raise InvalidArgumentError("; ".join(cells))


class _Held:
    """The API's tensors as a plan checks them (numpy arrays), the backend computing them, and whether the caller
    holds them on that backend's GPU.  Tensors on a GPU (cupy's arrays, torch CUDA tensors, anything with
    ``__cuda_array_interface__`` or DLPack) are computed by cupy unless a backend is named (or cupy is not usable
    here): copied to the host once to be checked, computed on the device, and their gradients left there as cupy
    arrays.  A host backend takes torch tensors, wherever they are, as copies on the host (its gradients numpy
    arrays); other GPU arrays it refuses."""

    def __init__(self, tensors: dict, backend):
        given = {name: value for name, value in tensors.items() if value is not None}
        on_a_gpu = [name for name, value in given.items() if on_gpu(value)]
        if backend is None and on_a_gpu and status("cupy").available:
            backend = "cupy"
        self.backend = get_backend(backend)
        gpu_backend = takes_gpu_arrays(self.backend)
        module = getattr(self.backend, "array_module", None) if gpu_backend else None

        def there(value):  # (the backend's own device arrays too: a plugin's, the test suite's stand-in)
            return gpu_backend and (on_gpu(value) or (module not in (None, np) and isinstance(value, module.ndarray)))

        refused = [name for name in on_a_gpu if not gpu_backend and not hasattr(given[name], "detach")]
        if refused:
            raise host_backend_refused(refused[0], self.backend)
        to_host = getattr(self.backend, "to_host", None) or (lambda value: gpu_array(value).get())
        self.on_device = any(there(v) for v in given.values())
        self.tensors = {name: _numpy(to_host(v) if there(v) and not hasattr(v, "detach") else v)
                        for name, v in given.items()}

    def gradients(self, plan: Plan, compute_dtype) -> dict:
        return plan.gradients(self.backend, compute_dtype, on_device=self.on_device)


def _numpy(value):
    """A torch tensor or anything array-like as a numpy array (a state_dict's values are torch tensors)."""
    detach = getattr(value, "detach", None)
    if not callable(detach):
        return np.asarray(value)
    tensor = detach().cpu()
    try:
        return tensor.numpy()
    except TypeError:  # a dtype numpy has not: bfloat16, a quantised tensor
        raise InvalidArgumentError(f"a torch tensor of {tensor.dtype}, which numpy has no dtype for: convert it "
                                   "(tensor.float()) first") from None

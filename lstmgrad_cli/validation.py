"""Input checks of the block-LSTM ops: the superset of TensorFlow's checks (docs/semantics.md).

Everything is checked before any computation, ranks before dimensions, and every message names
the tensor and says what was expected and what was found.  Where TensorFlow has a message for a
check, its wording starts ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from .errors import InvalidArgumentError
from .io import LazyDataset
from .spec import (  # noqa: F401 - (re-exported)
    ACTIVATIONS,
    CELL_TENSORS,
    FORWARD_INPUTS,
    OUTPUT_GRADIENTS,
    PEEPHOLES,
    RANKS,
    SEQ_TENSORS,
    WEIGHTS,
)

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
COMPUTE_DTYPES = ("float16", "float32", "float64")



class Dims(NamedTuple):
    """Sizes of one problem: time, batch, input and cell size (T is 1 for the cell op)."""

    T: int
    B: int
    I: int  # TensorFlow's name for the input size
    C: int


def as_float_arrays(tensors: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Turn array-likes into numpy arrays of one float dtype, or say which tensor is wrong."""
    arrays: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if isinstance(value, np.ndarray) or _is_lazy_array(value):
            array = value  # a lazy array (an h5py dataset) is checked by shape and dtype, not read
        else:
            try:
                array = np.asarray(value)
            except (TypeError, ValueError) as err:
                raise InvalidArgumentError(f"{name} is not an array: {err}") from None
        if array.dtype not in FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"{name} has dtype {_dtype_name(array.dtype)}; expected float16, float32 or float64"
            )
        arrays[name] = array
    dtypes = {a.dtype for a in arrays.values()}
    if len(dtypes) > 1:
        first = next(iter(arrays))
        other = next(n for n, a in arrays.items() if a.dtype != arrays[first].dtype)
        raise InvalidArgumentError(
            f"all tensors must have one dtype: {first} is {arrays[first].dtype} "
            f"but {other} is {arrays[other].dtype}"
        )
    return arrays


def _is_lazy_array(value: object) -> bool:
    """An input left on disk by ``io.open_inputs`` (read by slicing), checked by shape and dtype only."""
    return isinstance(value, LazyDataset)


def _dtype_name(dtype: np.dtype) -> str:
    return "object" if dtype.kind == "O" else str(dtype)


def check_seq_len_max(value: object, T: int) -> int:
    """``seq_len_max`` must be an integer scalar in [0, T]; returns it as a Python int."""
    array = np.asarray(value)
    if array.ndim != 0:
        raise InvalidArgumentError(
            f"`seq_len_max_tensor` must be rank 0 but is rank {array.ndim} (shape {list(array.shape)})"
        )
    integral_float = array.dtype.kind == "f" and bool(np.isfinite(array)) and float(array).is_integer()
    if array.dtype.kind not in "iu" and not integral_float:  # 5.0 from a float attribute is still 5
        raise InvalidArgumentError(
            f"seq_len_max must be an integer, got {array.item()!r} of dtype {_dtype_name(array.dtype)}"
        )
    length = int(array)
    if not 0 <= length <= T:
        raise InvalidArgumentError(f"seq_len_max must be between 0 and {T} but is {length}")
    return length


def check_use_peephole(value: object) -> bool:
    array = np.asarray(value)
    if array.ndim != 0 or array.dtype.kind not in "biu" or int(array) not in (0, 1):
        raise InvalidArgumentError(f"use_peephole must be a boolean scalar, got {value!r}")
    return bool(array)


def _check_ranks(arrays: Mapping[str, np.ndarray], ranks: Mapping[str, int]) -> None:
    for name, rank in ranks.items():
        ndim = arrays[name].ndim
        if ndim != rank:
            raise InvalidArgumentError(
                f"{name} must be rank {rank} but is rank {ndim} (shape {list(arrays[name].shape)})"
            )


def _check_shape(name: str, array: np.ndarray, expected: dict[str, int]) -> None:
    labels, sizes = list(expected), list(expected.values())
    got = list(array.shape)
    for axis, (label, size) in enumerate(zip(labels, sizes, strict=True)):
        if got[axis] != size:
            raise InvalidArgumentError(
                f"{name}.dims({axis}) != {label}: {got[axis]} vs. {size} "
                f"({name} has shape {got}, expected [{', '.join(labels)}] = {sizes})"
            )


def _cell_size_from_w(w: np.ndarray, allow_zero: bool) -> int:
    cols = w.shape[1]
    if cols % 4 or (cols == 0 and not allow_zero):
        raise InvalidArgumentError(
            f"w matrix columns must be a positive multiple of 4, but got {cols} (w has shape {list(w.shape)})"
        )
    return cols // 4


def _check_common(arrays: Mapping[str, np.ndarray], dims: Dims, step_names: tuple[str, ...],
                  step_shape: dict[str, int]) -> None:
    B, I, C = dims.B, dims.I, dims.C
    if arrays["w"].shape[0] != I + C:
        raise InvalidArgumentError(
            f"w matrix rows don't match: {I + C} vs. {arrays['w'].shape[0]} (w has shape "
            f"{list(arrays['w'].shape)}, expected [input_size + cell_size, 4 * cell_size] = [{I + C}, {4 * C}])"
        )
    for name in ("cs_prev", "h_prev"):
        _check_shape(name, arrays[name], {"batch_size": B, "cell_size": C})
    for name in PEEPHOLES:
        _check_shape(name, arrays[name], {"cell_size": C})
    _check_shape("b", arrays["b"], {"4 * cell_size": 4 * C})
    for name in step_names:
        _check_shape(name, arrays[name], step_shape)


def check_block_lstm_grad(arrays: Mapping[str, np.ndarray]) -> Dims:
    """Ranks and shapes of the BlockLSTMGrad/BlockLSTMGradV2 tensors (x is [T, B, I])."""
    _check_ranks(arrays, {name: RANKS["seq"][name] for name in SEQ_TENSORS})
    T, B, I = arrays["x"].shape
    C = _cell_size_from_w(arrays["w"], allow_zero=False)
    dims = Dims(T, B, I, C)
    _check_common(arrays, dims, (*ACTIVATIONS, *OUTPUT_GRADIENTS),
                  {"timelen": T, "batch_size": B, "cell_size": C})
    return dims


def check_lstm_block_cell_grad(arrays: Mapping[str, np.ndarray]) -> Dims:
    """Ranks and shapes of the LSTMBlockCellGrad tensors (x is [B, I]); C = 0 is allowed, as in TF."""
    step = [name for name in CELL_TENSORS if name in ACTIVATIONS or name in OUTPUT_GRADIENTS]
    _check_ranks(arrays, {name: RANKS["cell"][name] for name in CELL_TENSORS})
    B, I = arrays["x"].shape
    C = _cell_size_from_w(arrays["w"], allow_zero=True)
    dims = Dims(1, B, I, C)
    _check_common(arrays, dims, step, {"batch_size": B, "cell_size": C})
    return dims


def resolve_compute_dtype(dtype: np.dtype, compute_dtype: str | None) -> np.dtype:
    """float16 inputs compute in float32 unless asked otherwise; other inputs in their own dtype."""
    if compute_dtype is None:
        return np.dtype(np.float32) if dtype == np.float16 else np.dtype(dtype)
    if str(compute_dtype) not in COMPUTE_DTYPES:
        raise InvalidArgumentError(
            f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {compute_dtype!r}"
        )
    return np.dtype(str(compute_dtype))


def check_forward(arrays: Mapping[str, np.ndarray], sequence: bool) -> Dims:
    """Ranks and shapes of the forward ops' inputs (BlockLSTM(V2) if ``sequence``, else LSTMBlockCell).

    BlockLSTM accepts empty batch and cell sizes; LSTMBlockCell rejects them (docs/semantics.md).
    """
    _check_ranks(arrays, {name: RANKS["seq" if sequence else "cell"][name] for name in FORWARD_INPUTS})
    if sequence:
        T, B, I = arrays["x"].shape
    else:
        (B, I), T = arrays["x"].shape, 1
    C = _cell_size_from_w(arrays["w"], allow_zero=sequence)
    if not sequence and B == 0:
        raise InvalidArgumentError(f"cs_prev_tensor is empty, has shape: ({B},{C}).")
    dims = Dims(T, B, I, C)
    _check_common(arrays, dims, (), {})
    return dims

"""Input checks of the block-LSTM ops: the superset of TensorFlow's checks (docs/semantics.md).

Everything is checked before any computation, ranks before dimensions, and every message names
the tensor and says what was expected and what was found.  Where TensorFlow has a message for a
check, its wording starts ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ..backends import gpu_array, on_gpu
from ..errors import InvalidArgumentError
from ..spec import CELL_TENSORS, FORWARD_INPUTS, PEEPHOLES, RANKS, SEQ_TENSORS

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
COMPUTE_DTYPES = ("float16", "float32", "float64")


class Dims(NamedTuple):
    """Sizes of one problem: time, batch, input and cell size (T is 1 for the cell op)."""

    T: int
    B: int
    I: int  # TensorFlow's name for the input size
    C: int


class Issue(NamedTuple):
    """One problem of the tensors: which tensor (None: of no one tensor) and what is wrong, in words."""

    tensor: str | None
    message: str


def as_float_arrays(tensors: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Turn array-likes into numpy arrays of one float dtype, or say which tensor is wrong; where one is on a GPU
    (``backends.on_gpu``), all become cupy arrays there."""
    arrays: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if isinstance(value, np.ndarray) or _is_lazy_array(value):
            array = value  # a lazy array (an h5py dataset) is checked by shape and dtype, not read
        elif on_gpu(value):  # checked by shape and dtype too, and computed where it is (the cupy backend)
            try:
                array = gpu_array(value)
            except Exception as err:  # noqa: BLE001 - cupy missing, or torch's "use tensor.detach()"
                raise InvalidArgumentError(f"{name} is on a GPU, and cupy cannot take it: {err}") from None
        else:
            try:
                array = np.asarray(value)
            except (TypeError, ValueError) as err:
                raise InvalidArgumentError(f"{name} is not an array: {err}") from None
        arrays[name] = array
    if any(on_gpu(a) for a in arrays.values()):  # one on a GPU: the others join it there (a copy each)
        arrays = {name: a if on_gpu(a) else gpu_array(np.asarray(a)) for name, a in arrays.items()}
    _raise_first(dtype_issues(arrays))
    return arrays


def dtype_issues(arrays: Mapping[str, np.ndarray]) -> list[Issue]:
    """Every tensor of a dtype the ops do not take, then every float tensor whose dtype is not the first's."""
    issues = [Issue(name, f"{name} has dtype {_dtype_name(a.dtype)}; expected float16, float32 or float64")
              for name, a in arrays.items() if a.dtype not in FLOAT_DTYPES]
    floats = [(name, a.dtype) for name, a in arrays.items() if a.dtype in FLOAT_DTYPES]
    if floats:
        first, dtype = floats[0]
        issues += [Issue(name, f"all tensors must have one dtype: {first} is {dtype} but {name} is {other}")
                   for name, other in floats[1:] if other != dtype]
    return issues


def _raise_first(issues: list[Issue]) -> None:
    if issues:
        raise InvalidArgumentError(issues[0].message)


def _is_lazy_array(value: object) -> bool:
    """An input left on disk by ``io.open_inputs`` (``io.LazyDataset``: read by slicing, a chunk of rows at a time
    with ``read_into``), checked by shape and dtype only."""
    return hasattr(value, "read_into") and hasattr(value, "shape") and hasattr(value, "dtype")


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


def shape_issues(arrays: Mapping[str, np.ndarray], kind: str, *, forward: bool = False
                 ) -> tuple[list[Issue], Dims | None]:
    """Every rank and shape problem of the tensors present in ``arrays``, in the order the ops' checks meet them
    (all ranks, then w, cs_prev, h_prev, the peepholes, b, the per-step tensors), and the sizes when x and the
    cell size can be told.  ``kind``: "seq" (x is [T, B, I]) or "cell" ([B, I]); ``forward``: the forward op's
    inputs alone.  The raising checks below stop at the first; ``inspect`` lists them all.

    The cell size is w's; where w cannot tell it (its own problem) cs_prev's, h_prev's or b's is used only to
    check the other tensors against.  BlockLSTM accepts empty batch and cell sizes, LSTMBlockCell neither,
    and the gradient ops an empty cell size only for the cell (docs/semantics.md).
    """
    names = FORWARD_INPUTS if forward else (SEQ_TENSORS if kind == "seq" else CELL_TENSORS)
    ranks = RANKS[kind]
    issues: list[Issue] = []
    ranked = {}
    for name in names:
        if name not in arrays:
            continue
        a = arrays[name]
        if a.ndim != ranks[name]:
            issues.append(Issue(name, f"{name} must be rank {ranks[name]} but is rank {a.ndim} (shape "
                                      f"{list(a.shape)})"))
        else:
            ranked[name] = a
    x, w = ranked.get("x"), ranked.get("w")
    if x is None:
        return issues, None
    T, B, I = x.shape if kind == "seq" else (1, *x.shape)  # noqa: E741
    C = None
    if w is not None:
        cols = w.shape[1]
        if cols % 4 or (cols == 0 and (kind == "seq") != forward):
            issues.append(Issue("w", f"w matrix columns must be a positive multiple of 4, but got {cols} (w has "
                                     f"shape {list(w.shape)})"))
            w = None
        else:
            C = cols // 4
    for name, axis, div in (("cs_prev", 1, 1), ("h_prev", 1, 1), ("b", 0, 4)):  # (only where w cannot tell it)
        if C is None and name in ranked and ranked[name].shape[axis] % div == 0:
            C = ranked[name].shape[axis] // div
    if C is None:
        return issues, None
    if forward and kind == "cell" and B == 0:
        issues.append(Issue("cs_prev", f"cs_prev_tensor is empty, has shape: ({B},{C})."))
    if w is not None and w.shape[0] != I + C:
        issues.append(Issue("w", f"w matrix rows don't match: {I + C} vs. {w.shape[0]} (w has shape {list(w.shape)}, "
                                 f"expected [input_size + cell_size, 4 * cell_size] = [{I + C}, {4 * C}])"))
    expected = {"cs_prev": {"batch_size": B, "cell_size": C}, "h_prev": {"batch_size": B, "cell_size": C},
                **dict.fromkeys(PEEPHOLES, {"cell_size": C}), "b": {"4 * cell_size": 4 * C}}
    step = {"timelen": T, "batch_size": B, "cell_size": C} if kind == "seq" else {"batch_size": B, "cell_size": C}
    for name in names:
        if name in ranked and name not in ("x", "w"):
            issue = _shape_issue(name, ranked[name], expected.get(name, step))
            if issue is not None:
                issues.append(issue)
    return issues, Dims(T, B, I, C)


def _shape_issue(name: str, array: np.ndarray, expected: dict[str, int]) -> Issue | None:
    labels, sizes = list(expected), list(expected.values())
    got = list(array.shape)
    for axis, (label, size) in enumerate(zip(labels, sizes, strict=True)):
        if got[axis] != size:
            return Issue(name, f"{name}.dims({axis}) != {label}: {got[axis]} vs. {size} ({name} has shape {got}, "
                               f"expected [{', '.join(labels)}] = {sizes})")
    return None


def _checked(arrays: Mapping[str, np.ndarray], kind: str, forward: bool = False) -> Dims:
    issues, dims = shape_issues(arrays, kind, forward=forward)
    _raise_first(issues)
    return dims


def check_block_lstm_grad(arrays: Mapping[str, np.ndarray]) -> Dims:
    """Ranks and shapes of the BlockLSTMGrad/BlockLSTMGradV2 tensors (x is [T, B, I])."""
    return _checked(arrays, "seq")


def check_lstm_block_cell_grad(arrays: Mapping[str, np.ndarray]) -> Dims:
    """Ranks and shapes of the LSTMBlockCellGrad tensors (x is [B, I]); C = 0 is allowed, as in TF."""
    return _checked(arrays, "cell")


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
    return _checked(arrays, "seq" if sequence else "cell", forward=True)

"""The Python API: TensorFlow's block-LSTM ops with ``tf.raw_ops`` argument names, order and outputs.

All functions take and return numpy arrays, or arrays on a GPU (cupy's, DLPack's, ``__cuda_array_interface__``),
computed there and returned as cupy arrays; outputs have the input dtype.  Inputs are checked (validation.py)
before anything is computed; errors are ``InvalidArgumentError`` (a ``ValueError``).
"""

from __future__ import annotations

from ..backends import backend_for_arrays
from ..backends.contract import Backend
from ..results import BlockLSTMGradOutputs, BlockLSTMOutputs, LSTMBlockCellGradFullOutputs, LSTMBlockCellGradOutputs
from ..spec import (
    CELL_LAYOUT,
    CELL_TENSORS,
    FORWARD_INPUTS,
    LAYOUT_V1,
    LAYOUT_V2,
    SEQ_TENSORS,
    TIME_MAJOR,
    SeqTensors,
)
from . import validation
from .forward import block_lstm_forward

__all__ = [
    "BlockLSTMGradOutputs", "LSTMBlockCellGradOutputs", "LSTMBlockCellGradFullOutputs", "BlockLSTMOutputs",
    "block_lstm_grad_v2", "block_lstm_grad", "lstm_block_cell_grad", "lstm_block_cell_grad_full",
    "block_lstm_v2", "block_lstm", "lstm_block_cell",
]


def _named(names, arguments: dict) -> dict:
    """The op function's tensor arguments (its ``locals()``) under their names, in TF's order."""
    return {name: arguments[name] for name in names}


def _seq_grad(layout, seq_len_max, tensors: dict, use_peephole, backend, compute_dtype, chunk_steps=None):
    arrays = validation.as_float_arrays(tensors)
    dims = validation.check_block_lstm_grad(arrays)
    length = validation.check_seq_len_max(seq_len_max, dims.T)
    peephole = validation.check_use_peephole(use_peephole)
    cdt = validation.resolve_compute_dtype(arrays["x"].dtype, compute_dtype)
    return block_lstm_grad_checked(backend_for_arrays(arrays, backend), layout, length, arrays, peephole, cdt,
                                   chunk_steps)


def block_lstm_grad_checked(backend: Backend, layout: str, seq_len_max: int, arrays: dict, use_peephole: bool,
                            compute_dtype, chunk_steps=None, *, x_grad_out=None, observe=None) -> BlockLSTMGradOutputs:
    """BlockLSTMGrad(V2) on arrays that ``validation`` has already accepted (no second check), on a backend (the
    contract: backends/contract.py).  Without an example or a unit (B or C is 0) every step is empty and every
    gradient zero or empty: computed as for no step, whatever T declares (time proportional to the data, not to a
    declared T of nothing)."""
    if not arrays["x"].shape[1] * (arrays["w"].shape[1] // 4):
        seq_len_max = 0
    return backend.block_lstm_grad(
        SeqTensors(**arrays), seq_len_max=seq_len_max, use_peephole=use_peephole, layout=layout,
        compute_dtype=compute_dtype, chunk_steps=chunk_steps, x_grad_out=x_grad_out, observe=observe,
    )


def block_lstm_grad_v2(seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h,
                       cs_grad, h_grad, use_peephole, *, backend=None, compute_dtype=None,
                       chunk_steps=None) -> BlockLSTMGradOutputs:
    """BlockLSTMGradV2: the gradient of BlockLSTMV2 (gate layout IFCO).

    ``compute_dtype="float16"`` rounds every elementwise step to half, like TF's CPU kernel;
    by default float16 inputs are computed in float32 and rounded once.  ``chunk_steps`` bounds
    the time steps processed per batched matrix product (default: from a memory budget).
    """
    tensors = _named(SEQ_TENSORS, locals())
    return _seq_grad(LAYOUT_V2, seq_len_max, tensors, use_peephole, backend, compute_dtype, chunk_steps)


def block_lstm_grad(seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, h,
                    cs_grad, h_grad, use_peephole, *, backend=None, compute_dtype=None,
                    chunk_steps=None) -> BlockLSTMGradOutputs:
    """BlockLSTMGrad: the gradient of BlockLSTM (V1, gate layout ICFO).  Arguments as block_lstm_grad_v2."""
    tensors = _named(SEQ_TENSORS, locals())
    return _seq_grad(LAYOUT_V1, seq_len_max, tensors, use_peephole, backend, compute_dtype, chunk_steps)


def lstm_block_cell_grad_full(x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, cs_grad, h_grad,
                              use_peephole, *, backend=None, compute_dtype=None) -> LSTMBlockCellGradFullOutputs:
    """LSTMBlockCellGrad and x_grad, h_prev_grad, w_grad, b_grad as TF's cell gradient derives them.

    ``xh_grad = dicfo @ w^T`` split into x and h_prev parts, ``w_grad = [x, h_prev]^T @ dicfo``,
    ``b_grad = sum(dicfo)``: one step of BlockLSTMGrad with the ICFO layout.
    """
    arrays = validation.as_float_arrays(_named(CELL_TENSORS, locals()))
    validation.check_lstm_block_cell_grad(arrays)
    peephole = validation.check_use_peephole(use_peephole)
    cdt = validation.resolve_compute_dtype(arrays["x"].dtype, compute_dtype)
    one_step = {name: a[None] if name in TIME_MAJOR else a for name, a in arrays.items()}
    # h is only read as the previous output of steps t >= 1, which a single step does not have.
    outs, dgates = backend_for_arrays(arrays, backend).block_lstm_grad(
        SeqTensors(**one_step, h=None), seq_len_max=1, use_peephole=peephole, layout=CELL_LAYOUT,
        compute_dtype=cdt, return_dgates=True,
    )
    return LSTMBlockCellGradFullOutputs(
        outs.cs_prev_grad, dgates[0], outs.wci_grad, outs.wcf_grad, outs.wco_grad,
        outs.x_grad[0], outs.h_prev_grad, outs.w_grad, outs.b_grad,
    )


def lstm_block_cell_grad(x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, cs_grad, h_grad,
                         use_peephole, *, backend=None, compute_dtype=None) -> LSTMBlockCellGradOutputs:
    """LSTMBlockCellGrad: (cs_prev_grad, dicfo, wci_grad, wcf_grad, wco_grad); dicfo is always ICFO."""
    full = lstm_block_cell_grad_full(x, cs_prev, h_prev, w, wci, wcf, wco, b, i, cs, f, o, ci, co, cs_grad,
                                     h_grad, use_peephole, backend=backend, compute_dtype=compute_dtype)
    return LSTMBlockCellGradOutputs(*full[:5])


def _forward(sequence, layout, seq_len_max, tensors, forget_bias, cell_clip, use_peephole, compute_dtype):
    arrays = validation.as_float_arrays(tensors)
    dims = validation.check_forward(arrays, sequence)
    length = validation.check_seq_len_max(seq_len_max, dims.T) if sequence else 1
    peephole = validation.check_use_peephole(use_peephole)
    cdt = validation.resolve_compute_dtype(arrays["x"].dtype, compute_dtype)
    if not sequence:
        arrays["x"] = arrays["x"][None]
    outs = block_lstm_forward(length, **arrays, forget_bias=float(forget_bias), cell_clip=float(cell_clip),
                              use_peephole=peephole, layout=layout, compute_dtype=cdt)
    return BlockLSTMOutputs(*(o if sequence else o[0] for o in outs))


def block_lstm_v2(seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, cell_clip=0.0, use_peephole=False,
                  *, compute_dtype=None) -> BlockLSTMOutputs:
    """BlockLSTMV2 forward (IFCO, no forget bias, no clipping by default)."""
    tensors = _named(FORWARD_INPUTS, locals())
    return _forward(True, LAYOUT_V2, seq_len_max, tensors, 0.0, cell_clip, use_peephole, compute_dtype)


def block_lstm(seq_len_max, x, cs_prev, h_prev, w, wci, wcf, wco, b, forget_bias=1.0, cell_clip=3.0,
               use_peephole=False, *, compute_dtype=None) -> BlockLSTMOutputs:
    """BlockLSTM forward (V1, ICFO); TF's defaults forget_bias=1 and cell_clip=3 (cell_clip <= 0: none)."""
    tensors = _named(FORWARD_INPUTS, locals())
    return _forward(True, LAYOUT_V1, seq_len_max, tensors, forget_bias, cell_clip, use_peephole, compute_dtype)


def lstm_block_cell(x, cs_prev, h_prev, w, wci, wcf, wco, b, forget_bias=1.0, cell_clip=3.0, use_peephole=False,
                    *, compute_dtype=None) -> BlockLSTMOutputs:
    """LSTMBlockCell forward (one step, ICFO); outputs are [B, C]."""
    tensors = _named(FORWARD_INPUTS, locals())
    return _forward(False, CELL_LAYOUT, 1, tensors, forget_bias, cell_clip, use_peephole, compute_dtype)

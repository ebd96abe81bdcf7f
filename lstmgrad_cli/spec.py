"""The block-LSTM ops' rules as data: names, order, ranks, gate layouts, op names and attribute defaults.

Everything else (readers, backends, validation, analysis, the command line) imports these tables instead of
spelling the names again, so that a rule lives in one place (tf-semantics.md is what they transcribe).
No imports from the rest of the package: this module is the bottom of the stack.
"""

from __future__ import annotations

from typing import NamedTuple

# -- tensor names, in TF's argument order --------------------------------------------------------------------

FORWARD_INPUTS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")  # BlockLSTM(V2), LSTMBlockCell
WEIGHTS = ("w", "wci", "wcf", "wco", "b")
PEEPHOLES = ("wci", "wcf", "wco")
ACTIVATIONS = ("i", "cs", "f", "o", "ci", "co", "h")  # the forward op's outputs, the gradient op's inputs
OUTPUT_GRADIENTS = ("cs_grad", "h_grad")  # the gradients arriving at cs and h
SEQ_TENSORS = (*FORWARD_INPUTS, *ACTIVATIONS, *OUTPUT_GRADIENTS)  # BlockLSTMGrad(V2), after seq_len_max
CELL_TENSORS = (*FORWARD_INPUTS, *ACTIVATIONS[:-1], *OUTPUT_GRADIENTS)  # LSTMBlockCellGrad (no h)
TIME_MAJOR = ("x", *ACTIVATIONS, *OUTPUT_GRADIENTS)  # the sequence op's tensors with a time axis

# Scalars: the sequence length and the attributes.  forget_bias and cell_clip matter only to a forward pass.
SCALARS = ("seq_len_max", "use_peephole", "forget_bias", "cell_clip")

SEQ_GRADS = ("x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad", "b_grad")
CELL_GRADS = ("cs_prev_grad", "dicfo", "wci_grad", "wcf_grad", "wco_grad")  # LSTMBlockCellGrad's own outputs
CELL_GRADS_FULL = (*CELL_GRADS, "x_grad", "h_prev_grad", "w_grad", "b_grad")  # plus what TF's cell gradient derives
GRADIENT_NAMES = tuple(dict.fromkeys((*SEQ_GRADS, *CELL_GRADS_FULL)))  # every gradient name lstmgrad writes

# The tensors of one problem, as the backends take them (seq_len_max and the attributes are passed apart).
SeqTensors = NamedTuple("SeqTensors", [(name, object) for name in SEQ_TENSORS])
SeqTensors.__doc__ = "The 17 tensor inputs of BlockLSTMGrad(V2), in TF's order (seq_len_max is passed apart)."

# -- ranks ----------------------------------------------------------------------------------------------------

# The rank each tensor must have, by kind of op ("seq": BlockLSTM(V2) and their gradients, "cell": LSTMBlockCell
# and its gradient).  A reader may check a declared shape against these before it reads a byte of data.
RANKS = {
    "seq": {"x": 3, "cs_prev": 2, "h_prev": 2, "w": 2, "wci": 1, "wcf": 1, "wco": 1, "b": 1,
            **dict.fromkeys(ACTIVATIONS, 3), **dict.fromkeys(OUTPUT_GRADIENTS, 3),
            **dict.fromkeys(SCALARS, 0)},
    "cell": {"x": 2, "cs_prev": 2, "h_prev": 2, "w": 2, "wci": 1, "wcf": 1, "wco": 1, "b": 1,
             **dict.fromkeys(ACTIVATIONS, 2), **dict.fromkeys(OUTPUT_GRADIENTS, 2),
             **dict.fromkeys(SCALARS, 0)},
}

# -- gate layouts and ops -------------------------------------------------------------------------------------

# Gate block offsets, in units of C, of w's columns, b and the gate gradients.
LAYOUTS = {
    "ifco": {"i": 0, "f": 1, "c": 2, "o": 3},  # BlockLSTMV2 / BlockLSTMGradV2
    "icfo": {"i": 0, "c": 1, "f": 2, "o": 3},  # BlockLSTM / BlockLSTMGrad / LSTMBlockCell(Grad)
}

LAYOUT_V2 = "ifco"  # BlockLSTMV2's and BlockLSTMGradV2's (a Keras or PyTorch layer's gates are in this order too)
LAYOUT_V1 = "icfo"  # BlockLSTM's and BlockLSTMGrad's
CELL_LAYOUT = LAYOUT_V1  # LSTMBlockCell and LSTMBlockCellGrad have no layout attribute: always ICFO
OTHER_LAYOUT = {LAYOUT_V2: LAYOUT_V1, LAYOUT_V1: LAYOUT_V2}


def layout_for(kind: str | None, layout: str | None) -> str | None:
    """The gate layout of an op of ``kind`` asked for in ``layout``: the cell op's own whatever is asked."""
    return CELL_LAYOUT if kind == "cell" else layout


# TF op names by (kind, gate layout): the gradient ops and the forward ops they differentiate.
OPS = {("seq", "ifco"): "BlockLSTMGradV2", ("seq", "icfo"): "BlockLSTMGrad", ("cell", "icfo"): "LSTMBlockCellGrad"}
FORWARD_OPS = {("seq", "ifco"): "BlockLSTMV2", ("seq", "icfo"): "BlockLSTM", ("cell", "icfo"): "LSTMBlockCell"}
LAYOUT_OPS = {"ifco": "BlockLSTMV2", "icfo": "BlockLSTM"}  # the forward sequence op of each layout


class OpSignature(NamedTuple):
    """One TF op: its kind, gate layout, the forward op it differentiates (None for a forward op), and its tensor
    inputs and outputs by name, in the op definition's order."""

    kind: str
    layout: str
    forward_op: str | None
    inputs: tuple
    outputs: tuple


_OP_INPUTS = {"seq": ("seq_len_max", *FORWARD_INPUTS), "cell": FORWARD_INPUTS}
_GRAD_OUTPUTS = {"seq": SEQ_GRADS, "cell": CELL_GRADS}
# op type -> its signature, for every op lstmgrad knows (a debug dump's executions are read by these)
SIGNATURES = {
    **{op: OpSignature(kind, layout, None, _OP_INPUTS[kind], ACTIVATIONS)
       for (kind, layout), op in FORWARD_OPS.items()},
    **{op: OpSignature(kind, layout, FORWARD_OPS[kind, layout],
                       (*_OP_INPUTS[kind], *ACTIVATIONS[:len(ACTIVATIONS) - (kind == "cell")], *OUTPUT_GRADIENTS),
                       _GRAD_OUTPUTS[kind])
       for (kind, layout), op in OPS.items()},
}
GRADIENT_OPS = tuple(op for op, signature in SIGNATURES.items() if signature.forward_op is not None)

# (forget_bias, cell_clip) defaults of each forward op's attributes; BlockLSTMV2 has no forget_bias at all.
FORWARD_DEFAULTS = {"BlockLSTMV2": (0.0, 0.0), "BlockLSTM": (1.0, 3.0), "LSTMBlockCell": (1.0, 3.0)}

# The op defaults where a file and the activations say nothing: IFCO (BlockLSTMGradV2), no peepholes, T steps.
DEFAULT_LAYOUT = LAYOUT_V2
DEFAULT_USE_PEEPHOLE = False


def op_name(kind: str, layout: str | None) -> str:
    """The gradient op of ``kind`` ("seq", "cell") in ``layout`` (the cell's own whatever is asked)."""
    return OPS[(kind, layout_for(kind, layout))]


def forward_op_name(kind: str, layout: str | None) -> str:
    """The forward op of ``kind`` in ``layout`` (the cell's own whatever is asked)."""
    return FORWARD_OPS[(kind, layout_for(kind, layout))]

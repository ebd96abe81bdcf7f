"""The block-LSTM ops' rules as data: names, order, ranks, gate layouts, op names and attribute defaults.

Everything else (readers, backends, validation, analysis, the command line) imports these tables instead of
spelling the names again, so that a rule lives in one place (tf-semantics.md is what they transcribe).
No imports from the rest of the package: this module is the bottom of the stack.
"""

from __future__ import annotations

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

# TF op names by (kind, gate layout): the gradient ops and the forward ops they differentiate.
OPS = {("seq", "ifco"): "BlockLSTMGradV2", ("seq", "icfo"): "BlockLSTMGrad", ("cell", "icfo"): "LSTMBlockCellGrad"}
FORWARD_OPS = {("seq", "ifco"): "BlockLSTMV2", ("seq", "icfo"): "BlockLSTM", ("cell", "icfo"): "LSTMBlockCell"}
LAYOUT_OPS = {"ifco": "BlockLSTMV2", "icfo": "BlockLSTM"}  # the forward sequence op of each layout

# (forget_bias, cell_clip) defaults of each forward op's attributes; BlockLSTMV2 has no forget_bias at all.
FORWARD_DEFAULTS = {"BlockLSTMV2": (0.0, 0.0), "BlockLSTM": (1.0, 3.0), "LSTMBlockCell": (1.0, 3.0)}

# The op defaults where a file and the activations say nothing: IFCO (BlockLSTMGradV2), no peepholes, T steps.
DEFAULT_LAYOUT = "ifco"
DEFAULT_USE_PEEPHOLE = False

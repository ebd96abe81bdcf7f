"""``lstmgrad_cli.load``: a file's tensors, ready for the op functions, with the op that made them.

    inputs = lstmgrad_cli.load("fixtures/seq_v1_peep.in.npz")
    inputs.op                                  # 'BlockLSTMGrad': the activations are BlockLSTM's (ICFO)
    grads = lstmgrad_cli.block_lstm_grad(**inputs)
    grads = inputs.gradients()                 # the same: the function of inputs.op

The file is read and checked as ``lstmgrad seq``/``cell`` read it (any input format, camelCase names,
HDF5 attributes, defaults), and the gate layout and ``use_peephole`` that neither the file nor an
argument gives are what the stored activations fit.
"""

from __future__ import annotations

import os

from ..backends import get_backend
from ..ops import block_lstm_grad, block_lstm_grad_v2, lstm_block_cell_grad_full
from .gradients import gradients
from .reading import load_problem
from .request import Request, request_from

# The function computing each gradient op; for the cell, what `lstmgrad cell` writes (LSTMBlockCellGrad + x, h, w, b).
FUNCTIONS = {"BlockLSTMGradV2": block_lstm_grad_v2, "BlockLSTMGrad": block_lstm_grad,
             "LSTMBlockCellGrad": lstm_block_cell_grad_full}


class OpInputs(dict):
    """Tensors and attributes under the op function's argument names: ``fn(**inputs)`` works.

    ``op``: the gradient op of the op that made the activations; ``kind`` "seq" or "cell"; ``layout``;
    ``sources``: where use_peephole, seq_len_max and the layout came from ("tensor", "attribute", "flag",
    "activations", "default"); ``notes``: defaults used; ``warnings``: what contradicts the activations.
    ``framework``: "keras" or "torch" for a Keras layer's or a PyTorch module's tensors (None for the op's own).
    """

    def __init__(self, tensors: dict, *, op: str, kind: str, layout: str, sources: dict, notes: list[str],
                 warnings: list[str], problem=None):
        super().__init__(tensors)
        self.op, self.kind, self.layout = op, kind, layout
        self.sources, self.notes, self.warnings = sources, notes, warnings
        plan = None if problem is None else problem.framework
        self.framework = None if plan is None else plan.framework
        self._problem = problem if plan is not None else None  # a framework's: computed as lstmgrad seq does

    def gradients(self, **options):
        """The gradient of ``op`` (``backend=``, ``compute_dtype=`` as the op functions take them); of a Keras
        layer or a PyTorch module, a dict of its gradients in the framework's names and layouts, as ``lstmgrad
        seq`` writes them (its mask, lengths, layers and directions taken into account)."""
        if self._problem is not None:
            return gradients(self._problem, get_backend(options.get("backend")), options.get("compute_dtype"))
        return FUNCTIONS[self.op](**self, **options)

    def __repr__(self) -> str:
        return f"OpInputs(op={self.op!r}, tensors={list(self)})"


def load(path: str | os.PathLike, group: str | None = None, *, request: Request | None = None, **fields) -> OpInputs:
    """Read one input (HDF5, NPZ, safetensors, a directory of .npy files, a TensorFlow debug dump) for the op
    functions; raises ``LstmGradError``.

    ``request`` (a ``Request``), or its fields as keywords: ``kind`` ("seq"/"cell") defaults to the rank of x;
    ``layout``, ``use_peephole`` and ``seq_len_max`` override the file and the activations, as the command-line
    flags do; ``weights`` (and ``weights_group``): another input holding the tensors ``path`` lacks (a dump's
    unrecorded function arguments, a model's weights), ``path``'s own win; a Keras or PyTorch input's layout
    (``batch_first=True``, ``time_major=True``, ``layer=K``, ``reverse=True``, ...) and whose names they are
    (``framework="torch"``).
    """
    if request is None:
        request = request_from(group=group, **fields)
    elif fields or group is not None:
        raise TypeError("give a request or its fields, not both")
    problem = load_problem(path, request)
    tensors = dict(problem.arrays)
    if problem.kind == "seq":
        tensors = {"seq_len_max": problem.seq_len_max, **tensors}
    tensors["use_peephole"] = problem.use_peephole
    return OpInputs(tensors, op=problem.op, kind=problem.kind, layout=problem.layout, sources=dict(problem.sources),
                    notes=list(problem.defaults), warnings=list(problem.warnings), problem=problem)

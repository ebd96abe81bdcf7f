"""A problem's gradients on a backend: the one way ``seq``/``cell``, ``check`` and batches compute them.

A Keras or PyTorch module that is no single op (several layers or directions, a projection, activations the op
has not) runs its own pass (``Plan.gradients``); so does a single layer asked for in a wider dtype than its
tensors, since the module recomputes its forward in that dtype, where the op would take activations stored in the
input's.  Everything else is the op's own gradient (BlockLSTMGrad(V2), or LSTMBlockCellGrad with what TF derives
from it), under the framework's names and layouts for a framework's layer.

On a backend that computes GPU arrays a framework's single layer runs its own pass too (when nothing asks for the
op's: no per-step report, no chunks, no x_grad written as it is made), so that its forward is recomputed on the
device and only the layer's tensors cross to it (layers/device.py), not the op's activations.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from ..layers import device as devices
from ..messages import Message, Param
from ..ops import block_lstm_grad_checked, lstm_block_cell_grad_full, validation
from .reading import Problem


def gradients(problem: Problem, backend, compute_dtype=None, *, layout: str | None = None,
              use_peephole: bool | None = None, seq_len_max: int | None = None, chunk_steps: int | None = None,
              observe=None, x_grad_out=None, one_op: str | None = None, op_names: bool = False
              ) -> dict[str, np.ndarray]:
    """The gradients of ``problem`` on ``backend`` (a backend object) in ``compute_dtype`` (None: the input's, float32
    for float16), by name.

    ``layout``, ``use_peephole`` and ``seq_len_max`` compute the op's gradient under other settings than the
    problem's (``check`` explains a difference so).  ``observe`` and ``x_grad_out`` go to the op's backward pass
    (per-step diagnostics, an x_grad written to disk as it is made).  ``one_op``: the caller needs the op's own
    gradient for what that parameter asks (``per_step``, ``gradcheck``): a module that is no single op is refused,
    naming it.  ``op_names``: the op's output names, not the framework's.
    """
    arrays = problem.arrays
    cdt = validation.resolve_compute_dtype(arrays["x"].dtype, compute_dtype)
    plan = problem.framework
    wider = cdt != arrays["x"].dtype and observe is None
    as_op = (one_op, observe, x_grad_out, layout, use_peephole, seq_len_max, chunk_steps) != (None,) * 7 or op_names
    on_device = problem.kind == "seq" and not as_op and not devices.of(backend).on_host
    if plan is not None and (not plan.single or (wider and one_op is None) or on_device):
        if one_op is not None:
            raise InvalidArgumentError(Message.format("{}: {} follows one op's gradient, and {}", problem.path,
                                                      Param(one_op), plan.not_one_op))
        return plan.gradients(backend, cdt)
    if problem.kind == "seq":
        outputs = block_lstm_grad_checked(backend, layout or problem.layout, problem.seq_len_max if seq_len_max is None
                                          else seq_len_max, arrays,
                                          problem.use_peephole if use_peephole is None else use_peephole, cdt,
                                          chunk_steps, observe=observe, x_grad_out=x_grad_out)
    else:
        outputs = lstm_block_cell_grad_full(**arrays, use_peephole=problem.use_peephole if use_peephole is None
                                            else use_peephole, backend=backend, compute_dtype=cdt)
    if plan is not None and not op_names:
        return plan.from_op(outputs)
    return outputs._asdict()

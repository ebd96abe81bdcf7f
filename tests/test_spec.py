"""spec.py is the one place the ops' names live: what the public result types, the backends and the dump reader
use must be its tables, not copies of them."""

from __future__ import annotations

import ast
from pathlib import Path

from lstmgrad_cli import results, spec
from lstmgrad_cli.io import tfdbg

PACKAGE = Path(spec.__file__).parent


def test_the_result_types_have_the_ops_output_names_in_tfs_order():
    assert results.BlockLSTMGradOutputs._fields == spec.SEQ_GRADS
    assert results.LSTMBlockCellGradOutputs._fields == spec.CELL_GRADS
    assert results.LSTMBlockCellGradFullOutputs._fields == spec.CELL_GRADS_FULL
    assert results.BlockLSTMOutputs._fields == spec.ACTIVATIONS


def test_each_gradient_op_takes_its_forward_ops_inputs_and_outputs_and_the_output_gradients():
    for op in spec.GRADIENT_OPS:
        signature = spec.SIGNATURES[op]
        forward = spec.SIGNATURES[signature.forward_op]
        assert (forward.kind, forward.layout) == (signature.kind, signature.layout)
        assert spec.OPS[signature.kind, signature.layout] == op
        tensors = spec.SEQ_TENSORS if signature.kind == "seq" else spec.CELL_TENSORS
        assert [n for n in signature.inputs if n != "seq_len_max"] == list(tensors)
        assert set(forward.inputs) <= set(signature.inputs)
    assert tfdbg.OPS is spec.SIGNATURES  # the dump reader names a recorded op's tensors by the same table


def test_no_module_outside_the_backends_imports_a_backends_private_module():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "backends":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if any(m.split(".")[-1] == "_xp" for m in modules):
                    offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []

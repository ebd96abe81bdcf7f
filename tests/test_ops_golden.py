"""The Python API against gradients computed by TensorFlow 2.21 itself (fixtures/, see its README)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CELL_CASES, FIXTURES, SEQ_CASES, assert_close_scaled, load_case

import lstmgrad_cli as lg

SEQ_OUTPUTS = ["x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad", "b_grad"]


def seq_call(inputs, layout, **kw):
    args = dict(inputs)
    peep = args.pop("use_peephole")
    fn = lg.block_lstm_grad_v2 if layout == "ifco" else lg.block_lstm_grad
    return fn(**args, use_peephole=peep, **kw)


def cell_args(inputs):
    args = dict(inputs)
    args.pop("h")  # the cell grad op has no h input
    return args, args.pop("use_peephole")


@pytest.mark.parametrize("name", SEQ_CASES)
def test_sequence_ops_match_tensorflow(name):
    inputs, expected, case = load_case(name)
    got = seq_call(inputs, case["layout"])
    assert list(got._fields) == SEQ_OUTPUTS
    for key in SEQ_OUTPUTS:
        assert got._asdict()[key].dtype == expected[key].dtype, key
        assert_close_scaled(got._asdict()[key], expected[key], name=f"{name}.{key}")


@pytest.mark.parametrize("name", CELL_CASES)
def test_cell_op_matches_tensorflow(name):
    inputs, expected, case = load_case(name)
    args, peep = cell_args(inputs)
    full = lg.lstm_block_cell_grad_full(**args, use_peephole=peep)
    for key, value in full._asdict().items():
        assert value.dtype == expected[key].dtype
        assert_close_scaled(value, expected[key], name=f"{name}.{key}")
    short = lg.lstm_block_cell_grad(**args, use_peephole=peep)
    assert list(short._fields) == ["cs_prev_grad", "dicfo", "wci_grad", "wcf_grad", "wco_grad"]
    for key, value in short._asdict().items():
        np.testing.assert_array_equal(value, full._asdict()[key])


@pytest.mark.parametrize("name", [n for n in CELL_CASES if load_case(n)[2]["dtype"] == "float32"])
def test_cell_elementwise_outputs_are_bit_exact_in_float32(name):
    # TF's elementwise order is followed exactly (docs/semantics.md): no GEMM is involved here.
    inputs, expected, _ = load_case(name)
    args, peep = cell_args(inputs)
    got = lg.lstm_block_cell_grad(**args, use_peephole=peep)
    for key in got._fields:
        np.testing.assert_array_equal(got._asdict()[key], expected[key], err_msg=key)


def test_half_emulation_is_bit_exact_with_tf_cpu_for_the_cell():
    inputs, expected, _ = load_case("cell_half")
    args, peep = cell_args(inputs)
    emulated = lg.lstm_block_cell_grad(**args, use_peephole=peep, compute_dtype="float16")
    for key in emulated._fields:
        np.testing.assert_array_equal(emulated._asdict()[key], expected[key], err_msg=key)
    default = lg.lstm_block_cell_grad(**args, use_peephole=peep)
    assert default.dicfo.dtype == np.float16
    # The default (float32 arithmetic, one rounding) is closer to the exact answer than TF's half kernel.
    exact = lg.lstm_block_cell_grad(**{k: v.astype(np.float64) for k, v in args.items()}, use_peephole=peep)
    for key in default._fields:
        want = exact._asdict()[key]
        ours = np.abs(default._asdict()[key].astype(np.float64) - want).sum()
        tfs = np.abs(expected[key].astype(np.float64) - want).sum()
        assert ours <= tfs, f"{key}: rounding once is not more accurate ({ours:.3g} vs TF's {tfs:.3g})"
    assert not np.array_equal(default.cs_prev_grad, expected["cs_prev_grad"])


@pytest.mark.parametrize("name", [n for n in SEQ_CASES if load_case(n)[2]["dtype"] == "float16"])
def test_half_sequence_both_modes_within_half_tolerance(name):
    inputs, expected, case = load_case(name)
    for compute_dtype in (None, "float16", "float32", "float64"):
        got = seq_call(inputs, case["layout"], compute_dtype=compute_dtype)
        for key in SEQ_OUTPUTS:
            assert got._asdict()[key].dtype == np.float16
            assert_close_scaled(got._asdict()[key], expected[key], name=f"{name}.{key}/{compute_dtype}")


def test_v2_is_the_correct_gradient_not_tfs_tape_gradient():
    # TF's tape gradient of BlockLSTMV2 runs the ICFO kernel (docs/semantics.md): we are BlockLSTMGradV2.
    inputs, _, _ = load_case("seq_v2_peep")
    with np.load(FIXTURES / "seq_v2_peep.tape.npz") as tape_file:
        tape = {k: tape_file[k] for k in tape_file.files}
    got = seq_call(inputs, "ifco")
    assert np.max(np.abs(got.w_grad - tape["w_grad"])) > 0.1
    v1_on_v2 = seq_call(inputs, "icfo")
    for key in SEQ_OUTPUTS:
        assert_close_scaled(v1_on_v2._asdict()[key], tape[key], name=key)

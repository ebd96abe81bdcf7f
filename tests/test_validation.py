"""Bad tensors are refused before any computation with one clear message (docs/semantics.md)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_case

import lstmgrad_cli as lg
from lstmgrad_cli.errors import InvalidArgumentError, LstmGradError


def seq_args(name="seq_v2_peep"):
    inputs, _, _ = load_case(name)
    args = dict(inputs)
    args["use_peephole"] = bool(args["use_peephole"])
    return args


def cell_args():
    inputs, _, _ = load_case("cell_peep")
    args = dict(inputs)
    args.pop("h")
    args["use_peephole"] = bool(args["use_peephole"])
    return args


def refuse(fn, args, *fragments):
    with pytest.raises(InvalidArgumentError) as info:
        fn(**args)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert "\n" not in message
    return message


def test_errors_are_value_errors_of_the_package():
    assert issubclass(InvalidArgumentError, LstmGradError) and issubclass(LstmGradError, ValueError)


@pytest.mark.parametrize("name, shape, fragments", [
    ("x", (5, 3), ["x must be rank 3 but is rank 2"]),
    ("cs_prev", (3, 6, 1), ["cs_prev must be rank 2 but is rank 3"]),
    ("w", (240,), ["w must be rank 2 but is rank 1"]),
    ("wci", (6, 1), ["wci must be rank 1 but is rank 2"]),
    ("b", (), ["b must be rank 1 but is rank 0"]),
    ("i", (5, 18), ["i must be rank 3 but is rank 2"]),
    ("h_grad", (5, 3, 6, 1), ["h_grad must be rank 3 but is rank 4"]),
])
def test_ranks(name, shape, fragments):
    args = seq_args()
    args[name] = np.zeros(shape, np.float32)
    refuse(lg.block_lstm_grad_v2, args, *fragments)


@pytest.mark.parametrize("name, shape, fragments", [
    ("cs_prev", (4, 6), ["cs_prev.dims(0) != batch_size: 4 vs. 3", "expected [batch_size, cell_size] = [3, 6]"]),
    ("h_prev", (3, 5), ["h_prev.dims(1) != cell_size: 5 vs. 6"]),
    ("w", (11, 24), ["w matrix rows don't match: 10 vs. 11"]),
    ("w", (10, 25), ["w matrix columns must be a positive multiple of 4, but got 25"]),
    ("w", (4, 0), ["positive multiple of 4, but got 0"]),
    ("wci", (7,), ["wci.dims(0) != cell_size: 7 vs. 6"]),
    ("wco", (5,), ["wco.dims(0) != cell_size: 5 vs. 6"]),
    ("b", (25,), ["b.dims(0) != 4 * cell_size: 25 vs. 24"]),
    ("f", (5, 3, 7), ["f.dims(2) != cell_size: 7 vs. 6"]),
    ("cs_grad", (3, 3, 6), ["cs_grad.dims(0) != timelen: 3 vs. 5"]),
    ("h", (5, 2, 6), ["h.dims(1) != batch_size: 2 vs. 3"]),
])
def test_dimensions(name, shape, fragments):
    args = seq_args()
    args[name] = np.zeros(shape, np.float32)
    refuse(lg.block_lstm_grad_v2, args, *fragments)


def test_peephole_sizes_are_checked_even_without_peepholes():
    args = seq_args()
    args["use_peephole"] = False
    args["wcf"] = np.zeros(2, np.float32)
    refuse(lg.block_lstm_grad_v2, args, "wcf.dims(0) != cell_size: 2 vs. 6")


@pytest.mark.parametrize("value, fragment", [
    (6, "seq_len_max must be between 0 and 5 but is 6"),
    (-1, "seq_len_max must be between 0 and 5 but is -1"),
    (np.array([5]), "`seq_len_max_tensor` must be rank 0 but is rank 1"),
    (2.5, "seq_len_max must be an integer"),
    (float("nan"), "seq_len_max must be an integer"),
    ("5", "seq_len_max must be an integer"),
])
def test_seq_len_max(value, fragment):
    args = seq_args()
    args["seq_len_max"] = value
    refuse(lg.block_lstm_grad_v2, args, fragment)


def test_integral_float_seq_len_max_is_accepted():
    args = seq_args()
    args["seq_len_max"] = 5.0
    lg.block_lstm_grad_v2(**args)


@pytest.mark.parametrize("dtype, fragment", [
    (np.int64, "x has dtype int64; expected float16, float32 or float64"),
    (np.complex64, "x has dtype complex64"),
    (object, "x has dtype object"),
    (np.bool_, "x has dtype bool"),
])
def test_non_float_dtypes(dtype, fragment):
    args = seq_args()
    args["x"] = args["x"].astype(dtype)
    refuse(lg.block_lstm_grad_v2, args, fragment)


def test_mixed_float_dtypes():
    args = seq_args()
    args["w"] = args["w"].astype(np.float64)
    refuse(lg.block_lstm_grad_v2, args, "all tensors must have one dtype", "x is float32", "w is float64")


def test_use_peephole_must_be_boolean():
    args = seq_args()
    args["use_peephole"] = 3
    refuse(lg.block_lstm_grad_v2, args, "use_peephole must be a boolean")


def test_unknown_compute_dtype():
    args = seq_args()
    with pytest.raises(InvalidArgumentError, match="compute_dtype must be one of"):
        lg.block_lstm_grad_v2(**args, compute_dtype="bfloat16")


@pytest.mark.parametrize("name, shape, fragment", [
    ("x", (3,), "x must be rank 2 but is rank 1"),  # TF aborts the process on this one
    ("i", (3, 4), "i.dims(1) != cell_size: 4 vs. 5"),
    ("cs_grad", (2, 5), "cs_grad.dims(0) != batch_size: 2 vs. 3"),
    ("wci", (4,), "wci.dims(0) != cell_size: 4 vs. 5"),
])
def test_cell_checks(name, shape, fragment):
    args = cell_args()
    args[name] = np.zeros(shape, np.float32)
    refuse(lg.lstm_block_cell_grad, args, fragment)


def test_empty_sizes_follow_tf():
    # BlockLSTMGrad accepts B = 0 and T = 0; LSTMBlockCellGrad accepts C = 0; LSTMBlockCell rejects B = 0.
    z = np.zeros
    seq = dict(seq_len_max=0, x=z((0, 0, 2), np.float32), cs_prev=z((0, 3), np.float32),
               h_prev=z((0, 3), np.float32), w=z((5, 12), np.float32), wci=z(3, np.float32), wcf=z(3, np.float32),
               wco=z(3, np.float32), b=z(12, np.float32),
               **{k: z((0, 0, 3), np.float32) for k in ("i", "cs", "f", "o", "ci", "co", "h", "cs_grad", "h_grad")})
    out = lg.block_lstm_grad_v2(**seq, use_peephole=True)
    assert out.x_grad.shape == (0, 0, 2) and out.w_grad.shape == (5, 12) and not out.w_grad.any()
    cell = dict(x=z((2, 3), np.float32), cs_prev=z((2, 0), np.float32), h_prev=z((2, 0), np.float32),
                w=z((3, 0), np.float32), wci=z(0, np.float32), wcf=z(0, np.float32), wco=z(0, np.float32),
                b=z(0, np.float32), **{k: z((2, 0), np.float32) for k in ("i", "cs", "f", "o", "ci", "co", "cs_grad",
                                                                         "h_grad")})
    assert lg.lstm_block_cell_grad(**cell, use_peephole=False).dicfo.shape == (2, 0)
    with pytest.raises(InvalidArgumentError, match="cs_prev_tensor is empty"):
        lg.lstm_block_cell(x=z((0, 3)), cs_prev=z((0, 2)), h_prev=z((0, 2)), w=z((5, 8)), wci=z(2), wcf=z(2),
                           wco=z(2), b=z(8))

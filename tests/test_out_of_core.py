"""HDF5 sequence inputs are streamed: read a chunk of time steps at a time, x_grad written chunk by chunk."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from conftest import consistent_inputs, load_case, write_h5, write_npz

from lstmgrad_cli.cli import main
from lstmgrad_cli.jobs import GradOptions, run_grad_file


def long_problem(T=40, B=3, I=5, C=4, seed=0):  # noqa: E741
    return consistent_inputs(T, B, I, C, seed=seed)


def read_h5(path):
    with h5py.File(path, "r") as fh:
        return {k: fh[k][()] for k in fh}, json.loads(fh.attrs["__lstmgrad__"])


@pytest.mark.parametrize("chunk_steps", [1, 7, 40])
def test_streamed_hdf5_equals_the_in_memory_run(tmp_path, chunk_steps):
    tensors = long_problem()
    scalars = {"seq_len_max": np.int64(33), "use_peephole": True}
    h5_in = write_h5(tmp_path / "in.h5", tensors, attrs=scalars)
    npz_in = write_npz(tmp_path / "in.npz", {**tensors, **scalars})
    options = GradOptions("seq", chunk_steps=chunk_steps)
    streamed = run_grad_file(h5_in, tmp_path / "streamed.h5", options)
    in_memory = run_grad_file(npz_in, tmp_path / "memory.npz", options)
    got, attrs = read_h5(tmp_path / "streamed.h5")
    with np.load(tmp_path / "memory.npz") as want:
        assert list(got) == ["x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad",
                             "b_grad"]
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)  # same chunks, same arithmetic
    assert not got["x_grad"][33:].any() and got["x_grad"][:33].any()
    assert attrs["tool"] == "lstmgrad" and attrs["seq_len_max"] == 33
    assert [t.l2_norm for t in streamed.tensors] == pytest.approx([t.l2_norm for t in in_memory.tensors])


def test_streaming_needs_memory_for_a_chunk_not_for_the_file(runner, tmp_path, monkeypatch):
    tensors = long_problem(T=200)
    total = sum(v.nbytes for v in tensors.values())
    h5_in = write_h5(tmp_path / "in.h5", tensors)
    npz_in = write_npz(tmp_path / "in.npz", tensors)
    limit = total // 4  # far less than the file's tensors, far more than a chunk of steps
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", str(limit))
    streamed = runner.invoke(main, ["seq", str(h5_in), "-o", str(tmp_path / "g.h5"), "--chunk-steps", "10", "-q"])
    assert streamed.exit_code == 0, streamed.stderr
    eager = runner.invoke(main, ["seq", str(npz_in), "-o", str(tmp_path / "g.npz")])
    assert eager.exit_code == 1 and "more than the" in eager.stderr and "limit" in eager.stderr
    monkeypatch.delenv("LSTMGRAD_MAX_TENSOR_BYTES")
    reference = runner.invoke(main, ["seq", str(npz_in), "-o", str(tmp_path / "ref.npz"), "--chunk-steps", "10", "-q"])
    assert reference.exit_code == 0
    got, _ = read_h5(tmp_path / "g.h5")
    with np.load(tmp_path / "ref.npz") as want:
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_streamed_input_to_npz_output_and_per_step(runner, tmp_path):
    inputs, expected, _ = load_case("seq_v2_larger")
    src = write_h5(tmp_path / "run.h5", inputs)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--per-step", "--chunk-steps", "5",
                                  "--json"])
    assert result.exit_code == 0, result.stderr
    with np.load(tmp_path / "g.npz") as got:
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_step_too_large_for_memory_is_refused_before_reading(runner, tmp_path, monkeypatch):
    tensors = long_problem(T=4, B=50, I=40, C=8)
    src = write_h5(tmp_path / "in.h5", tensors)
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "1000")  # one step of x is 50*40*4 = 8000 bytes
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.h5")])
    assert result.exit_code == 1 and "one time step of it" in result.stderr
    assert not (tmp_path / "g.h5").exists()


def test_nan_in_a_streamed_input_is_counted_and_strict_writes_nothing(runner, tmp_path):
    tensors = long_problem()
    tensors["h_grad"][5, 1, 2] = np.nan
    src = write_h5(tmp_path / "in.h5", tensors)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.h5"), "--strict", "--chunk-steps", "4"])
    assert result.exit_code == 1 and "NaN/Inf in inputs: h_grad (1)" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]

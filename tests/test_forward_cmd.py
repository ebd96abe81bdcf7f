"""``lstmgrad forward``: results match TensorFlow's forward ops (golden fixtures), and the file it
writes is accepted as it is by ``lstmgrad seq``/``cell`` and gives TF's gradients."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from lstmgrad_cli.cli import main
from lstmgrad_cli.io import read_metadata

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MANIFEST = {c["name"]: c for c in json.loads((FIXTURES / "manifest.json").read_text())}
INPUTS = ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")
OUTPUTS = ("i", "cs", "f", "o", "ci", "co", "h")


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


def fixture(name):
    return dict(np.load(FIXTURES / f"{name}.in.npz")), dict(np.load(FIXTURES / f"{name}.expected.npz"))


def weights_only(tmp_path, name, with_grads=True):
    """The fixture's inputs without TF's forward outputs: what a user with a checkpoint has."""
    inputs, _ = fixture(name)
    keep = [*INPUTS, "seq_len_max", "use_peephole"] + (["cs_grad", "h_grad"] if with_grads else [])
    path = tmp_path / f"{name}.weights.npz"
    np.savez(path, **{k: v for k, v in inputs.items() if k in keep})
    return path


CASES = ["seq_v2_peep", "seq_v2_nopeep", "seq_v1_peep", "seq_v1_nopeep", "seq_v2_partial", "seq_v2_clip",
         "seq_v1_clip", "seq_v2_half", "seq_v1_half", "cell_peep", "cell_nopeep", "cell_clip", "cell_half"]


@pytest.mark.parametrize("name", CASES)
def test_forward_matches_tf_and_seq_reproduces_tf_gradients(tmp_path, name):
    case = MANIFEST[name]
    kind, layout = case["kind"], case["layout"]
    src = weights_only(tmp_path, name)
    out = tmp_path / "run.npz"
    args = ["forward", kind, src, "-o", out, "--cell-clip", case["cell_clip"], "-q"]
    if kind == "seq":
        args += ["--layout", layout]
    if layout == "icfo":
        args += ["--forget-bias", case["forget_bias"]]
    result = run(*args)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""

    tf_in, tf_grads = fixture(name)
    got = dict(np.load(out))
    L = case["seq_len_max"] if kind == "seq" else None
    atol = 4e-3 if case["dtype"] == "float16" else 2e-6
    for n in OUTPUTS:
        if n not in tf_in:  # TF's cell fixture has no h (LSTMBlockCellGrad does not read it)
            continue
        assert got[n].dtype == tf_in[n].dtype
        mine, ref = (got[n][:L], tf_in[n][:L]) if kind == "seq" else (got[n], tf_in[n])
        np.testing.assert_allclose(mine.astype(float), ref.astype(float), rtol=0, atol=atol, err_msg=n)
        if kind == "seq":
            assert not got[n][L:].any(), f"{n} beyond seq_len_max must be zeros"
    for n in INPUTS:
        np.testing.assert_array_equal(got[n], tf_in[n])
    np.testing.assert_array_equal(got["cs_grad"], tf_in["cs_grad"])  # taken from the file by default

    # The written file is a complete input for the gradient command, with no options needed
    # beyond the layout, and its gradients are TF's.
    grads = tmp_path / "grads.npz"
    grad_args = [kind, out, "-o", grads, "-q"] + (["--layout", layout] if kind == "seq" else [])
    result = run(*grad_args)
    assert result.exit_code == 0, result.stderr
    mine = np.load(grads)
    rtol = 1e-2 if case["dtype"] == "float16" else 1e-5
    for n, expected in tf_grads.items():
        scale = max(float(np.abs(expected.astype(float)).max()), 1e-30)
        err = float(np.abs(mine[n].astype(float) - expected.astype(float)).max())
        assert err <= rtol * scale, (n, err, scale)


def test_default_cell_clip_follows_the_op(tmp_path):
    rng = np.random.default_rng(5)
    T, B, I, C = 6, 4, 3, 5  # noqa: E741 - TF's names
    tensors = {"x": rng.standard_normal((T, B, I)), "cs_prev": 4 * rng.standard_normal((B, C)),
               "h_prev": rng.standard_normal((B, C)), "w": 4 * rng.standard_normal((I + C, 4 * C)),
               "b": rng.standard_normal(4 * C)}
    src = tmp_path / "w.npz"
    np.savez(src, **{k: v.astype(np.float32) for k, v in tensors.items()})
    assert run("forward", "seq", src, "-o", tmp_path / "v2.npz", "-q").exit_code == 0
    assert run("forward", "seq", src, "-o", tmp_path / "v1.npz", "--layout", "icfo", "-q").exit_code == 0
    v2, v1 = np.load(tmp_path / "v2.npz"), np.load(tmp_path / "v1.npz")
    assert np.abs(v2["cs"]).max() > 3.0  # BlockLSTMV2: cell_clip 0, no clipping
    assert np.abs(v1["cs"]).max() == np.float32(3.0)  # BlockLSTM: cell_clip 3
    np.testing.assert_allclose(v1["co"], np.tanh(v1["cs"]), atol=1e-6)
    # peepholes absent and unused: written as zeros so the file is complete
    np.testing.assert_array_equal(v2["wci"], np.zeros(C, np.float32))
    assert bool(v2["use_peephole"]) is False and int(v2["seq_len_max"]) == T
    assert read_metadata(tmp_path / "v1.npz")["op"] == "BlockLSTM"
    assert read_metadata(tmp_path / "v2.npz")["layout"] == "ifco"


def test_cell_rejects_sequence_input(tmp_path):
    src = weights_only(tmp_path, "seq_v2_peep")
    result = run("forward", "cell", src, "-o", tmp_path / "c.npz")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "x must be rank 2" in result.stderr


def test_grads_choices(tmp_path):
    src = weights_only(tmp_path, "seq_v1_peep", with_grads=False)
    outs = {}
    for spec in ("zeros", "ones", "random:3", "random:3", "random:4", None):
        out = tmp_path / f"g{len(outs)}.npz"
        args = ["forward", "seq", src, "--layout", "icfo", "-o", out, "-q"] + (["--grads", spec] if spec else [])
        result = run(*args)
        assert result.exit_code == 0, result.stderr
        outs[len(outs)] = np.load(out)
    T, B, C = 4, 2, 4
    assert outs[0]["cs_grad"].shape == (T, B, C) and not outs[0]["cs_grad"].any() and not outs[0]["h_grad"].any()
    assert (outs[1]["h_grad"] == 1).all() and (outs[1]["cs_grad"] == 1).all()
    np.testing.assert_array_equal(outs[2]["h_grad"], outs[3]["h_grad"])  # seeded: reproducible
    assert not np.array_equal(outs[2]["h_grad"], outs[4]["h_grad"])
    assert not np.array_equal(outs[2]["cs_grad"], outs[2]["h_grad"])
    assert 0.5 < outs[2]["h_grad"].std() < 1.5 and outs[2]["h_grad"].dtype == np.float32
    assert (outs[5]["h_grad"] == 1).all()  # nothing in the file: ones
    result = run("forward", "seq", src, "-o", tmp_path / "x.npz", "--grads", "file")
    assert result.exit_code == 1 and "cs_grad and h_grad not in the file" in result.stderr
    result = run("forward", "seq", src, "-o", tmp_path / "x.npz", "--grads", "ones:3")
    assert result.exit_code == 2 and "random[:SEED]" in result.stderr


def test_hdf5_output_records_the_op_and_json(tmp_path):
    src = weights_only(tmp_path, "seq_v1_peep")
    out = tmp_path / "run.h5"
    result = run("forward", "seq", src, "--layout", "icfo", "--forget-bias", "1", "--cell-clip", "-1", "-o", out,
                 "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)["result"]
    assert doc["op"] == "BlockLSTM" and doc["layout"] == "icfo" and doc["forget_bias"] == 1.0
    assert doc["next_command"] == f"lstmgrad seq --layout icfo {out}"
    meta = read_metadata(out)
    assert meta["op"] == "BlockLSTM" and meta["layout"] == "icfo"
    with h5py.File(out, "r") as fh:
        assert list(fh.attrs) == ["__lstmgrad__"]  # provenance in one place, never read as an input
        assert fh["h"].shape == (4, 2, 4) and fh["seq_len_max"][()] == 4
        tf_in, _ = fixture("seq_v1_peep")
        np.testing.assert_allclose(fh["h"][()], tf_in["h"], atol=2e-6)


def test_refuses_to_overwrite_and_rejects_forget_bias_for_v2(tmp_path):
    src = weights_only(tmp_path, "seq_v2_peep")
    out = tmp_path / "run.npz"
    out.write_bytes(b"keep me")
    result = run("forward", "seq", src, "-o", out)
    assert result.exit_code == 1 and "already exists" in result.stderr
    assert out.read_bytes() == b"keep me"
    assert run("forward", "seq", src, "-o", out, "--force", "-q").exit_code == 0
    result = run("forward", "seq", src, "-o", tmp_path / "b.npz", "--forget-bias", "1")
    assert result.exit_code == 1 and "BlockLSTMV2 has no forget_bias" in result.stderr
    assert not (tmp_path / "b.npz").exists()


def test_missing_inputs_are_named(tmp_path):
    src = tmp_path / "partial.npz"
    np.savez(src, x=np.zeros((2, 1, 3), np.float32), cs_prev=np.zeros((1, 2), np.float32))
    result = run("forward", "seq", src, "-o", tmp_path / "o.npz")
    assert result.exit_code == 1
    assert "missing tensors h_prev, w, b" in result.stderr


def test_table_output(tmp_path):
    src = weights_only(tmp_path, "cell_peep")
    result = run("forward", "cell", src, "-o", tmp_path / "o.npz", "--cell-clip", "-1")
    assert result.exit_code == 0, result.stderr
    assert "LSTMBlockCell (layout icfo)" in result.stdout and "next: lstmgrad cell" in result.stdout


@pytest.mark.parametrize("name", ["seq_v2_peep", "seq_v1_clip", "cell_peep", "seq_v2_half"])
def test_forward_on_a_gpu_backend_computes_where_it_computes_with_the_same_bits(tmp_path, name):
    """The cupy backend built for the host (tests/cuda_host.py: numpy as its device): the inputs go through the
    backend's own copy to its device, once each, and the result is the host's bit for bit.  (On a real GPU, make
    gpu-check runs this file with LSTMGRAD_TEST_BACKEND=cupy: the forward computed by cupy against TensorFlow's.)"""
    from cuda_host import cupy_backend

    from lstmgrad_cli.operations.forward import ForwardOptions, run_forward_file

    kind = "cell" if name.startswith("cell") else "seq"
    layout = "icfo" if "v1" in name or kind == "cell" else "ifco"
    source = weights_only(tmp_path, name)
    copies = []
    on_device = run_forward_file(source, tmp_path / "device.npz", ForwardOptions(kind, layout),
                                 backend=cupy_backend(copies=copies))
    on_host = run_forward_file(source, tmp_path / "host.npz", ForwardOptions(kind, layout, backend="numpy"))
    assert copies == ["in"] * len(INPUTS)
    assert (on_device.backend, on_host.backend) == ("cupy", "numpy")
    with np.load(tmp_path / "device.npz") as got, np.load(tmp_path / "host.npz") as want:
        for key in OUTPUTS:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert read_metadata(tmp_path / "device.npz")["backend"] == "cupy"


def test_forward_names_where_it_computed_and_refuses_an_unusable_backend_in_one_line(tmp_path):
    source = weights_only(tmp_path, "seq_v2_peep")
    result = run("forward", "seq", source, "-o", tmp_path / "numba.npz", "--backend", "numba", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["result"]
    assert doc["backend"] == "numpy" and doc["backend_version"] == np.__version__  # (the host backends' forward)
    result = run("forward", "seq", source, "-o", tmp_path / "gpu.npz", "--backend", "cupy")
    if result.exit_code == 0:  # a machine with a GPU
        assert read_metadata(tmp_path / "gpu.npz")["backend"] == "cupy"
        return
    assert result.exit_code == 1 and result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1
    assert "cupy" in result.stderr and not (tmp_path / "gpu.npz").exists()

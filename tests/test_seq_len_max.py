"""A seq_len_max the input does not give: T, unless the stored activations say TF stopped before T (it zeroes cs
and h from step seq_len_max on and leaves i, f, o, ci, co there uninitialised: docs/semantics.md), as in a
TF debug dump whose seq_len_max was a Python int, never recorded."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES

from lstmgrad_cli.cli import main

DUMPS = FIXTURES / "tfdbg"


def npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files if not k.startswith("__")}


def run_json(runner, path, out, *flags):
    result = runner.invoke(main, ["seq", str(path), "-o", str(out), "--json", *flags])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["results"][0]


def assert_close(got: dict, expected: dict):
    for name, want in expected.items():
        name = name.split("/")[-1]
        scale = float(np.max(np.abs(want), initial=0.0))
        assert float(np.max(np.abs(got[name] - want), initial=0.0)) <= 1e-7 + 2e-6 * scale, name


@pytest.fixture
def partial():
    """seq_v2_partial (TF: seq_len_max 3 of T=6) without its seq_len_max."""
    inputs = npz(FIXTURES / "seq_v2_partial.in.npz")
    assert int(inputs.pop("seq_len_max")) == 3
    return inputs


@pytest.mark.parametrize("garbage", [False, True])
def test_found_where_cs_and_h_stop(runner, tmp_path, partial, garbage):
    if garbage:  # what TF's uninitialised memory may hold past seq_len_max
        rng = np.random.default_rng(0)
        for name in ("i", "f", "o", "ci", "co"):
            partial[name][3:] = rng.normal(0.0, 50.0, partial[name][3:].shape)
    np.savez(tmp_path / "in.npz", **partial)
    doc = run_json(runner, tmp_path / "in.npz", tmp_path / "g.npz", "--strict")
    assert doc["seq_len_max"] == 3 and doc["sources"]["seq_len_max"] == "activations"
    assert any("seq_len_max 3: not in the file; cs and h are zero from step 3 on" in n for n in doc["notes"])
    assert_close(npz(tmp_path / "g.npz"), npz(FIXTURES / "seq_v2_partial.expected.npz"))


def test_inspect_finds_it_too(runner, tmp_path, partial):
    np.savez(tmp_path / "in.npz", **partial)
    result = runner.invoke(main, ["inspect", str(tmp_path / "in.npz"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["result"]
    assert doc["seq_len_max"] == 3 and doc["layout"] == "ifco" and not doc["problems"]


def test_a_flag_still_decides(runner, tmp_path, partial):
    np.savez(tmp_path / "in.npz", **partial)
    doc = run_json(runner, tmp_path / "in.npz", tmp_path / "g.npz", "--seq-len-max", "6")
    assert doc["seq_len_max"] == 6 and doc["sources"]["seq_len_max"] == "flag"


def test_t_without_zero_steps(runner, tmp_path):
    inputs = npz(FIXTURES / "seq_v2_peep.in.npz")
    inputs.pop("seq_len_max", None)
    np.savez(tmp_path / "in.npz", **inputs)
    doc = run_json(runner, tmp_path / "in.npz", tmp_path / "g.npz")
    assert doc["seq_len_max"] == inputs["x"].shape[0] and doc["sources"]["seq_len_max"] == "default"


def test_t_where_the_zeros_were_computed(runner, tmp_path):
    """Zero weights and states: cs and h are zero at every step because the cell computes zeros, and the stored
    gates (0.5) fit all T steps, so T stays (seq_len_max 0 would give a zero gradient)."""
    T, B, I, C = 4, 2, 3, 2
    rng = np.random.default_rng(1)
    f32 = np.float32
    half = np.full((T, B, C), 0.5, f32)
    zeros = np.zeros((T, B, C), f32)
    inputs = dict(x=rng.normal(size=(T, B, I)).astype(f32), cs_prev=np.zeros((B, C), f32),
                  h_prev=np.zeros((B, C), f32), w=np.zeros((I + C, 4 * C), f32), b=np.zeros(4 * C, f32),
                  i=half, cs=zeros, f=half, o=half, ci=zeros, co=zeros, h=zeros,
                  cs_grad=rng.normal(size=(T, B, C)).astype(f32), h_grad=rng.normal(size=(T, B, C)).astype(f32))
    np.savez(tmp_path / "in.npz", **inputs)
    doc = run_json(runner, tmp_path / "in.npz", tmp_path / "g.npz")
    assert doc["seq_len_max"] == T and doc["sources"]["seq_len_max"] == "default"
    assert np.any(npz(tmp_path / "g.npz")["w_grad"])


def test_a_dump_that_never_recorded_it(runner, tmp_path):
    """TensorFlow's own dump: seq_len_max=2 of T=4 was a constant no recorded op made."""
    doc = run_json(runner, DUMPS / "slm_unrecorded", tmp_path / "g.npz", "--strict")
    assert doc["seq_len_max"] == 2 and doc["sources"]["seq_len_max"] == "activations"
    assert_close(npz(tmp_path / "g.npz"), npz(DUMPS / "slm_unrecorded.expected.npz"))
    result = runner.invoke(main, ["check", str(DUMPS / "slm_unrecorded"), "--json"])  # against TF's own gradient
    assert result.exit_code == 0, result.output
    assert [r["passed"] for r in json.loads(result.stdout)["results"]] == [True]


def test_inspect_of_that_dump_agrees(runner):
    result = runner.invoke(main, ["inspect", str(DUMPS / "slm_unrecorded"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)["result"]
    assert not doc["errors"] and any("no recorded value for seq_len_max" in w for w in doc["warnings"])
    grad = next(e for e in doc["executions"] if e["op_type"] == "BlockLSTMGradV2")
    assert grad["use_peephole"] is True and grad["peephole_note"] == "inferred from the activations"

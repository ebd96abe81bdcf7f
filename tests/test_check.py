"""``lstmgrad check``: comparisons against TensorFlow's gradients, and the explanation of each known
discrepancy, with references built from TF's own outputs (fixtures/*.expected.npz, *.tape.npz)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from lstmgrad_cli.cli import main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MANIFEST = {c["name"]: c for c in json.loads((FIXTURES / "manifest.json").read_text())}


def fx(name, part="in"):
    return FIXTURES / f"{name}.{part}.npz"


def check(*args):
    result = CliRunner().invoke(main, ["check", *[str(a) for a in args]])
    assert result.exit_code in (0, 1), (result.exit_code, result.stderr, result.output)
    return result


def check_json(*args):
    result = check(*args, "--json")
    return result.exit_code, json.loads(result.stdout)["result"]


def reproducing(doc):
    return [v for v in doc["variants"] if v["reproduces"]]


@pytest.mark.parametrize("name", ["seq_v2_peep", "seq_v1_nopeep", "seq_v2_partial", "seq_v2_clip", "seq_v2_half",
                                  "seq_v2_zero", "cell_peep", "cell_half"])
def test_tf_gradients_pass(name):
    case = MANIFEST[name]
    code, doc = check_json(fx(name), "--reference", fx(name, "expected"), "--layout", case["layout"])
    assert code == 0
    assert doc["passed"] and doc["kind"] == case["kind"]  # seq/cell told from the rank of x
    expected_names = set(np.load(fx(name, "expected")).files)
    assert {c["name"] for c in doc["comparisons"]} == expected_names
    assert doc["variants"] == [] and doc["explanations"] == []
    for c in doc["comparisons"]:
        assert c["max_abs_error"] <= c["tolerance"]


@pytest.mark.parametrize("name", ["seq_v2_peep", "seq_v2_nopeep"])
def test_tape_gradient_of_blocklstmv2_is_explained(name):
    """TF's GradientTape gradient of BlockLSTMV2 uses the ICFO kernel (docs/semantics.md)."""
    code, doc = check_json(fx(name), "--reference", fx(name, "tape"))
    assert code == 1 and not doc["passed"]
    failed = {c["name"] for c in doc["comparisons"] if not c["passed"]}
    assert {"x_grad", "w_grad", "b_grad", "h_prev_grad"} <= failed
    best = reproducing(doc)
    assert best and best[0]["causes"] == ["layout"] and best[0]["changes"] == {"layout": "icfo"}
    assert "tf.GradientTape" in doc["explanations"][0] and "--layout icfo" in doc["explanations"][0]
    text = check(fx(name), "--reference", fx(name, "tape")).stdout
    text = " ".join(text.split())
    assert "Why they differ" in text and "BlockLSTMGrad, TensorFlow's V1 kernel with the ICFO gate layout" in text
    assert "activations that BlockLSTMV2 made (they fit the IFCO layout only)" in text


def test_tape_gradient_of_blocklstm_v1_is_right():
    code, doc = check_json(fx("seq_v1_peep"), "-r", fx("seq_v1_peep", "tape"), "--layout", "icfo")
    assert code == 0 and doc["op"] == "BlockLSTMGrad"


@pytest.mark.parametrize(("name", "flag", "expected"), [("seq_v2_peep", "--no-peephole", True),
                                                          ("seq_v2_nopeep", "--peephole", False),
                                                          ("cell_peep", "--no-peephole", True)])
def test_peephole_mismatch_is_explained(name, flag, expected):
    code, doc = check_json(fx(name), "-r", fx(name, "expected"), flag)
    assert code == 1
    best = reproducing(doc)
    assert best[0]["causes"] == ["peephole"] and best[0]["changes"] == {"use_peephole": expected}
    assert ("--peephole" if expected else "--no-peephole") in doc["explanations"][0]


@pytest.mark.parametrize("override", ["0", "1", "2"])
def test_seq_len_max_mismatch_is_explained(override):
    """TF ran seq_v2_partial with seq_len_max=3 of T=6.  (A larger override changes nothing: the file
    stores zero activations beyond 3, and zero gates pass no gradient.)"""
    code, doc = check_json(fx("seq_v2_partial"), "-r", fx("seq_v2_partial", "expected"), "--seq-len-max", override)
    assert code == 1 and doc["sources"]["seq_len_max"] == "flag"
    best = reproducing(doc)
    assert [v["changes"] for v in best] == [{"seq_len_max": 3}]
    assert "--seq-len-max 3" in doc["explanations"][0]


def _double_counted(name, tmp_path):
    """TF's CPU LSTMBlockCellGrad result turned into what the GPU kernel returns (section 7 row 2)."""
    tf_in, ref = np.load(fx(name)), dict(np.load(fx(name, "expected")))
    C = tf_in["wci"].shape[0]
    di, df = ref["dicfo"][:, :C], ref["dicfo"][:, 2 * C:3 * C]  # ICFO
    # CPU: dcs*f + (di*wci + df*wcf); GPU: dcs*f + 2*(di*wci + df*wcf), i.e. the term once more.
    ref["cs_prev_grad"] = ref["cs_prev_grad"] + (di * tf_in["wci"] + df * tf_in["wcf"])
    path = tmp_path / f"{name}.gpu.npz"
    np.savez(path, **ref)
    return path


@pytest.mark.parametrize("name", ["cell_peep", "cell_clip"])
def test_gpu_peephole_double_count_is_explained(tmp_path, name):
    ref = _double_counted(name, tmp_path)
    code, doc = check_json(fx(name), "-r", ref)
    assert code == 1
    assert [c["name"] for c in doc["comparisons"] if not c["passed"]] == ["cs_prev_grad"]
    best = reproducing(doc)
    assert best[0]["causes"] == ["gpu_double_count"]
    assert "#34171" in doc["explanations"][0]


def test_half_op_by_op_is_explained(tmp_path):
    """TF CPU rounds every elementwise step to half; LSTMBlockCellGrad's own outputs show it exactly."""
    expected = np.load(fx("cell_half", "expected"))
    ref = tmp_path / "tf_cell_op.npz"
    np.savez(ref, **{n: expected[n] for n in ("cs_prev_grad", "dicfo", "wci_grad", "wcf_grad", "wco_grad")})
    code, doc = check_json(fx("cell_half"), "-r", ref, "--rtol", "1e-4", "--atol", "0")
    assert code == 1 and doc["compute_dtype"] == "float32"
    assert reproducing(doc)[0]["causes"] == ["half_op_by_op"]
    assert "--compute-dtype float16" in doc["explanations"][0]
    code, doc = check_json(fx("cell_half"), "-r", ref, "--rtol", "0", "--atol", "0", "--compute-dtype", "float16")
    assert code == 0  # bit-exact with TF's half kernel
    assert all(c["ulps"] == 0 for c in doc["comparisons"])


def test_two_causes_at_once():
    code, doc = check_json(fx("seq_v2_peep"), "-r", fx("seq_v2_peep", "tape"), "--no-peephole")
    assert code == 1
    best = reproducing(doc)
    assert sorted(best[0]["causes"]) == ["layout", "peephole"]
    assert best[0]["changes"] == {"layout": "icfo", "use_peephole": True}


def test_unexplained_difference_says_so(tmp_path):
    ref = dict(np.load(fx("seq_v2_peep", "expected")))
    ref["w_grad"] = ref["w_grad"] + np.float32(0.01) * np.sign(ref["w_grad"])
    path = tmp_path / "ref.npz"
    np.savez(path, **ref)
    code, doc = check_json(fx("seq_v2_peep"), "-r", path)
    assert code == 1 and reproducing(doc) == [] and doc["explanations"] == []
    w = next(c for c in doc["comparisons"] if c["name"] == "w_grad")
    assert not w["passed"] and w["max_abs_error"] == pytest.approx(0.01, rel=1e-3)
    assert all(c["passed"] for c in doc["comparisons"] if c["name"] != "w_grad")
    text = " ".join(check(fx("seq_v2_peep"), "-r", path).stdout.split())
    assert "No known cause reproduces the reference" in text and "FAIL" in text


def test_wrong_problem_shapes(tmp_path):
    code, doc = check_json(fx("seq_v2_partial"), "-r", fx("seq_v2_peep", "expected"))
    assert code == 1 and doc["variants"] == []
    assert all("in the reference" in c["note"] for c in doc["comparisons"])


def test_camelcase_hdf5_reference_in_a_group_and_tolerance_flags(tmp_path):
    expected = np.load(fx("seq_v2_peep", "expected"))
    path = tmp_path / "ref.h5"
    camel = {"x_grad": "xGrad", "cs_prev_grad": "csPrevGrad", "h_prev_grad": "hPrevGrad", "w_grad": "wGrad"}
    with h5py.File(path, "w") as fh:
        grp = fh.create_group("grads")
        for name in camel:
            grp[camel[name]] = expected[name]
        grp["note"] = np.arange(3)
    code, doc = check_json(fx("seq_v2_peep"), "-r", path, "--reference-group", "grads")
    assert code == 0
    assert [c["name"] for c in doc["comparisons"]] == list(camel)
    assert "b_grad" in doc["not_in_reference"] and doc["other_reference_keys"] == ["note"]
    # tolerance 0: the GEMM-fed w_grad differs from TF's by an ulp or so, and the table says so
    code, doc = check_json(fx("seq_v2_peep"), "-r", path, "--reference-group", "grads", "--rtol", "0", "--atol", "0")
    w = next(c for c in doc["comparisons"] if c["name"] == "w_grad")
    assert w["passed"] == (w["max_abs_error"] == 0.0) and doc["rtol"] == 0.0


def test_gradcheck_on_tf_fixture_passes():
    code, doc = check_json(fx("seq_v1_clip"), "-r", fx("seq_v1_clip", "expected"), "--layout", "icfo", "--gradcheck")
    assert code == 0
    fwd = doc["forward"]
    assert fwd["consistent"] and fwd["forget_bias"] == 1.0 and fwd["cell_clip"] == pytest.approx(0.5)
    assert doc["gradcheck"]["ok"] and len(doc["gradcheck"]["entries"]) >= 20
    text = " ".join(check(fx("cell_peep"), "--gradcheck").stdout.split())
    assert "consistent with x, h_prev, w, b" in text and "PASS" in text


def test_gradcheck_finds_activations_from_another_checkpoint(tmp_path):
    tensors = dict(np.load(fx("seq_v2_peep")))
    rng = np.random.default_rng(0)
    tensors["w"] = tensors["w"] + np.float32(0.05) * rng.standard_normal(tensors["w"].shape).astype(np.float32)
    path = tmp_path / "other_checkpoint.npz"
    np.savez(path, **tensors)
    code, doc = check_json(path, "--gradcheck")
    assert code == 1
    bad = {t["name"] for t in doc["forward"]["tensors"] if t["bad_entries"]}
    assert {"i", "o", "ci"} <= bad and "co" not in bad and "h" not in bad  # gates, not the cell maths
    assert doc["forward_alternative"] is None
    assert doc["gradcheck"]["ok"]  # the gradient of the weights themselves is right
    assert max(doc["gradcheck"]["stored_vs_recomputed"].values()) > 1e-3
    text = " ".join(check(path, "--gradcheck").stdout.split())
    assert "NOT consistent" in text and "different checkpoint" in text


def test_gradcheck_finds_activations_from_another_step(tmp_path):
    tensors = dict(np.load(fx("seq_v2_larger")))
    for name in ("i", "f", "o", "ci", "cs", "co", "h"):
        tensors[name] = tensors[name].copy()
        tensors[name][7:] = np.roll(tensors[name][7:], 1, axis=0)  # off by one from step 7 on
    path = tmp_path / "shifted.npz"
    np.savez(path, **tensors)
    code, doc = check_json(path, "--gradcheck")
    assert code == 1
    firsts = {t["first_bad_step"] for t in doc["forward"]["tensors"] if t["bad_entries"]}
    assert min(firsts) == 7


def test_gradcheck_suggests_the_layout_that_fits():
    code, doc = check_json(fx("seq_v1_peep"), "--gradcheck", "--layout", "ifco")  # BlockLSTM tensors read as V2
    assert code == 1 and doc["warnings"] and "fit layout icfo (BlockLSTM)" in doc["warnings"][0]
    alt = doc["forward_alternative"]
    assert alt["layout"] == "icfo" and alt["use_peephole"] is True and alt["consistent"]


def test_usage_errors():
    result = CliRunner().invoke(main, ["check", str(fx("seq_v2_peep"))])
    assert result.exit_code == 2 and "--reference" in result.stderr
    result = CliRunner().invoke(main, ["check", str(fx("seq_v2_peep")), "-r", "/nonexistent.npz"])
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")


def test_identical_results_with_nan_pass(tmp_path):
    import lstmgrad_cli as lg

    with np.load(fx("seq_v2_peep")) as data:
        inputs = dict(data)
    inputs["h_grad"] = inputs["h_grad"].copy()
    inputs["h_grad"][4, 0, 0] = np.nan
    src = tmp_path / "nan.npz"
    np.savez(src, **inputs)
    ref = tmp_path / "ref.npz"
    np.savez(ref, **lg.block_lstm_grad_v2(**inputs)._asdict())
    result = CliRunner().invoke(main, ["check", str(src), "-r", str(ref)])
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "NaN/Inf differ" not in result.stdout

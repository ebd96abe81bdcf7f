"""gradcheck.py: the float64 forward against TF's forward ops, layout/peephole/forget_bias/clip
inference on TF's fixtures, and finite differences that catch a wrong gradient."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lstmgrad_cli.analysis import gradcheck
from lstmgrad_cli.backends import get_backend
from lstmgrad_cli.ops.forward import block_lstm_forward
from lstmgrad_cli.spec import ACTIVATIONS, FORWARD_INPUTS

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CASES = [c for c in json.loads((FIXTURES / "manifest.json").read_text()) if c["seq_len_max"] != 0]


def load(case):
    d = dict(np.load(FIXTURES / f"{case['name']}.in.npz"))
    d.pop("use_peephole")
    d.pop("seq_len_max", None)
    return d, (case["seq_len_max"] if case["kind"] == "seq" else 1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_fit_recovers_tf_parameters(case):
    arrays, L = load(case)
    fits = gradcheck.forward_fits(arrays, case["kind"], seq_len_max=L)
    best = fits[0]
    assert best.consistent and (best.layout, best.use_peephole) == (case["layout"], case["use_peephole"])
    assert not any(f.consistent for f in fits[1:] if f.layout != case["layout"])
    assert best.forget_bias == pytest.approx(case["forget_bias"], abs=1e-2)
    assert best.cell_clip == pytest.approx(max(case["cell_clip"], 0) if case["clipped_fraction"] else 0.0)


@pytest.mark.parametrize("name", ["seq_v2_clip", "seq_v1_peep", "seq_v2_partial", "cell_clip"])
def test_the_float64_forward_matches_tf(name):
    """The one forward pass (forward.py), in float64 as the finite differences run it, with its clip offsets."""
    case = next(c for c in CASES if c["name"] == name)
    arrays, L = load(case)
    a = {k: np.asarray(v, np.float64) for k, v in gradcheck.as_sequence(arrays, case["kind"]).items()}
    offsets = np.zeros_like(a["cs"])
    outs = block_lstm_forward(L, **{n: a[n] for n in FORWARD_INPUTS}, layout=case["layout"],
                              use_peephole=case["use_peephole"], forget_bias=case["forget_bias"],
                              cell_clip=case["cell_clip"], compute_dtype=np.float64, offsets_out=offsets)
    for n, out in zip(ACTIVATIONS, outs, strict=True):
        np.testing.assert_allclose(out[:L], a[n][:L], atol=1e-6, err_msg=n)
    assert (np.abs(offsets) > 0).any() == bool(case["clipped_fraction"])
    # with the offsets held, cs is the unclipped sum plus them: the same outputs (the straight-through function)
    held = block_lstm_forward(L, **{n: a[n] for n in FORWARD_INPUTS}, layout=case["layout"],
                              use_peephole=case["use_peephole"], forget_bias=case["forget_bias"],
                              cell_clip=case["cell_clip"], compute_dtype=np.float64, clip_offsets=offsets)
    for n, out, again in zip(ACTIVATIONS, outs, held, strict=True):
        np.testing.assert_allclose(again, out, rtol=0, atol=1e-12, err_msg=n)


@pytest.mark.parametrize("name", ["seq_v2_clip", "seq_v1_nopeep", "cell_peep"])
def test_finite_differences_agree_with_the_op(name):
    case = next(c for c in CASES if c["name"] == name)
    arrays, L = load(case)
    result = gradcheck.finite_difference_check(
        arrays, case["kind"], layout=case["layout"], use_peephole=case["use_peephole"], seq_len_max=L,
        forget_bias=case["forget_bias"], cell_clip=case["cell_clip"], samples=16, seed=1)
    assert result.ok and len(result.entries) >= 16 and result.max_rel_error < 1e-5
    assert {e.tensor for e in result.entries} >= {"x", "w", "b", "h_prev", "cs_prev"}
    assert any(abs(e.numeric) > 1e-3 for e in result.entries)  # not a trivially zero comparison


class SkewedBackend:
    """numpy's gradient with w_grad scaled by 1.001: a subtle bug the check must catch."""

    name, version = "skewed", "0"

    def block_lstm_grad(self, tensors, **kwargs):
        out = get_backend("numpy").block_lstm_grad(tensors, **kwargs)
        return out._replace(w_grad=out.w_grad * 1.001)


def test_finite_differences_catch_a_wrong_gradient():
    case = next(c for c in CASES if c["name"] == "seq_v2_peep")
    arrays, L = load(case)
    result = gradcheck.finite_difference_check(
        arrays, "seq", layout="ifco", use_peephole=True, seq_len_max=L, forget_bias=0.0, cell_clip=0.0,
        samples=16, backend=SkewedBackend())
    assert not result.ok
    assert {e.tensor for e in result.entries if not e.ok} == {"w"}


def test_a_corrupted_step_is_located():
    case = next(c for c in CASES if c["name"] == "seq_v2_larger")
    arrays, L = load(case)
    arrays["o"] = arrays["o"].copy()
    arrays["o"][9, 2, 3] = 1 - arrays["o"][9, 2, 3]
    fit = gradcheck.forward_consistency(arrays, "seq", layout="ifco", use_peephole=True, seq_len_max=L)
    bad = fit.inconsistent()
    assert [(t.name, t.bad_entries, t.first_bad_step) for t in bad if t.name == "o"] == [("o", 1, 9)]
    assert {t.name for t in bad} <= {"o", "h"}  # h = o * co no longer holds there either

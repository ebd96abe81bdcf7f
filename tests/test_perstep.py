"""Gradients through time: --per-step norms, their description, the chart and the figure."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES, load_case, write_npz

import lstmgrad_cli as lg
from lstmgrad_cli.analysis.perstep import sparkline
from lstmgrad_cli.cli import main


def seq_args(name="seq_v2_larger"):
    args = dict(load_case(name)[0])
    args["use_peephole"] = bool(args["use_peephole"])
    return args


def test_carried_norms_equal_the_gradient_of_the_remaining_sequence(runner, tmp_path):
    # What step t carries back into h[t-1] and cs[t-1] is exactly h_prev_grad / cs_prev_grad of the
    # op run on steps t.. alone, starting from the stored state of step t-1: an independent check.
    args = seq_args()
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_larger.in.npz"), "-o", str(out), "--per-step",
                                  "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)["results"][0]["per_step"]
    L = int(args["seq_len_max"])
    assert report["steps"] == L
    for t in (0, 3, L - 1):
        tail = dict(args, seq_len_max=L - t, cs_prev=args["cs"][t - 1] if t else args["cs_prev"],
                    h_prev=args["h"][t - 1] if t else args["h_prev"],
                    **{k: args[k][t:] for k in ("x", "i", "cs", "f", "o", "ci", "co", "h", "cs_grad", "h_grad")})
        sub = lg.block_lstm_grad_v2(**tail)
        assert report["norms"]["h_prev_grad"][t] == pytest.approx(np.linalg.norm(sub.h_prev_grad), rel=1e-5)
        assert report["norms"]["cs_prev_grad"][t] == pytest.approx(np.linalg.norm(sub.cs_prev_grad), rel=1e-5)
    with np.load(out) as g:
        want = [np.linalg.norm(g["x_grad"][t].astype(np.float64)) for t in range(L)]
    np.testing.assert_allclose(report["norms"]["x_grad"], want, rtol=1e-6)
    factors = report["growth_factors"]["h_prev_grad"]
    hn = report["norms"]["h_prev_grad"]
    assert factors[2] == pytest.approx(hn[2] / hn[3])


def test_vanishing_gradient_is_named_with_its_worst_step(runner, tmp_path):
    args = dict(load_case("seq_v2_larger")[0])
    args["cs_grad"] = np.zeros_like(args["cs_grad"])
    args["h_grad"] = np.zeros_like(args["h_grad"])
    args["h_grad"][-1] = 1.0  # only the last output has a loss: its gradient fades going back
    src = write_npz(tmp_path / "vanish.npz", args)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--per-step"],
                           env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "last-step gradient: vanishes going back in time: a unit gradient at h[11] is x" in text
    assert "carried h gradient (every step's own h_grad, cs_grad mixed in): vanishes going back in time" in text
    assert "largest decay: x" in text and "gradients through time (12 steps" in text
    assert "|x_grad[t]|" in text  # not eaten as markup
    assert any(ch in result.stdout for ch in "▁▂▃▄▅▆▇█")


def test_the_verdict_comes_from_a_gradient_at_the_last_step_only(runner, tmp_path):
    """With a loss on every output the carried norms stay level although a late signal fades: the verdict
    must come from a unit gradient injected at h[L-1] alone, which is the op's gradient of the steps from t
    on with that one output gradient (checked here against the op run on those steps)."""
    args = seq_args()
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_larger.in.npz"), "-o", str(tmp_path / "g.npz"),
                                  "--per-step", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)["results"][0]["per_step"]
    L = report["steps"]
    carried = report["norms"]["h_prev_grad"]
    assert 0.5 < carried[0] / carried[-1] < 2  # level: every step adds its own h_grad
    B, C = args["h_prev"].shape
    unit = np.random.default_rng(0).standard_normal((B, C))
    unit = (unit / np.linalg.norm(unit)).astype(np.float32)
    for t in (0, 5, L - 1):
        tail = dict(args, seq_len_max=L - t, cs_prev=args["cs"][t - 1] if t else args["cs_prev"],
                    h_prev=args["h"][t - 1] if t else args["h_prev"],
                    **{k: args[k][t:] for k in ("x", "i", "cs", "f", "o", "ci", "co", "h")})
        tail["cs_grad"] = np.zeros_like(args["cs_grad"][t:])
        tail["h_grad"] = np.zeros_like(args["h_grad"][t:])
        tail["h_grad"][L - 1 - t] = unit
        sub = lg.block_lstm_grad_v2(**tail)
        want = np.hypot(np.linalg.norm(sub.h_prev_grad), np.linalg.norm(sub.cs_prev_grad))
        assert report["norms"]["last_step"][t] == pytest.approx(want, rel=1e-5)
    assert report["norms"]["last_step"][0] < 0.01 * report["norms"]["last_step"][-1]
    assert report["summary"][0].startswith("last-step gradient: vanishes going back in time")


def test_sparkline_is_log_scaled_and_bucketed():
    line = sparkline([1, 10, 100, 1000, 10])
    levels = ["▁▂▃▄▅▆▇█".index(ch) for ch in line]
    assert levels[0] == 0 and levels[3] == 7 and levels[0] < levels[1] < levels[2] < levels[3]
    assert levels[4] == levels[1]  # equal values, equal height
    assert len(sparkline(list(range(1, 1001)), width=50)) == 50
    assert sparkline([0.0, 0.0]) == "  "


def test_no_steps_is_fine(runner, tmp_path):
    args = dict(load_case("seq_v2_zero")[0])
    src = write_npz(tmp_path / "zero.npz", args)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--per-step", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)["results"][0]["per_step"]
    assert report["steps"] == 0 and report["norms"]["x_grad"] == []


def test_plot_writes_a_figure(runner, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "steps.png"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_larger.in.npz"), "-o", str(tmp_path / "g.npz"),
                                  "--plot", str(png), "-q"])
    assert result.exit_code == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_plot_takes_one_input(runner, tmp_path):
    pytest.importorskip("matplotlib")
    result = runner.invoke(main, ["seq", "a.npz", "b.npz", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2 and "--plot takes a single INPUT" in result.stderr


@pytest.mark.parametrize("name, code, fragment", [
    ("steps.xyz", 2, "Invalid value for '--plot': "),  # a format matplotlib cannot write: a usage error
    ("steps.txt", 2, "unknown figure format '.txt'; use one of "),
    ("missing/steps.png", 1, "does not exist"),  # a missing directory, as with -o: the run's own error
])
def test_a_bad_plot_path_is_refused_before_anything_is_written(runner, tmp_path, name, code, fragment):
    pytest.importorskip("matplotlib")
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_larger.in.npz"), "-o", str(out), "--plot",
                                  str(tmp_path / name)])
    assert result.exit_code == code and fragment in result.stderr and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and fragment in errors[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_plot_never_replaces_an_existing_file_without_force(runner, tmp_path):
    pytest.importorskip("matplotlib")
    precious = tmp_path / "important.png"
    precious.write_bytes((FIXTURES / "seq_v2_peep.in.npz").read_bytes())
    before = precious.read_bytes()
    out = tmp_path / "g.npz"
    args = ["seq", str(FIXTURES / "seq_v2_larger.in.npz"), "-o", str(out), "--plot", str(precious)]
    result = runner.invoke(main, args)
    assert result.exit_code == 1
    assert result.stderr == f"Error: {precious}: already exists; use --force to replace it with the figure\n"
    assert precious.read_bytes() == before
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["important.png"]  # refused up front
    forced = runner.invoke(main, [*args, "--force", "-q"])
    assert forced.exit_code == 0, forced.stderr
    assert precious.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.exists()


def test_plot_never_writes_over_an_input_even_with_force(runner, tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "run.png"  # an input is read whatever its name
    src.write_bytes((FIXTURES / "seq_v2_peep.in.npz").read_bytes())
    before = src.read_bytes()
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--plot", str(src), "--force"])
    assert result.exit_code == 1
    assert result.stderr == f"Error: {src}: is a file this run reads or writes; name another figure file\n"
    assert src.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["run.png"]


def test_plot_with_inputs_that_give_several_files_is_a_usage_error(runner, tmp_path):
    pytest.importorskip("matplotlib")
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("seq_v2_peep", "seq_v2_nopeep", "seq_v2_larger"):
        write_npz(runs / f"{name}.npz", load_case(name)[0])
    plot, out_dir = tmp_path / "s.png", tmp_path / "grads"
    for given, fragment in ((str(runs), f"but {runs} gives 3 files"),
                            (str(runs / "*.npz"), f"but {runs / '*.npz'} gives 3 files"),
                            (str(FIXTURES / "tfdbg" / "loop3"),
                             f"but {FIXTURES / 'tfdbg' / 'loop3'} holds 3 executions to run; choose one with --group")):
        result = runner.invoke(main, ["seq", given, "--out-dir", str(out_dir), "--plot", str(plot)])
        assert result.exit_code == 2, (given, result.stderr)
        assert f"Error: --plot draws the figure of a single run, {fragment}" in result.stderr
        assert not plot.exists() and not out_dir.exists()  # refused before any work
        assert sorted(p.name for p in runs.iterdir()) == ["seq_v2_larger.npz", "seq_v2_nopeep.npz", "seq_v2_peep.npz"]
    one = tmp_path / "one"
    one.mkdir()
    write_npz(one / "seq_v2_larger.npz", load_case("seq_v2_larger")[0])
    single = runner.invoke(main, ["seq", str(one), "--out-dir", str(out_dir), "--plot", str(plot), "-q"])
    assert single.exit_code == 0, single.stderr  # a directory of one input is one run
    assert plot.read_bytes()[:4] == b"\x89PNG" and (out_dir / "seq_v2_larger.grads.npz").exists()

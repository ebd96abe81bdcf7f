"""seq, check, inspect and load() decide seq_len_max, the gate layout and use_peephole through one path
(decide.py), and say what they decided in the same words.  Each case below is one where a copy of a rule once
drifted (commits 5f03620, 1fe25e8, 3b1d769, 093038b taught inspect or the dump report what seq already did),
or one the rules left to a default without a word (activations both layouts fit)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES, load_case, write_npz

import lstmgrad_cli as lg
from lstmgrad_cli.cli import main


def _zero_weights() -> dict:
    """All-zero weights and states: every gate is 0.5 and ci is 0 in both layouts, so both fit."""
    T, B, I, C = 4, 2, 3, 2  # noqa: E741
    rng = np.random.default_rng(1)
    half, zeros = np.full((T, B, C), 0.5, np.float32), np.zeros((T, B, C), np.float32)
    return dict(x=rng.normal(size=(T, B, I)).astype(np.float32), cs_prev=np.zeros((B, C), np.float32),
                h_prev=np.zeros((B, C), np.float32), w=np.zeros((I + C, 4 * C), np.float32),
                b=np.zeros(4 * C, np.float32), i=half, cs=zeros, f=half, o=half, ci=zeros, co=zeros, h=zeros,
                cs_grad=rng.normal(size=(T, B, C)).astype(np.float32),
                h_grad=rng.normal(size=(T, B, C)).astype(np.float32))


def _stopped_with_garbage() -> dict:
    """seq_v2_partial (TF ran 3 of 6 steps) without its seq_len_max, the steps TF left holding garbage gates."""
    inputs = load_case("seq_v2_partial")[0]
    inputs.pop("seq_len_max")
    rng = np.random.default_rng(0)
    for name in ("i", "f", "o", "ci", "co"):
        inputs[name][3:] = rng.normal(0.0, 50.0, inputs[name][3:].shape)
    return inputs


def _peephole_contradicted() -> dict:
    inputs = load_case("seq_v2_peep")[0]
    inputs["use_peephole"] = np.array(False)  # the file says so; the activations were computed with them
    return inputs


def _nonfinite() -> dict:
    inputs = load_case("seq_v2_peep")[0]
    inputs.pop("use_peephole")
    inputs["x"] = inputs["x"].copy()
    inputs["x"][0, 0, 1] = np.inf  # the stored gates were computed from a finite x: nothing fits
    return inputs


CASES = {"both layouts fit": _zero_weights, "TF stopped early": _stopped_with_garbage,
         "use_peephole contradicted": _peephole_contradicted, "nothing fits": _nonfinite}


def _run(runner, *args) -> dict:
    result = runner.invoke(main, [*args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("case", list(CASES))
def test_seq_check_inspect_and_load_decide_alike_in_the_same_words(runner, tmp_path, case):
    path = write_npz(tmp_path / "in.npz", CASES[case]())
    seq = _run(runner, "seq", str(path), "-o", str(tmp_path / "g.npz"))["results"][0]
    assert seq["status"] == "ok", seq["error"]
    check = _run(runner, "check", str(path), "--gradcheck")["result"]
    inspected = _run(runner, "inspect", str(path))["result"]
    loaded = lg.load(path)

    decided = (seq["layout"], seq["use_peephole"], seq["seq_len_max"])
    assert (check["layout"], check["use_peephole"], check["seq_len_max"]) == decided
    assert (inspected["layout"], inspected["use_peephole"], inspected["seq_len_max"]) == decided
    assert (loaded.layout, loaded["use_peephole"], loaded["seq_len_max"]) == decided
    assert check["sources"] == seq["sources"] and loaded.sources == seq["sources"]
    assert seq["activations"] == check["activations"] == inspected["activations"]

    warnings = [w for w in seq["warnings"] if not w.startswith("NaN/Inf in inputs")]  # (counted by the run)
    found = [n for n in seq["notes"] if n.startswith("seq_len_max")]
    assert warnings or found, "each case is one the user must hear about"
    assert check["warnings"] == warnings and all(n in check["notes"] and n in inspected["notes"] for n in found)
    inspect_warnings = [p["message"] for p in inspected["problems"] if p["severity"] == "warning"]
    assert all(w in inspect_warnings for w in warnings), inspect_warnings
    assert len(loaded.warnings) == len(warnings)  # the same, with the Python API's own names for the flags
    assert inspected["ok"], inspected["problems"]  # (garbage beyond the steps TF ran is no error)


def test_activations_both_layouts_fit_are_a_warning_not_a_default(runner, tmp_path):
    path = write_npz(tmp_path / "zero.npz", _zero_weights())
    quiet = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz"), "-q"])
    assert quiet.exit_code == 0 and quiet.stdout == ""
    (line,) = quiet.stderr.splitlines()  # shown under -q, on stderr
    assert line.startswith(f"Warning: {path}: the stored activations fit both gate layouts")
    assert line.endswith("computed as ifco (BlockLSTMGradV2), the default; if BlockLSTM made them, give --layout icfo")
    strict = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "s.npz"), "--strict"])
    assert strict.exit_code == 1 and "fit both gate layouts" in strict.stderr and not (tmp_path / "s.npz").exists()
    summary = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "g.npz"), "--force"]).stdout
    assert "default used: layout" not in summary  # (it was a dim line, which -q hid)
    (warning,) = lg.load(path).warnings
    assert warning.endswith("give layout='icfo'")  # load's parameter, not the flag
    given = runner.invoke(main, ["seq", str(path), "-o", str(tmp_path / "v1.npz"), "--layout", "icfo", "-q"])
    assert given.exit_code == 0 and given.stderr == ""  # asked: nothing to warn about


def test_the_layout_lstmgrad_forward_recorded_decides_what_the_activations_cannot(runner, tmp_path):
    """A BlockLSTM (ICFO) run of zero weights: its activations fit both layouts, its metadata says which op
    made them, and seq, check and inspect take it from there (seq took ifco, the wrong op's gradient)."""
    inputs = {k: v for k, v in _zero_weights().items() if k in ("x", "cs_prev", "h_prev", "w", "b")}
    src = write_npz(tmp_path / "weights.npz", inputs)
    run = tmp_path / "run.npz"
    made = runner.invoke(main, ["forward", "seq", str(src), "--layout", "icfo", "--cell-clip", "0", "-o", str(run),
                                "-q"])
    assert made.exit_code == 0, made.output
    seq = _run(runner, "seq", str(run), "-o", str(tmp_path / "g.npz"))["results"][0]
    assert (seq["layout"], seq["sources"]["layout"], seq["warnings"]) == ("icfo", "metadata", [])
    check = _run(runner, "check", str(run), "--gradcheck")["result"]
    inspected = _run(runner, "inspect", str(run))["result"]
    assert check["layout"] == inspected["layout"] == "icfo" and inspected["layout_source"] == "metadata"
    assert lg.load(run).op == "BlockLSTMGrad"


def test_a_dump_is_judged_as_seq_judges_it(runner, tmp_path):
    """The TF dump whose seq_len_max was never recorded: inspect's table and seq agree on it."""
    dump = FIXTURES / "tfdbg" / "slm_unrecorded"
    seq = _run(runner, "seq", str(dump), "-o", str(tmp_path / "g.npz"))["results"][0]
    inspected = _run(runner, "inspect", str(dump))["result"]
    (execution,) = [e for e in inspected["executions"] if e["member"] == seq["member"]]
    assert seq["sources"]["use_peephole"] == "activations"
    assert execution["use_peephole"] == seq["use_peephole"] and execution["dims"]["T"] == seq["dims"]["T"]


@pytest.mark.slow
def test_messages_crossing_worker_processes_are_still_spelt_as_flags(runner, tmp_path):
    """A warning made in a worker process is pickled back with the parameters it names, so the command line
    says --layout icfo where the Python API says layout='icfo'."""
    paths = [write_npz(tmp_path / f"{name}.npz", load_case(name)[0]) for name in ("seq_v2_peep", "seq_v2_nopeep")]
    args = ["seq", *map(str, paths), "--layout", "icfo", "--out-dir", str(tmp_path / "out"), "--workers", "2"]
    result = runner.invoke(main, [*args, "-q"])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("not icfo as asked (--layout icfo)") == 2, result.stderr
    doc = json.loads(runner.invoke(main, [*args, "--json", "--force"]).stdout)
    assert all(any("as asked (--layout icfo)" in w for w in r["warnings"]) for r in doc["results"])
    (warning,) = lg.load(paths[0], layout="icfo").warnings
    assert "as asked (layout='icfo')" in warning and "--" not in warning

"""TensorFlow debug dumps (tfdbg2) as inputs, on dumps TensorFlow 2.21 itself wrote (fixtures/tfdbg/, made by
fixtures/make_tfdbg_fixtures.py): reading, the gradient right for the forward op, check against TF's recorded
gradients, inspect, and the dumps lstmgrad cannot use (an unrecorded function argument, CURT_HEALTH)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from conftest import FIXTURES, consistent_inputs
from tfdbg_builder import eager_gradient_dump, graph_training_dump

import lstmgrad_cli as lg
from lstmgrad_cli import io
from lstmgrad_cli.cli import main
from lstmgrad_cli.io import tfdbg, tfrecord

DUMPS = FIXTURES / "tfdbg"
MANIFEST = {c["name"]: c for c in json.loads((DUMPS / "manifest.json").read_text())}
FULL = [n for n, c in MANIFEST.items() if c["tensor_debug_mode"] == "FULL_TENSOR"]
COMPUTABLE = [n for n in FULL if not MANIFEST[n]["inputs_expected_without_value"]]


def npz(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def assert_close(got, want, dtype, name):
    rtol, atol = (2e-2, 2e-3) if dtype == "float16" else (2e-6, 1e-7)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, name
    scale = float(np.max(np.abs(want), initial=0.0))
    assert float(np.max(np.abs(got - want), initial=0.0)) <= atol + rtol * scale, name


@pytest.mark.parametrize("name", list(MANIFEST))
def test_every_execution_is_found_with_its_forward_op(name):
    case = MANIFEST[name]
    index = tfdbg.index_dump(DUMPS / name)
    assert index.tensorflow_version == "2.21.0" and io.sniff_format(DUMPS / name) == "tfdbg2"
    grads = index.gradient_executions()
    assert len(grads) == case["num_grad_executions"]
    for execution, entry in zip(grads, case["grad_executions"], strict=True):
        assert execution.op_type == entry["grad_op_type"]
        assert execution.forward_op == entry["forward_op_type"]
        assert execution.right_op == entry["correct_grad_op_type"]
        if case["tensor_debug_mode"] == "FULL_TENSOR":  # (CURT_HEALTH records no value at all)
            assert sorted(execution.missing) == sorted(entry["inputs_without_value"])
        assert {r.mode for r in execution.outputs.values()} == {tfdbg.FULL_TENSOR if name in FULL else 2}
        assert (execution.graph is None) == (entry["where"] == "eager")
    forward = [e for e in index.executions if not e.is_gradient]
    assert [e.op_type for e in forward] == [case["forward_op"]] * len(grads)
    assert [g.forward_member for g in grads] == [f.member for f in forward]


@pytest.mark.parametrize("name", [n for n in FULL if (DUMPS / f"{n}.recorded.npz").exists()])
def test_recorded_values_are_decoded_exactly(name):
    """Every input and output value, byte for byte what TensorFlow's own MakeNdarray decodes from the dump
    (graph traces in tensor_content; eager scalars and half values in typed fields)."""
    index = tfdbg.index_dump(DUMPS / name)
    recorded = npz(DUMPS / f"{name}.recorded.npz")
    for k, execution in enumerate(index.gradient_executions()):
        names = [n for n in (*execution.inputs, *execution.outputs) if n not in execution.missing]
        loaded = tfdbg.load_execution(index, execution, names, [])
        for key, want in recorded.items():
            run, _, tensor = key.split("/")
            if int(run) == k:
                got = loaded.tensors[tensor]
                assert got.dtype == want.dtype and np.array_equal(got, want), key


@pytest.mark.parametrize("name", COMPUTABLE)
def test_seq_and_cell_give_the_gradient_right_for_the_forward_op(runner, tmp_path, name):
    """Also where TensorFlow ran the V1 kernel on BlockLSTMV2 activations: the expected files hold
    BlockLSTMGradV2, run by TensorFlow on the recorded tensors."""
    case = MANIFEST[name]
    kind = "cell" if case["forward_op"] == "LSTMBlockCell" else "seq"
    result = runner.invoke(main, [kind, str(DUMPS / name), "--out-dir", str(tmp_path), "--json", "--strict"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    expected = npz(DUMPS / f"{name}.expected.npz")
    assert doc["summary"]["done"] == case["num_grad_executions"]
    for k, item in enumerate(doc["results"]):
        assert item["op"] == case["correct_grad_op"] and item["sources"]["use_peephole"] == "activations"
        assert item["use_peephole"] is True
        got = npz(item["output"])
        for key, want in expected.items():
            run, tensor = key.split("/")
            if int(run) == k:
                assert_close(got[tensor], want, case["dtype"], tensor)


def test_the_tape_bug_is_named_in_the_summary(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(DUMPS / "v2_tape_function"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "v2_tape_function [train_step/gradient_tape/BlockLSTMGrad#0] ->" in text
    assert "BlockLSTMGradV2 (layout ifco, the forward op recorded in the dump)" in text
    assert "note: TensorFlow ran BlockLSTMGrad on activations BlockLSTMV2 made" in text


def test_executions_of_a_training_loop_are_told_apart_and_selected(runner, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = runner.invoke(main, ["seq", str(DUMPS / "loop3"), "--out-dir", str(out), "-q"])
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"loop3.train_step.gradient_tape.BlockLSTMGrad.{k}.grads.npz" for k in range(3)]
    runs = [npz(out / n)["x_grad"] for n in names]
    assert not np.array_equal(runs[0], runs[1])  # the weights changed between the calls
    for flags, expect in ((["--execution", "1"], [1]), (["--execution", "-1"], [2]),
                          (["--op", "gradient_tape/BlockLSTMGrad", "--execution", "0"], [0]),
                          (["--group", "train_step/gradient_tape/BlockLSTMGrad#2"], [2])):
        result = runner.invoke(main, ["seq", str(DUMPS / "loop3"), "--out-dir", str(tmp_path), "--json", "--force",
                                      *flags])
        assert result.exit_code == 0, result.stderr
        members = [r["member"] for r in json.loads(result.stdout)["results"]]
        assert members == [f"train_step/gradient_tape/BlockLSTMGrad#{k}" for k in expect]
        for item in json.loads(result.stdout)["results"]:
            np.testing.assert_array_equal(npz(item["output"])["x_grad"], runs[int(item["member"][-1])])
    result = runner.invoke(main, ["seq", str(DUMPS / "loop3"), "-o", str(tmp_path / "one.npz")])
    assert result.exit_code == 2 and "holds 3 executions to run" in result.stderr
    result = runner.invoke(main, ["seq", str(DUMPS / "loop3"), "--op", "NoSuchOp", "--out-dir", str(tmp_path)])
    assert result.exit_code == 1 and "no BlockLSTMGrad or BlockLSTMGradV2 executions matching" in result.stderr
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "--op", "x", "-o",
                                  str(tmp_path / "g.npz")])
    assert result.exit_code == 2 and "no INPUT is one" in result.stderr


def test_a_cell_dump_under_seq_names_the_other_command(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(DUMPS / "cell_explicit"), "--out-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "no BlockLSTMGrad or BlockLSTMGradV2 executions" in result.stderr and "use `lstmgrad cell`" in result.stderr


def test_an_unrecorded_function_argument_is_named_and_can_be_supplied(runner, tmp_path):
    result = runner.invoke(main, ["seq", str(DUMPS / "missing_arg"), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert ("no recorded value for x (an argument of tf.function train_step, and tfdbg2 records no values of "
            "function arguments); give a file holding it with --weights FILE") in result.stderr
    assert not (tmp_path / "g.npz").exists()
    supplied = DUMPS / "missing_arg.supplied.npz"
    result = runner.invoke(main, ["seq", str(DUMPS / "missing_arg"), "-o", str(tmp_path / "g.npz"), "--weights",
                                  str(supplied)])
    assert result.exit_code == 0, result.stderr
    assert f"note: from {supplied}: x" in " ".join(result.stdout.split())
    for key, want in npz(DUMPS / "missing_arg.expected.npz").items():
        assert_close(npz(tmp_path / "g.npz")[key.split("/")[1]], want, "float32", key)


# Inputs an eager gradient op read from tf.Variables under a GradientTape: the dump records none of them, for one
# reason, said once (it was said per tensor: one line of 2,000 characters).
UNRECORDED = ("x", "cs_prev", "h_prev", "w", "b")


@pytest.fixture
def eager_unrecorded(tmp_path):
    run = {**npz(FIXTURES / "seq_v2_peep.in.npz"), **npz(FIXTURES / "seq_v2_peep.expected.npz")}
    run["seq_len_max"] = np.asarray(run["seq_len_max"], np.int64)
    np.savez(tmp_path / "weights.npz", **{n: run[n] for n in UNRECORDED})
    return eager_gradient_dump(tmp_path / "dump", run, unrecorded=UNRECORDED)


def test_unrecorded_inputs_are_one_clause_per_cause_in_every_command(runner, tmp_path, eager_unrecorded):
    cause = tfdbg.index_dump(eager_unrecorded).executions[0].missing["x"].why
    clause = f"no recorded values for {', '.join(UNRECORDED)} ({cause}); give a file holding them with --weights FILE"
    for command in (["seq", "-o", str(tmp_path / "g.npz")], ["check"], ["inspect"]):
        result = runner.invoke(main, [command[0], str(eager_unrecorded), *command[1:]])
        assert result.exit_code == 1, command
        said = result.stderr if command[0] != "inspect" else result.stdout
        (line,) = [ln for ln in said.splitlines() if "no recorded value" in ln and "seq_len_max" not in ln]
        assert clause in line and line.count(cause) == 1, line
        assert len(line) < len(clause) + len(str(eager_unrecorded)) + 60, line  # the path, the member, a label
    assert not (tmp_path / "g.npz").exists()


def test_the_python_api_gets_the_facts_and_its_own_parameter(tmp_path, eager_unrecorded):
    with pytest.raises(lg.UnrecordedTensorsError) as caught:
        lg.load(eager_unrecorded)
    error = caught.value
    assert error.tensors == list(UNRECORDED) and list(error.causes.values()) == [list(UNRECORDED)]
    assert "give a file holding them with the weights argument" in str(error) and "--" not in str(error)
    inputs = lg.load(eager_unrecorded, weights=tmp_path / "weights.npz")  # the parameter the message names
    for key, want in npz(FIXTURES / "seq_v2_peep.expected.npz").items():
        assert_close(getattr(inputs.gradients(), key), want, "float32", key)


def test_a_dump_without_values_says_how_to_make_one(runner, tmp_path):
    for command in (["seq"], ["check"], ["inspect"]):
        args = [*command, str(DUMPS / "curt_health")] + (["--out-dir", str(tmp_path)] if command == ["seq"] else [])
        result = runner.invoke(main, args)
        assert result.exit_code == 1, command
        assert "tensor_debug_mode=CURT_HEALTH, which records no tensor values" in result.output
        assert 'tensor_debug_mode="FULL_TENSOR", circular_buffer_size=-1' in result.output
        assert "Traceback" not in result.output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name, code", [("v2_tape_function", 1), ("loop3", 1), ("v1_peep_clip", 0),
                                        ("v2_eager_explicit", 0), ("cell_explicit", 0), ("half", 0)])
def test_check_compares_every_recorded_gradient(runner, name, code):
    result = runner.invoke(main, ["check", str(DUMPS / name), "--json"])
    assert result.exit_code == code, result.output
    doc = json.loads(result.stdout)
    assert doc["summary"]["executions"] == MANIFEST[name]["num_grad_executions"]
    for report in doc["results"]:
        assert report["passed"] == (code == 0)
        if code:  # TF's GradientTape gradient of BlockLSTMV2: the V1/ICFO kernel on IFCO activations
            assert report["recorded_op"] == "BlockLSTMGrad" and report["op"] == "BlockLSTMGradV2"
            assert "BlockLSTMGrad, TensorFlow's V1 kernel with the ICFO gate layout" in report["explanations"][0]
            assert any("TensorFlow ran BlockLSTMGrad on activations BlockLSTMV2 made" in n for n in report["notes"])


@pytest.mark.slow
def test_check_of_a_dump_in_worker_processes(runner):
    result = runner.invoke(main, ["check", str(DUMPS / "loop3"), "--workers", "2"])
    assert result.exit_code == 1
    text = " ".join(result.stdout.split())
    assert text.count("Why they differ") == 3 and "0 passed, 3 failed" in text
    assert "TF ran" in result.stdout and "BlockLSTMGradV2" in result.stdout


def test_check_of_a_dump_reports_an_unusable_execution_and_goes_on(runner):
    result = runner.invoke(main, ["check", str(DUMPS / "missing_arg")])
    assert result.exit_code == 1 and "no recorded value for x" in result.stderr
    result = runner.invoke(main, ["check", str(DUMPS / "missing_arg"), "--weights",
                                  str(DUMPS / "missing_arg.supplied.npz")])
    assert result.exit_code == 1 and "Why they differ" in result.stdout  # computable now: the tape bug


@pytest.mark.parametrize("name", list(MANIFEST))
def test_inspect_lists_every_execution(runner, name):
    case = MANIFEST[name]
    result = runner.invoke(main, ["inspect", str(DUMPS / name), "--json"])
    doc = json.loads(result.stdout)["result"]
    missing = set(case["inputs_expected_without_value"])
    # (an unrecorded seq_len_max is found from the activations: a warning, not an error)
    expect_errors = bool(missing - {"seq_len_max"}) or case["tensor_debug_mode"] != "FULL_TENSOR"
    assert result.exit_code == (1 if expect_errors else 0)
    assert len(doc["executions"]) == 2 * case["num_grad_executions"]
    for e in doc["executions"]:
        assert e["where"] == ("eager" if case["graph_or_eager"] == "eager" else "graph " + e["member"].split("/")[0])
        if e["right_op"] and case["tensor_debug_mode"] == "FULL_TENSOR" and not e["missing"]:
            assert e["use_peephole"] is True and e["peephole_note"] == "inferred from the activations"
    wrong = case["grad_op"] != case["correct_grad_op"]
    assert bool(doc["warnings"]) == ((wrong or "seq_len_max" in missing) and case["tensor_debug_mode"] == "FULL_TENSOR")
    text = runner.invoke(main, ["inspect", str(DUMPS / name)]).stdout
    assert "TensorFlow debug dump, TF 2.21.0" in text


def test_inspect_infers_the_forward_ops_attributes(runner):
    doc = json.loads(runner.invoke(main, ["inspect", str(DUMPS / "v1_peep_clip"), "--json"]).stdout)["result"]
    forward = next(e for e in doc["executions"] if e["op_type"] == "BlockLSTM")
    assert forward["forget_bias"] == pytest.approx(1.0) and forward["cell_clip"] == pytest.approx(0.5)


def test_python_load_of_a_dump():
    inputs = lg.load(DUMPS / "v2_eager_explicit")
    assert inputs.op == "BlockLSTMGradV2" and inputs.sources["layout"] == "dump"
    expected = npz(DUMPS / "v2_eager_explicit.expected.npz")
    assert_close(inputs.gradients().x_grad, expected["0/x_grad"], "float32", "x_grad")


def test_a_real_subprocess_checks_a_dump(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lstmgrad_cli", "check", str(DUMPS / "v2_tape_function")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr == ""
    assert "BlockLSTMGrad, TensorFlow's V1 kernel with the ICFO gate layout" in " ".join(proc.stdout.split())


def test_crc32c_matches_the_c_library_and_tfs_check_value():
    assert tfrecord.crc32c_python(b"123456789") == 0xE3069283
    google_crc32c = pytest.importorskip("google_crc32c")
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 1000, 65537):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert tfrecord.crc32c_python(data) == google_crc32c.value(data) == tfrecord.crc32c(data)


def test_execution_names_the_user_must_type_are_never_cut(runner, tmp_path):
    """The lists that say what to give --group (an error, inspect's table in a narrow terminal) show each
    execution's whole name: they were cut to 60 characters."""
    run = consistent_inputs(T=3, B=2, I=3, C=2, seed=1)
    tensors = {**run, **lg.block_lstm_grad_v2(3, **run, use_peephole=True)._asdict(), "seq_len_max": np.int64(3)}
    scope = "/".join(["while", "body", "sequential", "bidirectional", "backward_lstm", "gradient_tape"] * 2)
    dump = graph_training_dump(tmp_path / "dump", [tensors] * 2, grad_name=f"{scope}/BlockLSTMGradV2")
    members = [e.member for e in tfdbg.index_dump(dump).executions if e.is_gradient]
    assert len(members) == 2 and min(map(len, members)) > 100
    result = runner.invoke(main, ["seq", str(dump), "-o", str(tmp_path / "g.npz")])
    assert result.exit_code == 2 and all(m in result.stderr for m in members), result.stderr
    narrow = runner.invoke(main, ["inspect", str(dump)], env={"COLUMNS": "80"})
    cells = [line.split("│")[1].strip() for line in narrow.stdout.splitlines() if line.startswith("│")]
    every = [e.member for e in tfdbg.index_dump(dump).executions]  # (the forward runs too)
    assert "".join(cells) == "".join(every)  # each folded over lines of the first column, whole


@pytest.mark.slow
def test_many_runs_stream_through_bounded_memory(tmp_path):
    """A training loop of 100 runs of a tf.function, 0.5 MB of values a run: indexing keeps no values, and one
    execution is read at a time, so memory stays near one run's tensors, not the dump's 50 MB."""
    run = consistent_inputs(T=20, B=16, I=32, C=32, seed=1)
    grads = lg.block_lstm_grad_v2(20, **run, use_peephole=True)._asdict()
    tensors = {**run, **grads, "seq_len_max": np.int64(20)}
    dump = graph_training_dump(tmp_path / "dump", [tensors] * 100)
    size = sum(p.stat().st_size for p in dump.iterdir())
    assert size > 50e6
    tracemalloc.start()
    index = tfdbg.index_dump(dump)
    index_kept, index_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    execution = index.gradient_executions()[-1]
    problem = tfdbg.load_execution(index, execution, list(execution.inputs), [])
    _, load_peak = tracemalloc.get_traced_memory()
    load_peak -= index_kept
    tracemalloc.stop()
    assert len(index.gradient_executions()) == 100 and execution.member == "train_step/grad#99"
    one_run = sum(v.nbytes for v in tensors.values())
    assert index_peak < 2 * 1024**2 + 3 * one_run, index_peak  # records are read one at a time
    assert load_peak < 2 * one_run, load_peak  # the execution's inputs and one record at a time
    np.testing.assert_array_equal(problem.tensors["x"], run["x"])


def test_two_processes_dumping_into_one_directory_keep_every_execution(runner, tmp_path):
    """Two file sets (a rerun, or two processes, writing to one dump directory) record executions of ops of the
    same name: each gets its own name and is computed, none is taken for another."""
    dump = tmp_path / "dump"
    dump.mkdir()
    for name, prefix in (("v2_tape_function", "tfdbg_events.0.fixture."), ("loop3", "tfdbg_events.1.fixture.")):
        for file in (DUMPS / name).iterdir():
            (dump / file.name.replace("tfdbg_events.0.fixture.", prefix)).write_bytes(file.read_bytes())
    out = tmp_path / "out"
    result = runner.invoke(main, ["seq", str(dump), "--out-dir", str(out), "--json"])
    assert result.exit_code == 0, result.output
    results = json.loads(result.stdout)["results"]
    assert [r["member"] for r in results] == [f"train_step/gradient_tape/BlockLSTMGrad#{k}" for k in range(4)]
    assert [r["status"] for r in results] == ["ok"] * 4
    sources = [("v2_tape_function", 0), ("loop3", 0), ("loop3", 1), ("loop3", 2)]
    for item, (name, run) in zip(results, sources, strict=True):
        got = npz(item["output"])
        for key, want in npz(DUMPS / f"{name}.expected.npz").items():
            if key.startswith(f"{run}/"):
                assert_close(got[key.split("/")[1]], want, "float32", key)


def test_a_dump_cut_short_says_what_it_could_not_compare(runner, tmp_path):
    """A dump cut at a record boundary (a crash, or read while TF still writes it) lacks the gradient op's last
    outputs: the check compares the rest and warns of those."""
    dump = tmp_path / "dump"
    shutil.copytree(DUMPS / "v1_peep_clip", dump)
    traces = next(dump.glob("*.graph_execution_traces"))
    last = list(tfrecord.read_records(traces, 1 << 30))[-1]  # the gradient op's last output, b_grad
    traces.write_bytes(traces.read_bytes()[:last.offset])
    result = runner.invoke(main, ["check", str(dump), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["results"][0]
    assert report["not_in_reference"] == ["b_grad"]
    assert ("the dump recorded 7 of the gradient op's 8 outputs (cut short, or still being written?): b_grad could "
            "not be compared") in report["warnings"]


def _buffered_dump(folder, runs: int, size: int):
    """A tf.function called ``runs`` times (a .execution record each, as TensorFlow writes them) and dumped through
    a circular buffer of ``size`` records: each of .execution and .graph_execution_traces keeps its last ``size``
    (all of them for size -1)."""
    from tfdbg_builder import event, field, record

    run = consistent_inputs(T=3, B=2, I=3, C=2, seed=1)
    tensors = {**run, **lg.block_lstm_grad_v2(3, **run, use_peephole=True)._asdict(), "seq_len_max": np.int64(3)}
    dump = graph_training_dump(folder, [tensors] * runs)
    calls = [event(9, field(1, "__inference_train_step_7") + field(2, 1) + field(3, "graph-0")) for _ in range(runs)]
    traces_file = next(dump.glob("*.graph_execution_traces"))
    traces = [r.data for r in tfrecord.read_records(traces_file, 1 << 30)]
    assert len(traces) == 26 * runs  # 11 inputs read, 7 activations, 8 gradients a call
    keep = slice(None) if size < 0 else slice(-size, None)
    traces_file.write_bytes(b"".join(record(bytes(t)) for t in traces[keep]))
    next(dump.glob("*.execution")).write_bytes(b"".join(record(c) for c in calls[keep]))
    return dump


def test_a_dump_whose_circular_buffer_dropped_records_says_so_and_how_many_at_least(runner, tmp_path):
    assert tfdbg.index_dump(_buffered_dump(tmp_path / "whole", 4, -1)).dropped is None
    assert all(tfdbg.index_dump(DUMPS / name).dropped is None for name in MANIFEST)  # TensorFlow's own, unbuffered

    # 4 calls kept, but the traces of 40/26 of them: 4 x 26 - 40 dropped at least.
    dump = _buffered_dump(tmp_path / "traces", 4, 40)
    dropped = tfdbg.index_dump(dump).dropped
    assert dropped.startswith("its circular buffer dropped at least 64 graph execution traces (tfdbg2 keeps the "
                              "last 40 records of each kind: circular_buffer_size=40"), dropped
    assert "full too" not in dropped and "dump again with circular_buffer_size=-1" in dropped
    result = runner.invoke(main, ["seq", str(dump), "--out-dir", str(tmp_path / "out"), "--json", "--keep-going"])
    assert result.stderr.count(f"Warning: {dump}: its circular buffer dropped at least 64 ") == 1, result.stderr
    assert json.loads(result.stdout)["warnings"] == [f"{dump}: {dropped}"]
    shown = runner.invoke(main, ["inspect", str(dump), "--json"])
    assert dropped in json.loads(shown.stdout)["result"]["warnings"]

    # Both files full (3 records each): the executions before them were dropped too.
    dropped = tfdbg.index_dump(_buffered_dump(tmp_path / "both", 4, 3)).dropped
    assert "at least 6 graph execution traces" in dropped  # 3 calls x the 3 outputs seen - 3 (a lower bound)
    assert "its .execution file is full too (3 records): earlier executions were dropped" in dropped

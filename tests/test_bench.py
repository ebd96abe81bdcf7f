"""The benchmark's plumbing (not timed): shapes, results, JSON, the command and the make-bench script."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lstmgrad_cli.backends import cpu_blas, refresh
from lstmgrad_cli.cli import main
from lstmgrad_cli.errors import InvalidArgumentError, UnknownBackendError
from lstmgrad_cli.operations import bench

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def fresh_registry():
    refresh()


def test_flops_and_shapes():
    assert bench.flops((50, 32, 128, 128)) == 16 * 50 * 32 * 128 * 256
    assert bench.parse_shape("3, 2,5,4") == (3, 2, 5, 4)
    for bad in ("1,2,3", "1,2,3,0", "a,b,c,d", ""):
        with pytest.raises(InvalidArgumentError, match="T,B,I,C"):
            bench.parse_shape(bad)


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    monkeypatch.setattr(bench, "SETTLE_SECONDS", 0)


def test_each_timed_call_waits_for_the_thread_pools_to_settle(monkeypatch):
    events = []
    monkeypatch.setattr(bench, "SETTLE_SECONDS", 0.25)
    monkeypatch.setattr(bench.time, "sleep", lambda s: events.append(("sleep", s)))
    times = bench._round_robin({"a": lambda: events.append("a"), "b": lambda: events.append("b")}, repeats=2)
    # warm-up calls first; then each engine after a pause, and once more right after it (back to back)
    assert events == ["a", "b"] + [("sleep", 0.25), "a", "a", ("sleep", 0.25), "b", "b"] * 2
    assert sorted(times) == ["a", "b", "back-to-back:a", "back-to-back:b"]
    assert [len(t) for t in times.values()] == [2, 2, 2, 2]


def test_the_back_to_back_call_is_timed_apart_from_the_paused_one(monkeypatch):
    """A call that pays for what its predecessor left running shows it in the back-to-back times only."""
    clock = [0.0]
    monkeypatch.setattr(bench, "SETTLE_SECONDS", 0.3)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    state = {"busy": False}

    def call():  # 1 s after a pause, 3 s right after another call
        clock[0] += 3.0 if state["busy"] else 1.0
        state["busy"] = True

    def settle(s):
        state["busy"] = False

    monkeypatch.setattr(bench.time, "sleep", settle)
    times = bench._round_robin({"a": call}, repeats=3)
    assert times["a"] == [1.0] * 3 and times["back-to-back:a"] == [3.0] * 3


def test_inputs_are_plausible():
    inputs = bench.make_inputs((3, 2, 5, 4), "float16")
    assert inputs["x"].shape == (3, 2, 5) and inputs["w"].shape == (9, 16) and inputs["i"].dtype == np.float16
    assert 0 <= inputs["o"].min() and inputs["o"].max() <= 1


def test_run_reports_every_engine_against_the_gemm_limit():
    report = bench.run(["numpy"], shapes=[(3, 2, 5, 4), (2, 1, 1, 1)], repeats=2, compare=False)
    engines = [(r.shape, r.engine) for r in report.results]
    assert engines == [((3, 2, 5, 4), "gemm-limit"), ((3, 2, 5, 4), "numpy"),
                       ((2, 1, 1, 1), "gemm-limit"), ((2, 1, 1, 1), "numpy")]
    for r in report.results:
        assert len(r.seconds) == 2 and r.median > 0 and r.gflops > 0
        assert len(r.back_to_back_seconds) == 2 and r.back_to_back_median > 0
        assert r.ratio_to_gemm == pytest.approx(r.median / report.results[0 if r.shape[0] == 3 else 2].median)
    doc = report.to_json()
    assert doc["schema"] == 1 and doc["machine"]["cores"] >= 1 and doc["settings"]["repeats"] == 2
    json.dumps(doc, allow_nan=False)
    assert "| 3,2,5,4 | numpy |" in bench.markdown_table(report)


def test_run_checks_its_arguments():
    with pytest.raises(UnknownBackendError):
        bench.run(["nope"], shapes=[(1, 1, 1, 1)], repeats=1, compare=False)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        bench.run(["numpy"], shapes=[(1, 1, 1, 1)], dtype="int8", repeats=1, compare=False)


def test_a_missing_comparison_interpreter_is_not_fatal(tmp_path):
    report = bench.run(["numpy"], shapes=[(2, 1, 2, 2)], repeats=1, compare_python=[str(tmp_path / "no-python")])
    assert {r.engine for r in report.results} >= {"gemm-limit", "numpy"}
    assert len(report.notes) == 1 and f"{tmp_path / 'no-python'} could not be run" in report.notes[0]


def test_an_interpreter_without_the_frameworks_is_named_not_dropped(runner):
    """This suite's own interpreter has neither TensorFlow nor PyTorch: the table says they were not timed."""
    frameworks = [f for f in bench.FRAMEWORKS if importlib.util.find_spec(f) is None]
    if not frameworks:
        pytest.skip("both frameworks are installed here")
    result = runner.invoke(main, ["bench", "--backend", "numpy", "--shape", "2,1,2,2", "--repeats", "1",
                                  "--compare-python", sys.executable])
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stdout.split())
    for name in frameworks:
        assert f"not compared: {name} not timed with {sys.executable}: No module named '{name}'" in text


def test_other_interpreters_rounds_come_between_this_ones(monkeypatch):
    events = []
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    bench._round_robin({"a": lambda: events.append("a")}, repeats=2, others=[lambda: events.append("child")])
    assert events == ["a"] + ["a", "a", "child"] * 2  # (its warm-up is its own, when it starts)


def test_paired_ratio_compares_round_by_round():
    # the third round was slow for both: round by round the first engine is always half the second
    assert bench.paired_ratio([1.0, 1.0, 5.0], [2.0, 2.0, 10.0]) == 0.5
    assert bench.paired_ratio([], []) is None


@pytest.mark.slow
@pytest.mark.parametrize("library", ["openblas", "mkl"])
def test_child_mode_reports_missing_frameworks_and_its_blas_then_times_a_round_a_line(tmp_path, library):
    if library == "mkl" and cpu_blas.mkl() is None:
        pytest.skip("needs the mkl wheel")
    path = tmp_path / "in.npz"
    np.savez(path, **bench.make_inputs((2, 1, 2, 2)))
    script = ROOT / "lstmgrad_cli" / "operations" / "bench.py"
    env = {**os.environ, cpu_blas.BLAS_ENV: library}  # what the parent passes on
    proc = subprocess.run([sys.executable, "-c", bench.CHILD_LAUNCH, str(script), "--child", str(path),
                           "--frameworks", "no_such_framework"], input="round\nround\n", capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    info, *rounds = [json.loads(line) for line in proc.stdout.splitlines()]
    assert "no_such_framework" in info["errors"] and info["versions"] == {}
    assert info["blas"] == (f"MKL {cpu_blas.mkl_version()}" if library == "mkl" else "OpenBLAS (numpy's)")
    assert len(rounds) == 2
    for times in rounds:
        assert sorted(times) == ["back-to-back:gemm-limit", "gemm-limit"] and times["gemm-limit"] > 0


# Another interpreter, as the parent runs it (``python -c CHILD_LAUNCH bench.py --child ...``), that has PyTorch: it
# reports fixed timings, a round per line asked, so that what the parent makes of them is known.
OTHER_PYTHON = """#!{python}
import json, sys
args = sys.argv[1:]
assert args[0] == "-c" and args[args.index("--frameworks") + 1].split(",") == ["torch"], args
print("a line a library printed")
print(json.dumps({{"versions": {{"torch": "9.9"}}, "notes": {{"torch": "no peepholes"}}, "errors": {{}},
                  "blas": "MKL 9.9"}}), flush=True)
limit, torch, torch_after = [4.0, 2.0, 3.0], [1.5, 3.0, 1.5], [2.0, 2.5, 2.0]
for r, _ in enumerate(sys.stdin):
    print(json.dumps({{"gemm-limit": limit[r], "back-to-back:gemm-limit": limit[r], "torch": torch[r],
                      "back-to-back:torch": torch_after[r]}}), flush=True)
"""


def test_frameworks_from_another_interpreter_are_compared_with_its_own_gemm_limit_and_round_by_round(
        monkeypatch, tmp_path):
    other = tmp_path / "other-python"
    other.write_text(OTHER_PYTHON.format(python=sys.executable))
    other.chmod(0o755)
    monkeypatch.setattr(bench, "FRAMEWORKS", ("torch",))
    report = bench.run(["numpy"], shapes=[(2, 1, 2, 2)], repeats=3, compare_python=[str(other)])
    torch_row = next(r for r in report.results if r.engine == "torch")
    assert torch_row.median == 1.5 and torch_row.ratio_to_gemm == pytest.approx(0.5)  # 1.5 s / median 3.0 s
    assert torch_row.back_to_back_median == 2.0
    assert torch_row.note.startswith("no peepholes; ratio to the GEMM limit timed in the same rounds")
    assert torch_row.note.endswith(", on MKL 9.9")
    numpy_row = next(r for r in report.results if r.engine == "numpy")
    paired = sorted(mine / theirs for mine, theirs in zip(numpy_row.seconds, [1.5, 3.0, 1.5], strict=True))[1]
    assert numpy_row.versus == {"torch": pytest.approx(paired)} and torch_row.versus == {}
    after = sorted(mine / theirs for mine, theirs in zip(numpy_row.back_to_back_seconds, [2.0, 2.5, 2.0],
                                                         strict=True))[1]
    assert numpy_row.versus_back_to_back == {"torch": pytest.approx(after)}
    assert (f"| {numpy_row.versus['torch']:.2f}x torch ({after:.2f}x back to back) |"
            in bench.markdown_table(report))


# An interpreter that has one framework (HAS) of those asked: it times it (fixed seconds) and says the others fail.
ONE_FRAMEWORK_PYTHON = """#!{python}
import json, sys
HAS = {has!r}
asked = sys.argv[sys.argv.index("--frameworks") + 1].split(",")
print(json.dumps({{"versions": {{n: "1.0" for n in asked if n == HAS}}, "notes": {{n: "" for n in asked if n == HAS}},
                  "errors": {{n: f"No module named {{n!r}}" for n in asked if n != HAS}}, "blas": None}}), flush=True)
for _ in sys.stdin:
    print(json.dumps({{"gemm-limit": 1.0, "back-to-back:gemm-limit": 1.0,
                      **{{key: 0.5 for n in asked if n == HAS for key in (n, "back-to-back:" + n)}}}}), flush=True)
"""


def test_a_framework_one_interpreter_lacks_and_the_next_times_is_not_reported_missing(monkeypatch, tmp_path):
    pythons = []
    for has in ("torch", "tensorflow"):
        path = tmp_path / f"{has}-python"
        path.write_text(ONE_FRAMEWORK_PYTHON.format(python=sys.executable, has=has))
        path.chmod(0o755)
        pythons.append(str(path))
    report = bench.run(["numpy"], shapes=[(2, 1, 2, 2)], repeats=2, compare_python=pythons)
    assert {r.engine for r in report.results} == {"gemm-limit", "numpy", "torch", "tensorflow"}
    assert report.notes == []
    report = bench.run(["numpy"], shapes=[(2, 1, 2, 2)], repeats=2, compare_python=pythons[:1])
    assert report.notes == [f"tensorflow not timed with {pythons[0]}: No module named 'tensorflow'"]


def test_bench_command_json(runner):
    result = runner.invoke(main, ["bench", "--backend", "numpy", "--shape", "3,2,5,4", "--repeats", "1",
                                  "--no-compare", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [r["engine"] for r in doc["results"]] == ["gemm-limit", "numpy"]
    numpy_row = doc["results"][1]
    assert numpy_row["version"] == np.__version__ + cpu_blas.version_note() and numpy_row["shape"] == [3, 2, 5, 4]


def test_bench_command_table_and_markdown(runner):
    result = runner.invoke(main, ["bench", "--backend", "numpy", "--shape", "3,2,5,4", "--repeats", "1",
                                  "--no-compare"], catch_exceptions=False)
    assert result.exit_code == 0 and "gemm-limit" in result.stdout and "numpy" in result.stdout
    assert "round 1/1" in result.stderr
    result = runner.invoke(main, ["bench", "--backend", "numpy", "--shape", "3,2,5,4", "--repeats", "1",
                                  "--no-compare", "--markdown"], catch_exceptions=False)
    assert "| 3,2,5,4 | numpy |" in result.stdout


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--backend", "nmba"], 2, "unknown backend 'nmba'"),
    (["--shape", "1,2"], 2, "T,B,I,C"),
    (["--repeats", "0"], 2, "repeats"),
    (["--dtype", "int8"], 2, "dtype"),
])
def test_bench_command_usage_errors(runner, args, code, message):
    result = runner.invoke(main, ["bench", *args, "--no-compare"])
    assert result.exit_code == code and message in result.stderr


def test_bench_command_unavailable_backend_is_exit_1(runner, monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # as if not installed (Python's way to block an import)
    result = runner.invoke(main, ["bench", "--backend", "numba", "--shape", "1,1,1,1", "--no-compare"])
    assert result.exit_code == 1
    assert result.stderr.strip() == ("Error: backend 'numba' is not available: needs numba: "
                                     "pip install 'lstmgrad[numba]'")


@pytest.mark.slow
def test_make_bench_script_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_backends.py"), "--backend", "numpy",
                           "--shape", "2,1,2,2", "--repeats", "1", "--no-compare", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["results"][1]["engine"] == "numpy"


def test_a_folder_named_like_a_framework_is_not_compared(tmp_path, monkeypatch):
    """A directory called torch on the path (the suite's fixtures/torch, a user's project folder) imports as a
    namespace package: it is not PyTorch, so it is neither timed nor reported as failing."""
    import sys

    (tmp_path / "torch").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    report = bench.run(["numpy"], shapes=[(2, 1, 2, 2)], repeats=1)
    assert "torch" not in {r.engine for r in report.results}
    assert not any("torch" in note for note in report.notes)


def test_on_a_gpu_the_bench_states_issue_39s_ratios():
    """Device time over cuDNN's, host times over the bound max(PCIe floor, device time) and the file-to-file time
    over max(that bound, its reading and writing alone), from the medians of one shape's GPU rows; a shape without
    GPU rows gives none, and a row not timed is None."""
    def timing(engine, median, shape=(50, 32, 128, 128)):
        return bench.Timing(engine, None, shape, "float32", [median], median, 1.0, 1.0)

    report = bench.BenchReport({}, {}, [
        timing("numpy", 9.0, (3, 2, 5, 4)),
        timing("torch-cudnn", 0.002), timing("cupy-device", 0.003), timing("cupy-device-steps", 0.006),
        timing("cupy-device-persistent", 0.003), timing("cupy", 0.009), timing("cupy-files", 0.030),
        timing("files-io", 0.020), timing("pcie-floor", 0.004)])
    (row,) = bench.gpu_summary(report)
    assert row["shape"] == [50, 32, 128, 128] and row["host_pinned"] is None and row["host_pinned_over_bound"] is None
    assert row["device_over_cudnn"] == pytest.approx(1.5)
    assert row["host_over_bound"] == pytest.approx(9 / 4) and row["files_over_bound"] == pytest.approx(30 / 20)
    table = bench.markdown_gpu_summary([row])
    assert "| 50,32,128,128 | 2.0 ms | 3.0 ms (1.50x) | 6.0 ms | 3.0 ms | 9.0 ms (2.25x) | - (-) | 30.0 ms (1.50x) | " \
           "20.0 ms | 4.0 ms |" in table
    assert report.to_json()["gpu_summary"] == [row]
    assert bench.markdown_gpu_summary(bench.gpu_summary(bench.BenchReport({}, {}, report.results[:1]))) == ""
    # Reading and writing faster than the device: the file bound is the device's; not timed: no file ratio.
    fast_io = [r if r.engine != "files-io" else timing("files-io", 0.001) for r in report.results]
    assert bench.gpu_summary(bench.BenchReport({}, {}, fast_io))[0]["files_over_bound"] == pytest.approx(30 / 4)
    no_io = [r for r in report.results if r.engine != "files-io"]
    (row,) = bench.gpu_summary(bench.BenchReport({}, {}, no_io))
    assert row["files_io"] is None and row["files_over_bound"] is None


def test_the_file_runs_reading_and_writing_alone_reads_the_input_and_publishes_the_gradients_sizes(tmp_path,
                                                                                                  monkeypatch):
    """The floor of the file-to-file row: the benchmark's input file read, and an NPZ of every gradient's size
    published beside it (fsynced, renamed into place, nothing half-written left)."""
    shape = (3, 2, 5, 4)
    inputs = bench.make_inputs(shape)
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))
    source = bench._input_file(shape, inputs)
    call, version, note = bench.files_io_call(shape, inputs, source)
    call()
    assert version is None and "read and write alone" in note
    with np.load(source) as given:
        assert given["x"].shape == (3, 2, 5) and int(given["seq_len_max"]) == 3
    with np.load(os.path.join(os.path.dirname(source), "io-floor.npz")) as written:
        sizes = {name: written[name].shape for name in written.files}
    assert sizes == {"x_grad": (3, 2, 5), "cs_prev_grad": (2, 4), "h_prev_grad": (2, 4), "w_grad": (9, 16),
                     "wci_grad": (4,), "wcf_grad": (4,), "wco_grad": (4,), "b_grad": (16,)}
    assert sorted(os.listdir(os.path.dirname(source))) == ["in.npz", "io-floor.npz"]

"""Backends: the registry (names, env, auto, plugins, hints) and every backend giving numpy's answer.

Parity runs on the TF golden fixtures and on random shapes (hypothesis).  Nothing here is timed.
Tests that need a CUDA device are marked ``gpu`` and skip without one.  Without one, the cupy backend
runs on the CPU all the same: its shared array code on numpy and its kernels' own C text built for the
host (tests/cuda_host.py), in every parity test; NVRTC compiles the kernels for GPU architectures.
"""

from __future__ import annotations

import _thread
import contextlib
import json
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import cuda_host
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import CELL_CASES, FIXTURES, SEQ_CASES, assert_close_scaled, load_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lstmgrad_cli as lg
from lstmgrad_cli import backends as reg
from lstmgrad_cli.backends import _cupy_kernels, cpu_blas
from lstmgrad_cli.backends._numpy import NumpyBackend
from lstmgrad_cli.backends._xp import XpGradient, default_chunk_steps
from lstmgrad_cli.backends.conformance import LazyRows
from lstmgrad_cli.cli import main
from lstmgrad_cli.errors import BackendUnavailableError, InputFileError, UnknownBackendError
from lstmgrad_cli.spec import SeqTensors

HAVE_NUMBA = reg.status("numba").available


def _gpu_usable() -> bool:
    return reg.status("cupy").available


needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")
needs_host_kernels = pytest.mark.skipif(cuda_host.compiler() is None, reason="no C compiler to build the cupy "
                                        "backend's kernels for the host")


@pytest.fixture(autouse=True)
def fresh_registry():
    reg.refresh()
    yield
    reg.refresh()


def cpu_backends():
    """The CPU backends to check against numpy (numba: serial and parallel kernels, compiled and Python loops)."""
    out = [("numpy", NumpyBackend()), ("numpy-overlapped", NumpyBackend(overlap=True))]
    if HAVE_NUMBA:
        from lstmgrad_cli.backends._numba import NumbaBackend

        # kernel_min_flops=0: the compiled kernels even on these small shapes
        out += [("numba", NumbaBackend(kernel_min_flops=0)),
                ("numba-parallel", NumbaBackend(parallel_min_elements=0, kernel_min_flops=0)),
                ("numba-python-loop", NumbaBackend(compiled_loop=False, kernel_min_flops=0)),
                ("numba-sequential", NumbaBackend(overlap=False, kernel_min_flops=0)),
                ("numba-overlapped", NumbaBackend(overlap=True, kernel_min_flops=0)),
                ("numba-small-problems", NumbaBackend())]
    out.append(("xp-restricted", _RestrictedXpBackend()))
    if cuda_host.compiler() is not None:
        out += [("cupy-kernels-on-host", cuda_host.cupy_backend()),
                ("cupy-persistent-loop-on-host", cuda_host.cupy_backend(loop="persistent")),
                ("cupy-persistent-loop-one-block", cuda_host.cupy_backend(loop="persistent", blocks=1)),
                ("cupy-pinned-copies-on-host", cuda_host.cupy_backend(pinned=True)),
                ("cupy-packed-copies-on-host", cuda_host.cupy_backend(copy_setting="auto"))]
    return out


# -- the registry -----------------------------------------------------------------------------------

def test_builtins_are_listed_in_order():
    assert list(reg.registry())[:3] == ["numpy", "numba", "cupy"]
    numpy_status = reg.status("numpy")
    assert numpy_status.available and numpy_status.version == np.__version__ and numpy_status.source == "built-in"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownBackendError, match=r"unknown backend 'nmba'; known backends: numpy, numba, cupy, auto"):
        reg.get_backend("nmba")


def test_selection_precedence(monkeypatch):
    assert reg.resolve_name(None) == "numpy"
    monkeypatch.setenv("LSTMGRAD_BACKEND", "numba")
    assert reg.resolve_name(None) == "numba"
    assert reg.resolve_name("numpy") == "numpy"
    monkeypatch.setenv("LSTMGRAD_BACKEND", "bogus")
    with pytest.raises(UnknownBackendError):
        reg.resolve_name(None)


@pytest.mark.parametrize(("usable", "expected"), [
    ({"cupy", "numba"}, "cupy"), ({"numba"}, "numba"), (set(), "numpy"),
])
def test_auto_prefers_cupy_then_numba_then_numpy(monkeypatch, usable, expected):
    real = reg.status

    def fake(name, probe_device=True):
        s = real("numpy")
        return reg.BackendStatus(name, name in usable or name == "numpy", "", s.version, "built-in")

    monkeypatch.setattr(reg, "status", fake)
    assert reg.resolve_name("auto") == expected


def test_auto_is_decided_once_a_process(monkeypatch):
    """A batch asks for the backend of every file: ``auto``'s choice and its note are made once a process (asking
    every file once cost 129 ms a file with cupy installed and no GPU: scanning the installed distributions for
    cupy's version), and again after ``refresh``."""
    real, asked = reg.status, []

    def counted(name, probe_device=True):
        asked.append(name)
        return real(name, probe_device)

    monkeypatch.setattr(reg, "status", counted)
    first = (reg.resolve_name("auto"), reg.auto_note("auto"))
    once = len(asked)
    assert 1 <= once <= 2 * len(reg.AUTO_ORDER)
    for _ in range(5):
        assert (reg.resolve_name("auto"), reg.auto_note("auto")) == first
    assert len(asked) == once
    reg.refresh()
    assert reg.resolve_name("auto") == first[0] and len(asked) > once


def test_a_device_probe_is_asked_once_a_boot_and_kept(tmp_path, monkeypatch):
    """What the child process importing cupy said (~1 s of every command that asks, --backend auto included) is
    kept under this boot, driver, cupy and CUDA_VISIBLE_DEVICES: asked once; a timeout is not kept; ``fresh``
    asks again and keeps the new answer; an unreadable cache is asked again."""
    monkeypatch.setenv("LSTMGRAD_CACHE_DIR", str(tmp_path))
    asked = []

    def ask(answer):
        def call():
            asked.append(answer)
            return answer
        return call

    key = reg.probe_key()
    assert key is not None and json.loads(key)["boot"]  # (Linux: this boot's id)
    assert reg.cuda_probe(ask((2, None, True)), key) == (2, None)
    assert reg.cuda_probe(ask((0, "changed", True)), key) == (2, None) and len(asked) == 1  # kept
    assert reg.cuda_probe(ask((0, "no device", True)), key, fresh=True) == (0, "no device")
    assert reg.cuda_probe(ask((5, None, True)), key) == (0, "no device") and len(asked) == 2
    other = reg.probe_key()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert reg.probe_key() != other  # another set of devices: asked again
    assert reg.cuda_probe(ask((0, "asking cupy took over 60 s", False)), reg.probe_key()) == (
        0, "asking cupy took over 60 s")
    assert reg.cuda_probe(ask((1, None, True)), reg.probe_key()) == (1, None) and len(asked) == 4  # (not kept)
    (tmp_path / reg.PROBE_FILE).write_text("{not json")
    assert reg.cuda_probe(ask((3, None, True)), reg.probe_key()) == (3, None) and len(asked) == 5
    assert reg.cuda_probe(ask((9, None, True)), None) == (9, None)  # no boot to key on: asked every time
    assert reg.cuda_probe(ask((9, None, True)), None) == (9, None) and len(asked) == 7


def test_missing_library_gives_the_install_hint(monkeypatch):
    real_find_spec = reg.importlib.util.find_spec
    monkeypatch.setattr(reg.importlib.util, "find_spec",
                        lambda name, *a: None if name == "numba" else real_find_spec(name, *a))
    state = reg.status("numba")
    assert not state.available and "pip install 'lstmgrad[numba]'" in state.reason
    with pytest.raises(BackendUnavailableError, match=r"backend 'numba' is not available: needs numba: "
                                                      r"pip install 'lstmgrad\[numba\]'"):
        reg.get_backend("numba")


def test_cupy_without_a_device_is_unavailable_with_the_reason():
    pytest.importorskip("cupy")
    if _gpu_usable():
        pytest.skip("a GPU is usable here")
    state = reg.status("cupy")
    # here: cupy-cuda13x and no driver at all
    assert not state.available and state.reason.startswith("cupy is installed but no CUDA device is usable: ")
    assert state.reason != "cupy is installed but no CUDA device is usable: "
    result = CliRunner().invoke(main, ["backends", "--json"], catch_exceptions=False)
    rows = {row["name"]: row for row in json.loads(result.stdout)["backends"]}
    assert rows["cupy"]["reason"] == state.reason and json.loads(result.stdout)["auto"] != "cupy"


def test_cupy_backend_refuses_without_a_device():
    from lstmgrad_cli.backends._cupy import CupyBackend

    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        CupyBackend(cp=cuda_host.fake_cupy(available=False))


# -- plugins ----------------------------------------------------------------------------------------

class _EP:
    def __init__(self, name, value, dist=None):
        self.name, self.value, self.dist = name, value, dist


PLUGIN_SOURCE = '''
from lstmgrad_cli.backends._numpy import NumpyBackend

class Plugin(NumpyBackend):
    name = "myplug"
    version = "9.9"

def broken():
    raise RuntimeError("plugin exploded")


class KernelsFail(NumpyBackend):
    name = "kernfail"
    version = "1.0"

    def build_kernels(self):
        raise RuntimeError("kernel 'step' did not compile")
'''


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    (tmp_path / "lstmgrad_test_plugin.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    dist = types.SimpleNamespace(name="lstmgrad-test-plugin", version="9.9")
    eps = [_EP("myplug", "lstmgrad_test_plugin:Plugin", dist), _EP("boom", "lstmgrad_test_plugin:broken"),
           _EP("gone", "no_such_module_xyz:Backend"), _EP("numpy", "evil:Backend"), _EP("bad", "nocolon"),
           _EP("kernfail", "lstmgrad_test_plugin:KernelsFail", dist)]

    def entry_points(group):
        assert group == "lstmgrad.backends"
        return eps

    monkeypatch.setattr(reg.importlib.metadata, "entry_points", entry_points)
    reg.refresh()
    yield
    sys.modules.pop("lstmgrad_test_plugin", None)  # (a test that loaded the plugin leaves no trace for the next)
    reg.refresh()


def test_plugins_are_registered_without_being_imported(plugins):
    with pytest.warns(RuntimeWarning) as record:
        names = list(reg.registry())
    messages = " ".join(str(w.message) for w in record)
    assert "'numpy'" in messages and "taken by the built-in backend" in messages  # no hijacking a built-in
    assert "'bad'" in messages
    assert names == ["numpy", "numba", "cupy", "myplug", "boom", "gone", "kernfail"]
    assert reg.registry()["numpy"].target.startswith("lstmgrad_cli.")
    assert "lstmgrad_test_plugin" not in sys.modules
    mine = reg.status("myplug")
    assert mine.available and mine.version == "9.9" and mine.source == "plugin (lstmgrad-test-plugin)"
    gone = reg.status("gone")
    assert not gone.available and "not installed" in gone.reason


def test_a_plugin_is_used_by_name(plugins):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        backend = reg.get_backend("myplug")
        inputs, expected, case = load_case("seq_v2_peep")
        got = lg.block_lstm_grad_v2(**inputs, backend="myplug")
    assert backend.name == "myplug"
    assert_close_scaled(got.x_grad, expected["x_grad"])


def test_a_broken_plugin_is_an_error_not_a_crash(plugins):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(BackendUnavailableError, match="backend 'boom' failed to load: plugin exploded"):
            reg.get_backend("boom")
        with pytest.raises(BackendUnavailableError, match="'gone'.*not installed"):
            reg.get_backend("gone")
        assert reg.get_backend("numpy").name == "numpy"


def test_unreadable_entry_points_are_a_warning(monkeypatch):
    def entry_points(group):
        raise OSError("metadata is broken")

    monkeypatch.setattr(reg.importlib.metadata, "entry_points", entry_points)
    with pytest.warns(RuntimeWarning, match="metadata is broken"):
        assert list(reg.registry()) == ["numpy", "numba", "cupy"]


# -- the command line -------------------------------------------------------------------------------

def test_backends_command_json(runner):
    from lstmgrad_cli.cli import main

    result = runner.invoke(main, ["backends", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = {r["name"]: r for r in doc["backends"]}
    assert doc["default"] == "numpy" and doc["auto"] in rows and doc["host_blas"] == cpu_blas.describe()
    assert rows["numpy"]["available"] and rows["numpy"]["version"] == np.__version__
    assert rows["numpy"]["source"] == "built-in"
    assert rows["cupy"]["available"] or rows["cupy"]["reason"]


def test_backends_says_how_cupy_runs_its_loop_and_copies(runner, monkeypatch):
    from lstmgrad_cli.cli import main

    if reg.status("cupy", probe_device=False).version is None:
        pytest.skip("cupy is not installed here")
    doc = json.loads(runner.invoke(main, ["backends", "--json"], catch_exceptions=False).stdout)
    assert doc["gpu_schedule"] == ("cupy: a chunk's time loop in one launch where a step's product is at most "
                                   "1.3e+08 multiply-adds and a block's share of w fits its shared memory, else a "
                                   "step at a time (LSTMGRAD_CUPY_LOOP=auto), host arrays copied through pinned "
                                   "staging buffers from 32 MB a call (the time-major ones in 8 chunks of steps "
                                   "where the GPU cannot hold them whole, each while the device computes the one "
                                   "before), below that packed into one pinned buffer, one copy each way "
                                   "(LSTMGRAD_CUPY_COPIES=auto)")
    monkeypatch.setenv("LSTMGRAD_CUPY_LOOP", "steps")
    monkeypatch.setenv("LSTMGRAD_CUPY_COPIES", "pinned")
    monkeypatch.setenv("COLUMNS", "400")
    table = runner.invoke(main, ["backends"], catch_exceptions=False).stdout
    assert ("cupy: a chunk's time loop a step at a time (LSTMGRAD_CUPY_LOOP=steps), host arrays copied through "
            "pinned staging buffers (the time-major ones in 8 chunks of steps where the GPU cannot hold them whole, "
            "each while the device computes the one before) (LSTMGRAD_CUPY_COPIES=pinned)") in " ".join(table.split())


def test_backends_command_table(runner):
    from lstmgrad_cli.cli import main

    result = runner.invoke(main, ["backends"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "numpy" in result.stdout and "cupy" in result.stdout


def test_backends_table_keeps_the_extras_of_install_hints(runner, monkeypatch):
    # rich reads "[cuda]" as markup and dropped it: the hint said pip install 'lstmgrad' (CUDA 13).
    from lstmgrad_cli.cli import main

    monkeypatch.setitem(sys.modules, "cupy", None)  # as if not installed (Python's way to block an import)
    assert not reg.status("cupy", probe_device=False).available
    monkeypatch.setenv("COLUMNS", "200")
    result = runner.invoke(main, ["backends"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "pip install 'lstmgrad[cuda]' (CUDA 13) or 'lstmgrad[cuda12]'" in result.stdout


IMPORT_CHECK = """
import sys
from lstmgrad_cli.cli import main
try:
    main(sys.argv[1:], prog_name="lstmgrad")
except SystemExit as e:
    code = e.code
print("LOADED", sorted(m for m in ("numba", "cupy", "llvmlite") if m in sys.modules), code)
"""


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--help"], ["backends"], ["backends", "--json"], ["bench", "--help"]])
def test_help_and_backends_import_neither_numba_nor_cupy(args):
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "LOADED [] 0"


# -- parity with numpy ------------------------------------------------------------------------------

def _run_seq(backend, inputs, layout, **kw):
    fn = lg.block_lstm_grad_v2 if layout == "ifco" else lg.block_lstm_grad
    return fn(**inputs, backend=backend, **kw)


@pytest.mark.parametrize("name", SEQ_CASES)
def test_seq_fixtures_every_backend(name):
    inputs, expected, case = load_case(name)
    reference = _run_seq("numpy", inputs, case["layout"])
    for label, backend in cpu_backends():
        got = _run_seq(backend, inputs, case["layout"])
        for field, want in expected.items():
            assert_close_scaled(getattr(got, field), want, name=f"{label} {field}")
            # Same algorithm, same bracketing: the CPU backends agree with numpy to float rounding.
            np.testing.assert_allclose(getattr(got, field), getattr(reference, field), rtol=0, atol=_ulps(reference))


@pytest.mark.parametrize("name", CELL_CASES)
@pytest.mark.parametrize("compute_dtype", [None, "float16"])
def test_cell_fixtures_dicfo_bit_exact(name, compute_dtype):
    """The elementwise outputs equal TF's bit for bit: float32, and float16 with per-op half rounding."""
    inputs, expected, case = load_case(name)
    if compute_dtype and case["dtype"] != "float16":
        pytest.skip("float16 emulation only applies to float16 inputs")
    inputs = {k: v for k, v in inputs.items() if k != "h"}
    for label, backend in cpu_backends():
        got = lg.lstm_block_cell_grad_full(**inputs, backend=backend, compute_dtype=compute_dtype)
        for field in ("cs_prev_grad", "dicfo", "wci_grad", "wcf_grad", "wco_grad"):
            if case["dtype"] == "float16" and compute_dtype is None:
                assert_close_scaled(getattr(got, field), expected[field], name=f"{label} {field}")
            else:
                np.testing.assert_array_equal(getattr(got, field), expected[field], err_msg=f"{label} {field}")
        for field in ("x_grad", "h_prev_grad", "w_grad", "b_grad"):
            assert_close_scaled(getattr(got, field), expected[field], name=f"{label} {field}")


def _ulps(outputs, n=8):
    scale = max(float(np.max(np.abs(np.asarray(a, np.float64)), initial=0)) for a in outputs)
    return n * scale * float(np.finfo(outputs[0].dtype).eps)


def _random_inputs(rng, T, B, I, C, dtype):  # noqa: E741
    def n(*shape):
        return rng.standard_normal(shape).astype(dtype)

    def u(lo, hi, *shape):
        return rng.uniform(lo, hi, shape).astype(dtype)

    return dict(x=n(T, B, I), cs_prev=n(B, C), h_prev=n(B, C), w=n(I + C, 4 * C), wci=n(C), wcf=n(C), wco=n(C),
                b=n(4 * C), i=u(0, 1, T, B, C), cs=n(T, B, C), f=u(0, 1, T, B, C), o=u(0, 1, T, B, C),
                ci=u(-1, 1, T, B, C), co=u(-1, 1, T, B, C), h=u(-1, 1, T, B, C), cs_grad=n(T, B, C),
                h_grad=n(T, B, C))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(0, 6), B=st.integers(0, 5), I=st.integers(1, 5), C=st.integers(1, 6),  # noqa: E741
       data=st.data(), peephole=st.booleans(), layout=st.sampled_from(["ifco", "icfo"]),
       dtype=st.sampled_from(["float32", "float64", "float16"]), seed=st.integers(0, 2**16))
def test_random_shapes_every_backend_matches_numpy(T, B, I, C, data, peephole, layout, dtype, seed):  # noqa: E741
    L = data.draw(st.integers(0, T), label="seq_len_max")
    chunk = data.draw(st.one_of(st.none(), st.integers(1, max(T, 1))), label="chunk_steps")
    compute = data.draw(st.sampled_from([None, "float16"] if dtype == "float16" else [None]), label="compute")
    inputs = _random_inputs(np.random.default_rng(seed), T, B, I, C, np.dtype(dtype))
    tensors = SeqTensors(**inputs)
    cdt = np.dtype(compute or ("float32" if dtype == "float16" else dtype))
    kw = dict(seq_len_max=L, use_peephole=peephole, layout=layout, compute_dtype=cdt)
    reference = NumpyBackend().block_lstm_grad(tensors, **kw)  # one chunk
    for label, backend in cpu_backends():
        got = backend.block_lstm_grad(tensors, **kw, chunk_steps=chunk)
        for field, want, have in zip(reference._fields, reference, got, strict=True):
            assert have.dtype == np.dtype(dtype) and have.shape == want.shape, (label, field)
            tol = 2e-3 if cdt == np.float16 else 8 * float(np.finfo(cdt).eps)
            out_ulp = float(np.finfo(np.dtype(dtype)).eps)  # rounding to a float16 output may flip its last bit
            scale = max(float(np.max(np.abs(want.astype(np.float64)), initial=0)), 1.0)
            err = float(np.max(np.abs(have.astype(np.float64) - want), initial=0))
            assert err <= (tol * (2 + L) + out_ulp) * scale, (label, field, err)
        if L < T:
            assert not np.any(got.x_grad[L:]), label


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("peephole", [False, True])
def test_numba_compiled_time_loop_equals_numpy_bit_for_bit(dtype, peephole):
    from lstmgrad_cli.backends import _numba

    if _numba._BLAS is None:
        pytest.skip("numpy's BLAS is not reachable here: the numba time loop stays in Python")
    assert _numba.NumbaGradient().compiled_loop
    # B = 1 and C = 1: np.matmul takes gemv there, so the compiled loop must step aside.
    for B, C in ((6, 12), (1, 64), (40, 1)):
        inputs = _random_inputs(np.random.default_rng(7), 9, B, 5, C, np.dtype(dtype))
        kw = dict(seq_len_max=8, use_peephole=peephole, layout="ifco", compute_dtype=np.dtype(dtype), chunk_steps=3)
        reference = NumpyBackend().block_lstm_grad(SeqTensors(**inputs), **kw)
        for parallel_min in (0, 10**9):
            for compiled in (True, False):
                backend = _numba.NumbaBackend(parallel_min, compiled_loop=compiled, kernel_min_flops=0)
                got = backend.block_lstm_grad(SeqTensors(**inputs), **kw)
                for field, want, have in zip(reference._fields, reference, got, strict=True):
                    np.testing.assert_array_equal(have, want, err_msg=f"{field} B={B} C={C} {parallel_min} {compiled}")


def _needs_compiled_loop():
    from lstmgrad_cli.backends import _numba

    if _numba._BLAS is None:
        pytest.skip("numpy's BLAS is not reachable here: the numba time loop stays in Python")
    return _numba


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("peephole", [False, True])
@pytest.mark.parametrize("T, L, chunk", [(23, 23, 5), (23, 17, 4), (9, 9, 1), (40, 40, None)])
def test_overlapped_schedule_equals_the_sequential_one_bit_for_bit(dtype, peephole, T, L, chunk):
    _numba = _needs_compiled_loop()
    inputs = _random_inputs(np.random.default_rng(11), T, 6, 5, 12, np.dtype(dtype))
    kw = dict(seq_len_max=L, use_peephole=peephole, layout="ifco", compute_dtype=np.dtype(dtype))
    backend = _numba.NumbaBackend(overlap=True, kernel_min_flops=0)
    overlapped = backend.block_lstm_grad(SeqTensors(**inputs), **kw, chunk_steps=chunk)
    with _one_core():  # the same chunks one after the other (a fifth of the steps each when not given)
        sequential = _numba.NumbaBackend(kernel_min_flops=0).block_lstm_grad(SeqTensors(**inputs), **kw,
                                                                             chunk_steps=chunk)
        reference = NumpyBackend().block_lstm_grad(SeqTensors(**inputs), **kw, chunk_steps=chunk)
    for field, want, have, seq in zip(reference._fields, reference, overlapped, sequential, strict=True):
        np.testing.assert_array_equal(have, seq, err_msg=field)
        np.testing.assert_array_equal(have, want, err_msg=field)


@contextlib.contextmanager
def _one_core():
    """As on a one-core machine: backends left to choose (``overlap=None``) cut a problem over ``OVERLAP_MIN_FLOPS``
    (here every problem) into the overlapped schedule's chunks, and run them one after the other."""
    from lstmgrad_cli.backends import _xp

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_xp, "OVERLAP_MIN_FLOPS", 0)
        mp.setattr(cpu_blas, "usable_cores", lambda: 1)
        yield


def test_chunk_bounds_cover_the_steps_once_last_first():
    from lstmgrad_cli.backends._xp import chunk_bounds

    assert chunk_bounds(10, 4) == [(6, 10), (2, 6), (0, 2)]
    assert chunk_bounds(10, 4, short_first=True) == [(8, 10), (4, 8), (0, 4)]
    assert chunk_bounds(100, 20, short_first=True) == [(90, 100)] + [(hi - 20, hi) for hi in (90, 70, 50, 30)] + [
        (0, 10)]
    assert chunk_bounds(3, 5, short_first=True) == [(0, 3)]  # one chunk: nothing to start sooner
    assert chunk_bounds(0, 1) == [] and chunk_bounds(1, 1, short_first=True) == [(0, 1)]
    for L, K in [(29, 6), (7, 1), (50, 10), (41, 7)]:
        for short in (False, True):
            bounds = chunk_bounds(L, K, short)
            steps = [t for lo, hi in bounds for t in range(hi - 1, lo - 1, -1)]
            assert steps == list(range(L - 1, -1, -1)) and all(0 < hi - lo <= K for lo, hi in bounds)


def test_chunks_depend_on_the_shape_alone():
    """(Whether those chunks then run overlapped is measured on the machine: test_overlap_calibration.py.)"""
    f32 = np.dtype("float32")
    auto = XpGradient(np)
    assert auto._overlap_chunks(50, 32, 128, 128, f32)           # 0.8 GFLOP, gate gradients of 3 MiB
    assert auto._overlap_chunks(200, 128, 512, 512, f32)         # 200 MiB: chunks in a ring of slots
    assert not auto._overlap_chunks(1, 32, 128, 128, f32)        # one step: nothing to overlap
    assert not auto._overlap_chunks(20, 16, 64, 64, f32)         # 42 MFLOP: a thread costs more than it saves
    assert XpGradient(np, overlap=True)._overlap_chunks(20, 16, 64, 64, f32)
    assert not XpGradient(types.SimpleNamespace())._overlap_chunks(50, 32, 128, 128, f32)  # not host arrays


@pytest.mark.parametrize("peephole", [False, True])
def test_numpy_overlapped_equals_sequential_bit_for_bit(peephole):
    inputs = _random_inputs(np.random.default_rng(12), 31, 5, 4, 7, np.dtype("float32"))
    kw = dict(seq_len_max=29, use_peephole=peephole, layout="icfo", compute_dtype=np.dtype("float32"))
    overlapped = NumpyBackend(overlap=True).block_lstm_grad(SeqTensors(**inputs), **kw)  # 3 steps, then chunks of 6
    with _one_core():
        sequential = NumpyBackend().block_lstm_grad(SeqTensors(**inputs), **kw)
    one_chunk = NumpyBackend(overlap=False).block_lstm_grad(SeqTensors(**inputs), **kw)
    for field, have, want, single in zip(overlapped._fields, overlapped, sequential, one_chunk, strict=True):
        np.testing.assert_array_equal(have, want, err_msg=field)
        np.testing.assert_allclose(have, single, rtol=1e-5, atol=1e-6, err_msg=field)


@pytest.mark.parametrize("budget_chunks", [1, 2, 3])
def test_overlap_reuses_gate_slots_and_stays_bit_for_bit(monkeypatch, budget_chunks):
    from lstmgrad_cli.backends import _xp

    inputs = _random_inputs(np.random.default_rng(13), 25, 6, 5, 8, np.dtype("float64"))
    kw = dict(seq_len_max=25, use_peephole=True, layout="ifco", compute_dtype=np.dtype("float64"))
    sequential = NumpyBackend(overlap=False).block_lstm_grad(SeqTensors(**inputs), **kw, chunk_steps=3)
    slot_bytes = 3 * 6 * (4 * 8 + 5 + 8 + 1) * 8  # a chunk's gate gradients and [x, h_prev, 1]
    monkeypatch.setattr(_xp, "CHUNK_BYTES", budget_chunks * slot_bytes)  # 9 chunks, 2-3 slots
    allocated = []
    real_empty = np.empty
    monkeypatch.setattr(_xp.np, "empty", lambda shape, *a, **k: allocated.append(shape) or real_empty(shape, *a, **k))
    overlapped = NumpyBackend(overlap=True).block_lstm_grad(SeqTensors(**inputs), **kw, chunk_steps=3)
    slots = max(2, budget_chunks)  # (two at least: one filled while the other's products run)
    assert (slots, 3, 6, 32) in allocated and (slots, 3, 6, 14) in allocated  # the rings of slots
    for field, have, want in zip(overlapped._fields, overlapped, sequential, strict=True):
        np.testing.assert_array_equal(have, want, err_msg=field)


@pytest.mark.parametrize("library", ["openblas", "mkl"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matmul_into_writes_or_adds_a_product_in_one_blas_call(dtype, library, monkeypatch):
    blas = cpu_blas.numpy_openblas() if library == "openblas" else cpu_blas.mkl()
    if blas is None:
        pytest.skip(f"{library} is not reachable here")
    monkeypatch.setattr(cpu_blas, "find", lambda: blas)
    rng = np.random.default_rng(21)
    rtol = 1e-4 if dtype == "float32" else 1e-12

    def same_product(have, a, b):
        if library == "openblas":  # the very call numpy makes: the same bits
            np.testing.assert_array_equal(have, np.matmul(a, b))
        else:
            np.testing.assert_allclose(have, a.astype(np.float64) @ b.astype(np.float64), rtol=rtol,
                                       atol=1e-4 * np.sqrt(a.shape[1]))

    for n, m, k in [(40, 9, 12), (1, 5, 7), (700, 129, 300)]:
        xh, g = rng.standard_normal((n, m)).astype(dtype), rng.standard_normal((n, k)).astype(dtype)
        out = np.full((m, k), np.nan, dtype)
        assert cpu_blas.matmul_into(xh.T, g, out, accumulate=False)  # a transposed view, as _wb_product passes
        same_product(out, xh.T, g)
        start = rng.standard_normal((m, k)).astype(dtype)
        out[...] = start
        assert cpu_blas.matmul_into(xh.T, g, out, accumulate=True)
        want = start.astype(np.float64) + xh.T.astype(np.float64) @ g.astype(np.float64)
        np.testing.assert_allclose(out, want, rtol=rtol, atol=1e-4 * np.sqrt(n))
        c_order = np.empty((m, k), dtype)
        assert cpu_blas.matmul_into(np.ascontiguousarray(xh.T), g, c_order, accumulate=False)
        same_product(c_order, np.ascontiguousarray(xh.T), g)
        # blocks of columns, of the operands (one transposed) and of out, as the w/b product's chains pass them
        wide = np.full((m, k + 6), np.nan, dtype)
        right = g[:, k // 2:]
        block = wide[1:, 2:2 + right.shape[1]]
        for left in (xh[:, 1:].T, np.ascontiguousarray(xh[:, 1:].T)):
            block[...] = np.nan
            assert cpu_blas.matmul_into(left, right, block, accumulate=False)
            same_product(block, left, right)
        untouched = np.ones(wide.shape, bool)
        untouched[1:, 2:2 + right.shape[1]] = False
        assert np.isnan(wide[untouched]).all()


def test_matmul_into_declines_what_blas_cannot_take_as_it_is(monkeypatch):
    a, b = np.ones((4, 3), np.float32), np.ones((3, 5), np.float32)
    out = np.zeros((4, 5), np.float32)
    frozen = np.zeros((4, 5), np.float32)
    frozen.flags.writeable = False
    declined = [
        (a.astype(np.float16), b.astype(np.float16), out.astype(np.float16)),  # no half-precision GEMM
        (a, b.astype(np.float64), out),                                           # mixed dtypes
        (np.ones((4, 6), np.float32)[:, ::2], b, out),                            # a strided operand
        (a, b, np.zeros((5, 4), np.float32).T),                                   # out column after column
        (a, b, np.zeros((4, 10), np.float32)[:, ::2]),                            # out's elements apart
        (np.ones((4, 8), np.float32)[:, ::2][:, :3], b, out),                     # neither rows nor columns adjacent
        (a, b, frozen),                                                           # out read-only
        (a, np.ones((2, 5), np.float32), out),                                    # inner sizes differ
        (np.ones((4, 0), np.float32), np.ones((0, 5), np.float32), out),          # nothing to add up
        (a.tolist(), b, out),                                                     # not arrays
        (a, b, np.zeros((1, 4, 5), np.float32)),                                  # not 2-D
    ]
    for left, right, target in declined:
        before = np.array(target, copy=True)
        assert not cpu_blas.matmul_into(left, right, target, accumulate=True)
        np.testing.assert_array_equal(target, before)
    monkeypatch.setattr(cpu_blas, "find", lambda: None)  # another BLAS: numpy does it
    assert not cpu_blas.matmul_into(a, b, out, accumulate=False)


def test_w_grad_is_the_same_whether_blas_or_numpy_adds_the_chunks(monkeypatch):
    inputs = _random_inputs(np.random.default_rng(22), 30, 5, 6, 7, np.dtype("float64"))
    kw = dict(seq_len_max=27, use_peephole=True, layout="ifco", compute_dtype=np.dtype("float64"), chunk_steps=4)
    calls = []  # (first column, accumulate flag) of the products into [w_grad; b_grad] ([I+C+1, 4C])
    real = cpu_blas.matmul_into

    def spy(a, b, out, accumulate):
        if out.shape[0] == 6 + 7 + 1:
            calls.append((out.__array_interface__["data"][0], out.shape[1], accumulate))
        return real(a, b, out, accumulate=accumulate)

    monkeypatch.setattr(cpu_blas, "matmul_into", spy)
    in_blas = NumpyBackend(overlap=False).block_lstm_grad(SeqTensors(**inputs), **kw)
    # 7 chunks, each a product per half of the columns: the first chunk writes them, the others add
    starts = sorted({start for start, _, _ in calls})
    assert len(starts) == 2 and starts[1] - starts[0] == 2 * 7 * 8  # the second half, 14 float64 columns on
    assert [(width, add) for _, width, add in calls] == [(14, False)] * 2 + [(14, True)] * 12
    monkeypatch.setattr(cpu_blas, "matmul_into", lambda *a, **k: False)
    in_numpy = NumpyBackend(overlap=False).block_lstm_grad(SeqTensors(**inputs), **kw)
    for field, have, want in zip(in_blas._fields, in_blas, in_numpy, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-13, atol=1e-13, err_msg=field)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("shape", [(512, 2048), (300, 7), (1, 130), (0, 4), (129, 129)])
def test_contiguous_transpose_equals_the_transpose(shape, dtype):
    """By OpenBLAS (float32, float64: rows of adjacent elements, a block of columns too) or in tiles (the rest)."""
    from lstmgrad_cli.backends._xp import contiguous_transpose

    wide = (np.arange(np.prod(shape) + 3 * shape[0]) % 2039).reshape(shape[0], shape[1] + 3).astype(dtype)
    if shape[0]:
        wide[0, 3:5] = [-0.0, np.nan]
    a = np.ascontiguousarray(wide[:, 3:])
    for source in (a, wide[:, 3:], a[:, ::-1]):  # contiguous, a block of columns, columns reversed
        got = contiguous_transpose(np, source)
        assert got.flags.c_contiguous and got.dtype == source.dtype
        assert got.tobytes() == np.ascontiguousarray(source.T).tobytes()  # every bit, -0.0 and NaN too
    assert contiguous_transpose(np, a[:, ::-1], tile=5).tobytes() == np.ascontiguousarray(a[:, ::-1].T).tobytes()
    assert cpu_blas.transpose_into(a, np.empty(shape[::-1], dtype)) == (dtype != "float16" and a.size > 0)


def test_outputs_own_their_values_even_from_dirty_buffers(monkeypatch):
    from lstmgrad_cli.backends import _xp

    inputs = _random_inputs(np.random.default_rng(23), 9, 3, 4, 5, np.dtype("float32"))
    kw = dict(use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    clean = {L: NumpyBackend().block_lstm_grad(SeqTensors(**inputs), seq_len_max=L, **kw) for L in (6, 0)}
    real_empty = np.empty
    monkeypatch.setattr(_xp.np, "empty", lambda *a, **k: np.full(real_empty(*a, **k).shape, np.nan,
                                                                 k.get("dtype", a[1] if len(a) > 1 else None)))
    for L in (6, 0):
        dirty = NumpyBackend().block_lstm_grad(SeqTensors(**inputs), seq_len_max=L, **kw)
        for field, have, want in zip(dirty._fields, dirty, clean[L], strict=True):
            np.testing.assert_array_equal(have, want, err_msg=field)  # x_grad beyond seq_len_max is zero
        assert not dirty.x_grad[L:].any()
    assert not dirty.w_grad.any() and not dirty.b_grad.any()  # no steps: nothing to add up
    dirty.wci_grad[0] = 1  # the three zero peephole gradients are three arrays
    assert not dirty.wcf_grad.any() and not dirty.wco_grad.any()


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_an_overlapped_pass_where_no_thread_can_start_does_every_product_itself(backend):
    from conftest import no_thread_can_start

    inputs, kw = _five_chunks(5)
    overlapped = _overlapping_backend(backend)
    want = overlapped.block_lstm_grad(SeqTensors(**inputs), **kw)
    running = _thread._count()
    with no_thread_can_start():
        got = overlapped.block_lstm_grad(SeqTensors(**inputs), **kw)
    assert _thread._count() == running
    for field, have, expected in zip(got._fields, got, want, strict=True):
        np.testing.assert_array_equal(have, expected, err_msg=field)


class _SlowRows(LazyRows):
    """A time-major input whose every read takes 20 ms (a slow disk)."""

    def __getitem__(self, index):
        time.sleep(0.02)
        return super().__getitem__(index)

    def read_into(self, lo, hi, out, dest=None):
        time.sleep(0.02)
        return super().read_into(lo, hi, out, dest)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_overlapped_products_wait_for_their_chunks_x_and_h(backend):
    """Either thread may fill a chunk's [x, h_prev, 1] while the loop runs; its w_grad products wait for it."""
    inputs, kw = _five_chunks(6)
    want = NumpyBackend(overlap=False).block_lstm_grad(SeqTensors(**inputs), **kw)
    slow = {**inputs, "x": _SlowRows(inputs["x"]), "h": _SlowRows(inputs["h"])}
    got = _overlapping_backend(backend).block_lstm_grad(SeqTensors(**slow), **kw)
    for field, have, expected in zip(got._fields, got, want, strict=True):
        np.testing.assert_array_equal(have, expected, err_msg=field)


def _overlapping_backend(name):
    if name == "numpy":
        return NumpyBackend(overlap=True)
    return _needs_compiled_loop().NumbaBackend(overlap=True, kernel_min_flops=0)


def test_overlap_worker_keeps_the_callers_numpy_error_state():
    inputs, _, _ = load_case("seq_v2_peep")
    inputs["x"] = inputs["x"].copy()
    inputs["x"][0, 0, :2] = [np.nan, np.inf]  # inf - inf in the worker's products
    inputs["h_grad"] = inputs["h_grad"].copy()
    inputs["h_grad"][1, 2, 3] = -np.inf
    # RuntimeWarnings from lstmgrad_cli are errors in this suite: the worker must stay as quiet as the loop.
    got = lg.block_lstm_grad_v2(**inputs, backend=NumpyBackend(overlap=True))
    assert np.isnan(got.w_grad).any() and np.isnan(got.x_grad).any()


class _FailingRows(LazyRows):
    """A time-major input read a chunk at a time (as an HDF5 input is), whose ``fail_on``-th read fails with
    ``error``; ``reads`` gets the first step of each read."""

    def __init__(self, array, reads, fail_on, error):
        super().__init__(array)
        self._reads, self._fail_on, self._error = reads, fail_on, error

    def _read(self, lo):
        self._reads.append(lo)
        if len(self._reads) == self._fail_on:
            raise self._error

    def __getitem__(self, index):
        self._read(index.start)
        return super().__getitem__(index)

    def read_into(self, lo, hi, out, dest=None):
        self._read(lo)
        return super().read_into(lo, hi, out, dest)


class _WorkerFails:
    """An ``x_grad_out`` whose rows fail to be written on any thread but the main one; the main thread's first write
    waits until another thread has tried (the overlapped schedule's two threads may each take any x product)."""

    def __init__(self, shape, written):
        self.shape, self.dtype, self._written = shape, np.dtype("float32"), written
        self._tried = threading.Event()

    def __setitem__(self, index, rows):
        if threading.current_thread() is threading.main_thread():
            if "main" not in self._written:
                self._tried.wait(10)
            self._written.append("main")
            return
        self._written.append("worker")
        self._tried.set()
        raise MemoryError("worker failed")


def _five_chunks(seed):
    """Inputs and arguments for a 20-step problem in five chunks of 4 steps."""
    inputs = _random_inputs(np.random.default_rng(seed), 20, 4, 3, 5, np.dtype("float32"))
    return inputs, dict(seq_len_max=20, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"),
                        chunk_steps=4)


@needs_numba
def test_overlap_restores_blas_threads_and_hands_on_a_worker_failure(monkeypatch):
    _numba = _needs_compiled_loop()
    inputs, kw = _five_chunks(3)
    threads = _numba._BLAS.get_threads()
    backend = _numba.NumbaBackend(overlap=True, kernel_min_flops=0)
    backend.block_lstm_grad(SeqTensors(**inputs), **kw)
    assert _numba._BLAS.get_threads() == threads

    # x_grad's rows, written by whichever thread does a chunk's x product, fail when the worker writes them
    written = []
    running = _thread._count()
    with pytest.raises(MemoryError, match="worker failed"):
        backend.block_lstm_grad(SeqTensors(**inputs), **kw, x_grad_out=_WorkerFails(inputs["x"].shape, written))
    assert _numba._BLAS.get_threads() == threads
    assert "worker" in written and _thread._count() == running  # the worker wrote, failed, and has ended


@needs_numba
def test_overlap_stops_the_worker_when_the_loop_fails(monkeypatch):
    _numba = _needs_compiled_loop()
    inputs, kw = _five_chunks(4)
    threads = _numba._BLAS.get_threads()
    # The loop reads the activations a chunk at a time (an input on disk: the next chunk's rows are read ahead, and
    # what stopped the read is raised in the loop as it takes them): Ctrl-C during the read of chunk 8-12.
    seen = []
    i = _FailingRows(inputs["i"], seen, fail_on=3, error=KeyboardInterrupt())
    running = _thread._count()
    with pytest.raises(KeyboardInterrupt):
        _numba.NumbaBackend(overlap=True, kernel_min_flops=0).block_lstm_grad(SeqTensors(**{**inputs, "i": i}), **kw)
    assert seen == [16, 12, 8]
    assert _numba._BLAS.get_threads() == threads
    assert _thread._count() == running  # the worker has ended


@needs_numba
def test_small_problems_on_numba_never_import_it():
    # Importing numba and loading its kernels takes ~0.5 s; a small file must not pay for it.
    code = """
import sys, json, numpy as np
sys.path.insert(0, sys.argv[1])
from conftest import load_case
import lstmgrad_cli as lg
from lstmgrad_cli.backends import get_backend
inputs, _, _ = load_case("seq_v2_peep")
backend = get_backend("numba")
got = lg.block_lstm_grad_v2(**inputs, backend=backend)
want = lg.block_lstm_grad_v2(**inputs, backend="numpy")
same = all(np.array_equal(a, b) for a, b in zip(got, want))
print(json.dumps([sorted(m for m in ("numba", "llvmlite") if m in sys.modules), backend.version, same]))
"""
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent)], capture_output=True,
                          text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded, version, same = json.loads(proc.stdout.strip().splitlines()[-1])
    import importlib.metadata

    assert loaded == [] and version == importlib.metadata.version("numba") + cpu_blas.version_note() and same


@needs_numba
def test_the_numba_backends_version_is_found_once(monkeypatch):
    """Every file of a batch records its backend's version: numba's metadata is read once (~0.3 ms a file)."""
    from lstmgrad_cli.backends._numba import NumbaBackend

    real, asked = cpu_blas.installed_version, []
    monkeypatch.setattr(cpu_blas, "installed_version", lambda name: asked.append(name) or real(name))
    backend = NumbaBackend()
    versions = {backend.version for _ in range(5)}
    assert versions == {real("numba") + cpu_blas.version_note()} and asked == ["numba"]


KERNELS_ON_DEMAND = """
import json, sys
import numpy as np
from lstmgrad_cli.backends import _numba
from lstmgrad_cli.backends.conformance import Case, problem
from lstmgrad_cli.spec import SeqTensors

class Counted(_numba.NumbaGradient):  # the fused step kernel (compiled_loop=False: one call a step), counted
    calls = 0

    def step(self, *args):
        Counted.calls += 1
        return super().step(*args)

inputs = SeqTensors(**problem(Case("float32", "float32", False, "ifco")))
kw = dict(seq_len_max=5, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
flops = int(sys.argv[1])
seen = []
for threshold in (flops + 1, flops, flops + 1):  # under it, then at it (loads the kernels), then under it again
    Counted.calls = 0
    Counted(compiled_loop=False, kernel_min_flops=threshold).block_lstm_grad(inputs, **kw)
    seen.append([Counted.calls, "numba" in sys.modules])
print(json.dumps(seen))
"""


@needs_numba
def test_big_problems_load_the_kernels_and_then_every_size_uses_them():
    """In a fresh process, where the kernels are not loaded yet."""
    from lstmgrad_cli.backends import conformance

    flops = 16 * conformance.T * conformance.B * conformance.C * (conformance.I + conformance.C)
    proc = subprocess.run([sys.executable, "-c", KERNELS_ON_DEMAND, str(flops)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    under, at, under_again = json.loads(proc.stdout.strip().splitlines()[-1])
    assert under == [0, False]  # under the threshold, kernels not loaded: the plain numpy code, numba not imported
    assert at[0] == 5 and at[1]  # at it: the kernels are loaded, one call a step
    assert under_again == [5, True]  # loaded now: they cost nothing more


def test_chunk_steps_default_bounds_memory():
    assert default_chunk_steps(0, 4, 4, 4) == 1
    assert default_chunk_steps(10, 4, 4, 4) == 10
    k = default_chunk_steps(200, 128, 512, 4)  # 1 MiB of gate gradients per step
    assert k * 128 * 4 * 512 * 4 <= 64 * 2**20 and -(-200 // k) * k - 200 < -(-200 // k)  # equal-length chunks


# -- the cupy backend without a GPU ----------------------------------------------------------------
# Its kernels are built three ways: by real cupy (constructed), by NVRTC for GPU architectures, and by the C compiler
# for the host, where cpu_backends() runs them in every parity test above (tests/cuda_host.py).

class _RestrictedNamespace:
    """numpy, but only the functions cupy has too: the shared code must not use anything else."""

    def __getattr__(self, name):
        if name not in cuda_host.CUPY_COMMON:
            raise AttributeError(f"the shared array code used xp.{name}, which is not in CUPY_COMMON")
        return getattr(np, name)


class _RestrictedXpBackend(NumpyBackend):
    name = "xp-restricted"

    def __init__(self):
        self._gradient = XpGradient(_RestrictedNamespace())


def test_cupy_kernels_are_built_by_real_cupy():
    # cupy checks a kernel's parameters when it is constructed, before any device is touched: every call on a
    # GPU failed here once ("Can not use 'i' as a parameter name").
    cupy = pytest.importorskip("cupy")

    module = _cupy_kernels.module(cupy)
    assert module.code == _cupy_kernels.source() and "--fmad=false" in module.options


@pytest.mark.parametrize("arch", ["sm_90", "sm_75", "compute_90"])  # the H100's, the oldest CUDA 13 builds for
def test_every_cupy_kernel_compiles_with_nvrtc_for_the_gpu(arch):
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings and nvidia-cuda-nvrtc (the dev extra)")
    compiled = _cupy_kernels.compile_for_arch(arch)
    assert compiled.ok and compiled.size > 0, compiled.log
    # NVRTC writes its log into the buffer it is given: once that was b" " * 1, Python's one shared b" ", which it
    # turned into b"\x00" for the rest of the process (b" " * n then made zeros: a Keras config padded with
    # spaces failed to parse, two tests later)
    assert b" "[0] == 32 and b" " * 3 == bytes([32, 32, 32])
    for name in _cupy_kernels.KERNELS:
        assert f"void {name}(" in _cupy_kernels.source()


def test_a_loop_kernel_declares_little_shared_memory_and_one_block_of_it_fits_a_multiprocessor():
    """What ptxas reports of each loop kernel for sm_90: its own shared memory within LOOP_STATIC_SHARED_MOST (the
    launcher keeps that much of a block's limit for it, beside the dynamic shared memory it asks for), and
    registers that let LOOP_THREADS threads run as one block (65536 a multiprocessor)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings and nvidia-cuda-nvrtc (the dev extra)")
    import re

    compiled = _cupy_kernels.compile_for_arch("sm_90", extra_options=("--ptxas-options=-v",))
    assert compiled.ok, compiled.log
    report = {}  # kernel -> (registers, bytes of shared memory it declares)
    for entry in compiled.log.split("Compiling entry function ")[1:]:
        name = re.match(r"'(\w+)'", entry)[1]
        smem = re.search(r"(\d+) bytes smem", entry)
        report[name] = (int(re.search(r"Used (\d+) registers", entry)[1]), int(smem[1]) if smem else 0)
    loops = {name: used for name, used in report.items() if name.startswith("lstmgrad_loop")}
    assert len(loops) == 6, report
    for name, (registers, smem) in loops.items():
        assert smem <= _cupy_kernels.LOOP_STATIC_SHARED_MOST, (name, smem)
        assert registers * _cupy_kernels.LOOP_THREADS <= 65536, (name, registers)


@needs_host_kernels
@pytest.mark.parametrize("loop", ["auto", "persistent"])
def test_cupy_computes_a_layer_of_no_cells_as_numpy_does(loop):
    """C = 0 (TensorFlow takes it): no loop to launch, whatever the loop asked for."""
    from lstmgrad_cli.backends._cupy import CupyBackend

    inputs = SeqTensors(**_random_inputs(np.random.default_rng(1), 3, 4, 2, 0, np.float32))
    kw = dict(seq_len_max=3, use_peephole=True, layout="ifco", compute_dtype=np.dtype("float32"))
    calls = []
    got = CupyBackend(cp=cuda_host.fake_cupy(), launcher=cuda_host.HostLauncher(calls), loop=loop).block_lstm_grad(
        inputs, **kw)
    assert _cupy_kernels.loop_name(np.float32, True) not in calls
    for field, a, b in zip(NumpyBackend().block_lstm_grad(inputs, **kw)._fields, NumpyBackend().block_lstm_grad(
            inputs, **kw), got, strict=True):
        assert b.shape == a.shape, field
        np.testing.assert_array_equal(b, a, err_msg=field)


def test_nvrtc_reports_a_kernel_that_does_not_compile():
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings and nvidia-cuda-nvrtc (the dev extra)")
    broken = _cupy_kernels.source().replace("dcs * fv", "dcs * undefined_name")
    compiled = _cupy_kernels.compile_for_arch("sm_90", broken)
    assert not compiled.ok and "undefined_name" in compiled.log
    with pytest.raises(ValueError, match="sm_20"):
        _cupy_kernels.compile_for_arch("sm_20")


@needs_host_kernels
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("peephole", [False, True])
def test_cupy_kernels_on_the_host_equal_numpy_bit_for_bit(dtype, peephole):
    calls = []
    backend = cuda_host.cupy_backend(calls)
    for B, C in ((3, 5), (1, 1), (4, 33), (37, 1)):  # (37, 1): numpy's own sum of one column is pairwise
        inputs = _random_inputs(np.random.default_rng(11), 7, B, 4, C, np.dtype(dtype))
        kw = dict(seq_len_max=6, use_peephole=peephole, layout="icfo", compute_dtype=np.dtype(dtype), chunk_steps=4)
        want = NumpyBackend().block_lstm_grad(SeqTensors(**inputs), **kw)
        got = backend.block_lstm_grad(SeqTensors(**inputs), **kw)
        for field, a, b in zip(want._fields, want, got, strict=True):
            np.testing.assert_array_equal(b, a, err_msg=f"{B},{C} {field}")
            assert type(b) is np.ndarray and b.dtype == np.dtype(dtype)
    # each step's kernel, and with peepholes the batch sums of their three gradients, in the numpy backend's order
    sums = [_cupy_kernels.batch_sum_name(dtype)] * 3 * peephole
    assert calls == ([_cupy_kernels.kernel_name(dtype, peephole)] * 6 + sums) * 4


@needs_host_kernels
def test_cupy_runs_a_small_steps_time_loop_in_one_launch_and_a_large_ones_from_python(monkeypatch):
    from lstmgrad_cli.backends._cupy import LOOP_ENV, PERSISTENT_MOST_MACS

    kw = dict(seq_len_max=3, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    for B, C, kernel in ((2, 4, _cupy_kernels.loop_name), (33, 1024, _cupy_kernels.kernel_name)):
        assert (B * C * 4 * C <= PERSISTENT_MOST_MACS) == (kernel is _cupy_kernels.loop_name)
        calls = []
        inputs = SeqTensors(**_random_inputs(np.random.default_rng(5), 3, B, 3, C, np.float32))
        # (an H100's 132 multiprocessors: a block's share of w_rec would fit, so the threshold alone decides)
        got = cuda_host.cupy_backend(calls, loop="auto", blocks=132).block_lstm_grad(inputs, **kw)
        assert set(calls) == {kernel(np.float32, False)}
        want = NumpyBackend().block_lstm_grad(inputs, **kw)
        np.testing.assert_allclose(got.h_prev_grad, want.h_prev_grad, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(LOOP_ENV, "fast")
    with pytest.raises(BackendUnavailableError, match="LSTMGRAD_CUPY_LOOP='fast' is not one of auto, steps, "):
        cuda_host.cupy_backend(loop=None)


@needs_host_kernels
@pytest.mark.parametrize(("dtype", "compute"), [("float16", "float32"), ("float16", "float16"),
                                               ("float32", "float32"), ("float64", "float64")])
@pytest.mark.parametrize(("blocks", "row_groups"), [(6, 2), (8, 4), (3, 1)])
def test_the_persistent_loop_split_into_row_groups_matches_numpy_with_peepholes_and_a_shorter_sequence(
        dtype, compute, blocks, row_groups):
    """Peepholes, seq_len_max < T, chunks of 3 steps, float16 (computed in float32, and in float16 rounded as TF
    does), float32 and float64, the step split into 2 and 4 row groups (the H100's golden cases, their batches
    small, all ran one): the gradients are the numpy backend's to the products' rounding, and x_grad is zero past
    seq_len_max."""
    from lstmgrad_cli.backends._cupy import CupyBackend

    T, B, I, C = 9, 37, 5, 7  # noqa: E741
    inputs = SeqTensors(**_random_inputs(np.random.default_rng(11), T, B, I, C, np.dtype(dtype)))
    cdt = np.dtype(compute)
    kw = dict(seq_len_max=7, use_peephole=True, layout="icfo", compute_dtype=cdt)
    calls = []
    launcher = cuda_host.HostLauncher(calls, blocks=blocks, row_groups=row_groups)
    got = CupyBackend(cp=cuda_host.fake_cupy(), launcher=launcher, loop="persistent").block_lstm_grad(
        inputs, **kw, chunk_steps=3)
    assert set(calls) == {_cupy_kernels.loop_name(cdt, True), _cupy_kernels.batch_sum_name(cdt)}
    want = NumpyBackend().block_lstm_grad(inputs, **kw)
    # relative to the field's largest value: the sums' order differs (the loop's ranges and tree, numpy's BLAS)
    tol = 2e-2 if compute == "float16" else 4e-3 if dtype == "float16" else 64 * float(np.finfo(cdt).eps)
    for field, a, b in zip(want._fields, want, got, strict=True):
        assert b.dtype == np.dtype(dtype)
        scale = max(float(np.max(np.abs(a.astype(np.float64)), initial=0)), 1.0)
        assert float(np.max(np.abs(b.astype(np.float64) - a), initial=0)) <= tol * scale, field
    assert not np.any(got.x_grad[7:])


def _fma32(a, b, c) -> np.float32:
    """float32's fused multiply-add, a * b + c rounded once (to nearest, ties to even), as CUDA's fmaf and C's."""
    from fractions import Fraction

    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))
    candidates = (np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf)))
    return min(candidates, key=lambda r: (abs(Fraction(float(r)) - exact), int(np.array(r).view(np.int32)) & 1))


@needs_host_kernels
@pytest.mark.parametrize(("B", "C", "blocks", "row_groups"), [
    (2, 20, 3, None),  # as loop_grid splits it: one row group, columns 7, 7, 6
    (40, 6, 4, 2),  # two row groups of 20 rows: 25 ranges of q (not a power of two) over 24 terms, one empty
    (600, 1, 1, None),  # more rows than threads: two tiles of rows, one range each
    (20, 16, 1, None),  # sixteen columns at once
    (3, 4, 2, None),  # two
])
def test_the_persistent_loops_product_adds_in_its_fixed_order(B, C, blocks, row_groups):
    """carried_h[b, c] = gates[b, :] . w_rec[c, :] as a block of the loop adds it: its rows in tiles of at most
    LOOP_THREADS, the 4C terms cut into LOOP_THREADS // tile ranges, each range's terms added in order by fused
    multiply-adds, then the ranges' sums in a fixed tree (s takes s + span for span = 1, 2, 4, ...); float32
    throughout.  One step, so h_prev_grad is that product of its gate gradients (the numpy backend's, bit for
    bit)."""
    I = 3  # noqa: E741
    inputs = SeqTensors(**_random_inputs(np.random.default_rng(8), 1, B, I, C, np.float32))
    kw = dict(seq_len_max=1, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    _, gates = NumpyBackend().block_lstm_grad(inputs, **kw, return_dgates=True)
    from lstmgrad_cli.backends._cupy import CupyBackend

    launcher = cuda_host.HostLauncher(blocks=blocks, row_groups=row_groups)
    got = CupyBackend(cp=cuda_host.fake_cupy(), launcher=launcher, loop="persistent").block_lstm_grad(
        inputs, **kw).h_prev_grad
    grid = launcher.loop_grid(B, C, np.float32)
    w_rec, G = inputs.w[I:], 4 * C
    want = np.empty((B, C), np.float32)
    for group in range(grid.row_groups):
        r0, r1 = B * group // grid.row_groups, B * (group + 1) // grid.row_groups
        tile = min(r1 - r0, _cupy_kernels.LOOP_THREADS)
        slices = _cupy_kernels.LOOP_THREADS // tile
        for b in range(r0, r1):
            for c in range(C):
                parts = []
                for s in range(slices):
                    acc = np.float32(0)
                    for q in range(G * s // slices, G * (s + 1) // slices):
                        acc = _fma32(gates[0, b, q], w_rec[c, q], acc)
                    parts.append(acc)
                span = 1
                while span < slices:
                    for s in range(0, slices, 2 * span):
                        if s + span < slices:
                            parts[s] = np.float32(parts[s] + parts[s + span])
                    span *= 2
                want[b, c] = parts[0]
    np.testing.assert_array_equal(got, want)


@needs_host_kernels
@pytest.mark.parametrize("copies", ["pageable", "pinned"])
def test_a_persistent_loop_whose_blocks_cannot_all_run_is_redone_a_step_at_a_time_when_chosen(copies):
    """Another program holding part of the GPU leaves some of the loop's blocks waiting: the loop stops them all
    and sets its flag, which the backend reads once the pass is queued.  Where the backend chose that loop ("auto")
    it computes the pass again from its inputs with the loop of steps (fed again a chunk at a time, through the
    pinned buffers, on a device that cannot hold the inputs whole); where it was asked for, the error stands (one
    line, naming the way out)."""
    from lstmgrad_cli.backends._cupy import CupyBackend, device_bytes
    from lstmgrad_cli.backends._cupy_copies import FED, fed_rows
    from lstmgrad_cli.backends._xp import chunk_bounds

    class Crowded(cuda_host.HostLauncher):
        def loop(self, name, batch, columns, params, args, barrier):
            super().loop(name, batch, columns, params, args, barrier)
            barrier[1] = 1  # a block gave up waiting

    inputs = SeqTensors(**_random_inputs(np.random.default_rng(4), 6, 3, 4, 5, np.float32))
    kw = dict(seq_len_max=6, use_peephole=True, layout="ifco", compute_dtype=np.dtype("float32"))
    calls, copied = [], []
    free = device_bytes(inputs, 6, np.float32) - (copies == "pinned")  # (pinned: it cannot hold it whole, so fed)
    got = CupyBackend(cp=cuda_host.fake_cupy(copied=copied, free_bytes=free), launcher=Crowded(calls), loop="auto",
                      copies=copies, pinned_empty=np.empty).block_lstm_grad(inputs, **kw)
    want = NumpyBackend().block_lstm_grad(inputs, **kw, chunk_steps=1 if copies == "pinned" else None)
    if copies == "pinned":  # the other tensors copied once, the time-major ones fed to both passes
        fed = sum((b - a) * getattr(inputs, name)[0].nbytes for lo, hi in chunk_bounds(6, 1)
                  for name in FED for a, b in [fed_rows(name, lo, hi)])
        others = sum(a.nbytes for name, a in inputs._asdict().items() if name not in FED)
        assert sum(shape[0] for way, kind, shape in copied if way == "in" and kind == np.uint8) == others + 2 * fed
    for field, a, b in zip(want._fields, want, got, strict=True):
        np.testing.assert_array_equal(b, a, err_msg=field)
    assert _cupy_kernels.kernel_name(np.float32, True) in calls  # the steps' kernels
    with pytest.raises(BackendUnavailableError, match="use LSTMGRAD_CUPY_LOOP=steps$"):
        CupyBackend(cp=cuda_host.fake_cupy(), launcher=Crowded(), loop="persistent").block_lstm_grad(inputs, **kw)


@needs_host_kernels
def test_a_chunk_looped_in_one_launch_is_sized_for_a_larger_budget_than_a_loop_of_steps():
    """On the device, chunks whose time loop runs in one launch get PERSISTENT_CHUNK_BYTES (fewer launches, larger
    products: faster on an H100), a loop of steps the host's CHUNK_BYTES; a pass's loop launches follow the budget."""
    from lstmgrad_cli.backends._cupy import PERSISTENT_CHUNK_BYTES, CupyGradient
    from lstmgrad_cli.backends._xp import CHUNK_BYTES, default_chunk_steps

    auto = CupyGradient(np, loop="auto")
    assert auto.chunk_budget(32, 1024) == PERSISTENT_CHUNK_BYTES > CHUNK_BYTES
    assert auto.chunk_budget(33, 1024) == CHUNK_BYTES
    assert CupyGradient(np, loop="steps").chunk_budget(1, 1) == CHUNK_BYTES
    assert default_chunk_steps(1000, 64, 512, 4, 512, budget=PERSISTENT_CHUNK_BYTES) == 500
    assert default_chunk_steps(1000, 64, 512, 4, 512) == 84

    class Budgeted(CupyGradient):
        def chunk_budget(self, B, C):
            return 3 * (4 * C + 4 + C + 1) * B * 4  # three steps of gate gradients and [x, h_prev, 1]

    calls = []
    tensors = SeqTensors(**_random_inputs(np.random.default_rng(5), 9, 2, 4, 3, np.float32))
    kw = dict(seq_len_max=9, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    cp = cuda_host.fake_cupy()
    got = Budgeted(cp, cuda_host.HostLauncher(calls), loop="persistent").block_lstm_grad(
        SeqTensors(*(cp.asarray(a) for a in tensors)), **kw)
    assert calls.count(_cupy_kernels.loop_name(np.float32, False)) == 3  # 9 steps, chunks of 3
    want = NumpyBackend().block_lstm_grad(tensors, **kw, chunk_steps=3)
    for field, a, b in zip(want._fields, want, got, strict=True):
        np.testing.assert_allclose(np.asarray(b), a, rtol=1e-5, atol=1e-6, err_msg=field)


def test_the_auto_loop_takes_one_launch_up_to_its_threshold_exactly():
    from lstmgrad_cli.backends._cupy import PERSISTENT_MOST_MACS, CupyGradient

    auto = CupyGradient(np, loop="auto")
    assert 32 * 1024 * 4 * 1024 == PERSISTENT_MOST_MACS
    assert auto.persistent(32, 1024) and not auto.persistent(33, 1024)
    assert CupyGradient(np, loop="persistent").persistent(1024, 1024)
    assert not CupyGradient(np, loop="steps").persistent(1, 1)


def test_the_loop_splits_a_step_into_row_and_column_groups_that_fit_shared_memory():
    """On an H100 (132 multiprocessors, 227 KiB of shared memory a block): a small batch keeps all its rows in
    each block; a larger one splits them, so that a block reads fewer rows of the gate gradients a step, while its
    columns' rows of w_rec still fit, keeping to 8 columns at once where it can (16 were slower on the H100); a
    w_rec no split can hold is refused (None)."""
    from lstmgrad_cli.backends._cupy_kernels import LoopGrid, loop_grid

    h100 = dict(multiprocessors=132, shared_limit=227 * 1024)
    assert loop_grid(16, 256, np.float32, **h100) == LoopGrid(132, 1, (2 * 1024 + 512 * 2) * 4)
    assert loop_grid(64, 256, np.float32, **h100) == LoopGrid(132, 4, (8 * 1024 + 512 * 8) * 4)
    assert loop_grid(128, 512, np.float32, **h100) == LoopGrid(132, 2, (8 * 2048 + 512 * 8) * 4)  # (4: 16 cols)
    assert loop_grid(128, 512, np.float64, **h100).row_groups == 2
    # where no split keeps to 8 columns (66 multiprocessors: 10 of 640 columns a block), 16 at once
    assert loop_grid(8, 640, np.float32, 66, 227 * 1024) == LoopGrid(66, 1, (16 * 2560 + 512 * 16) * 4)
    assert loop_grid(256, 1024, np.float32, **h100) == LoopGrid(132, 1, (8 * 4096 + 512 * 8) * 4)
    assert loop_grid(256, 1024, np.float64, **h100) is None
    assert loop_grid(8, 2048, np.float32, **h100) is None  # 16 columns of 8192 floats: 512 KiB
    assert loop_grid(1, 64, np.float16, **h100) == LoopGrid(64, 1, (256 + 512) * 4)  # a block a column at most


@needs_host_kernels
def test_a_loop_that_cannot_hold_its_weights_runs_a_step_at_a_time_or_is_refused_when_asked_for():
    from lstmgrad_cli.backends._cupy import CupyBackend

    class Small(cuda_host.HostLauncher):
        def loop_grid(self, B, C, dtype):
            return None

    inputs = SeqTensors(**_random_inputs(np.random.default_rng(6), 4, 3, 2, 5, np.float32))
    kw = dict(seq_len_max=4, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    calls = []
    got = CupyBackend(cp=cuda_host.fake_cupy(), launcher=Small(calls), loop="auto").block_lstm_grad(inputs, **kw)
    assert set(calls) == {_cupy_kernels.kernel_name(np.float32, False)}
    want = NumpyBackend().block_lstm_grad(inputs, **kw)
    np.testing.assert_allclose(got.h_prev_grad, want.h_prev_grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(BackendUnavailableError, match="cannot hold w's recurrent rows .* use LSTMGRAD_CUPY_LOOP=st"):
        CupyBackend(cp=cuda_host.fake_cupy(), launcher=Small(), loop="persistent").block_lstm_grad(inputs, **kw)


def test_pinned_copies_wait_for_what_the_current_stream_still_has_to_do():
    """A device array whose last write is still queued on the current stream (a kernel not yet run) is copied
    back only after it: the copy stream waits for the current stream first."""
    from lstmgrad_cli.backends._cupy_copies import PinnedCopies

    cp = cuda_host.fake_cupy()
    device = cp.asarray(np.zeros(1000, np.float32))
    cp.cuda.get_current_stream().pending.append(lambda: device.view(np.ndarray).fill(7))  # queued, not run
    (host,) = PinnedCopies(cp, np.empty).to_host([device])
    np.testing.assert_array_equal(host, np.full(1000, 7, np.float32))


def test_pinned_copies_cross_in_slices_through_two_buffers_and_lose_no_byte():
    """Host arrays to the (stand-in) device and back through two staging buffers of 1 MiB, on a copy stream that
    runs each copy only once an event after it is waited for: a buffer refilled before its copy ran would show."""
    from lstmgrad_cli.backends._cupy_copies import PinnedCopies

    copied = []
    cp = cuda_host.fake_cupy(copied=copied)
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((700, 1000)).astype(np.float32),  # 2.7 slices, each copied by 3 threads
              rng.standard_normal((3, 5))[:, ::2],  # not contiguous
              np.float16(1.5) * np.ones((0, 4), np.float16), np.array(7.0), None,
              rng.integers(0, 9, (2**18 + 3,)).astype(np.int8)]
    pinned = PinnedCopies(cp, np.empty, slice_bytes=2**20, threads=3)
    on_device = pinned.to_device(arrays)
    assert on_device[4] is None
    for a, d in zip(arrays, on_device, strict=True):
        if a is not None:
            assert isinstance(d, cp.ndarray) and d.flags.c_contiguous
            np.testing.assert_array_equal(np.asarray(d), a)
    assert sum(n for way, _, (n,) in copied if way == "in") == sum(a.nbytes for a in arrays if a is not None)
    back = pinned.to_host([d for d in on_device if d is not None])
    for a, h in zip([a for a in arrays if a is not None], back, strict=True):
        assert type(h) is np.ndarray and h.dtype == a.dtype
        np.testing.assert_array_equal(h, a)


def test_packed_copies_cross_in_one_copy_each_way_and_lose_no_byte():
    """A call's small host arrays cross by one copy into one device buffer, each array a C-contiguous view of it;
    the gradients back by one copy each into one pinned buffer, then out into arrays of their own."""
    from lstmgrad_cli.backends._cupy_copies import PACK_ALIGN, PackedCopies

    copied = []
    cp = cuda_host.fake_cupy(copied=copied)
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((7, 3)).astype(np.float32), rng.standard_normal((3, 5))[:, ::2],  # not contiguous
              np.ones((0, 4), np.float16), np.array(7.0), None, rng.integers(0, 9, (1001,)).astype(np.int8),
              rng.standard_normal(6).astype(">f4")]  # (big-endian: as cupy holds it, in this machine's order)
    packed = PackedCopies(cp, np.empty)
    on_device = packed.to_device(arrays)
    assert on_device[4] is None
    assert copied == [("in", np.uint8, (sum(-(-a.nbytes // PACK_ALIGN) * PACK_ALIGN for a in arrays
                                            if a is not None),))]
    for a, d in zip(arrays, on_device, strict=True):
        if a is not None:
            assert isinstance(d, cp.ndarray) and d.flags.c_contiguous and d.shape == a.shape and d.dtype.isnative
            np.testing.assert_array_equal(np.asarray(d), a)
    copied.clear()
    back = packed.to_host([d for d in on_device if d is not None])
    assert [n for way, kind, (n,) in copied if way == "out" and kind == np.uint8] == [
        a.nbytes for a in arrays if a is not None and a.size]
    for a, h in zip([a for a in arrays if a is not None], back, strict=True):
        assert type(h) is np.ndarray and h.shape == a.shape and h.base is None
        np.testing.assert_array_equal(h, a)


def test_packed_copies_refill_their_pinned_buffer_only_once_its_copy_is_done():
    """The current stream's copies run only when waited for (as a GPU may run them late): a second call's arrays
    are put in the pinned buffer only after the first call's copy out of it ran, and the gradients are read out
    of theirs only after their copies, queued behind the work that computed them, ran."""
    from lstmgrad_cli.backends._cupy_copies import PackedCopies

    cp = cuda_host.fake_cupy(queued_current=True)
    packed = PackedCopies(cp, np.empty)
    first = [np.arange(6, dtype=np.float32), np.full((2, 2), 3, np.int64)]
    second = [np.arange(6, dtype=np.float32)[::-1] * 2, np.full((2, 2), 9, np.int64)]
    on_device = packed.to_device(first) + packed.to_device(second)
    cp.cuda.get_current_stream().synchronize()
    for a, d in zip(first + second, on_device, strict=True):
        np.testing.assert_array_equal(np.asarray(d), a)
    device = cp.zeros(1000, np.float32)
    cp.cuda.get_current_stream().pending.append(lambda: device.view(np.ndarray).fill(7))  # computed, not yet run
    (host,) = packed.to_host([device])
    np.testing.assert_array_equal(host, np.full(1000, 7, np.float32))


def test_a_chunk_feed_copies_a_chunk_while_the_device_still_computes_the_one_before():
    """``ChunkFeed.take(j)`` copies chunk j into the buffers chunk j-2 used: after the device's work on chunk j-2
    (queued on the current stream before chunk j-1's), never after chunk j-1's, which its copies overlap; so on
    through five chunks.  The stand-in's current stream runs what is queued on it only when an event after it is
    waited for."""
    from lstmgrad_cli.backends._cupy_copies import FED, ChunkFeed, PinnedCopies, fed_rows
    from lstmgrad_cli.backends._xp import chunk_bounds
    from lstmgrad_cli.spec import TIME_MAJOR

    assert sorted(FED) == sorted(TIME_MAJOR)  # (what the backend leaves on the host is what the feed copies)
    cp = cuda_host.fake_cupy()
    t = SeqTensors(**_random_inputs(np.random.default_rng(4), 10, 2, 3, 4, np.float32))
    chunks = chunk_bounds(10, 2)  # [8, 10), [6, 8), ..., [0, 2)
    feed = ChunkFeed(cp, PinnedCopies(cp, np.empty, slice_bytes=40, threads=1), t, chunks, 2)
    current, seen = cp.cuda.get_current_stream(), []
    for j, (lo, hi) in enumerate(chunks):
        rows = feed.take(j)
        assert [k for k, _ in seen] == list(range(j - 1))  # chunks before the one before: done; that one: not
        for name in ("i", "cs", "h", "x", "h_grad"):
            a, b = fed_rows(name, lo, hi)
            np.testing.assert_array_equal(rows[name], getattr(t, name)[a:b], err_msg=f"{name}, chunk {j}")
        # chunk j's kernels, queued: they read its rows when the device gets to them
        current.pending.append(lambda j=j, rows=rows: seen.append((j, np.array(rows["cs"]))))
    current.synchronize()
    for j, cs in seen:  # what each chunk's work read was its own rows, not a later chunk's
        a, b = fed_rows("cs", *chunks[j])
        np.testing.assert_array_equal(cs, t.cs[a:b], err_msg=f"chunk {j}")
    assert [j for j, _ in seen] == list(range(len(chunks)))


@pytest.mark.parametrize("eager", [False, True])
def test_a_chunk_feed_reads_a_lazy_inputs_rows_into_pinned_buffers_and_copies_them_from_there(eager):
    """A lazy input's rows (an HDF5 dataset's, a stored NPZ member's) are read into a pinned buffer kept for the pass
    and cross from it as they are (no staging copy: one DMA of the rows, in their dtype), each while the next one is
    read; a host array's still cross through the staging buffers.  Through five chunks, with copies run late or at
    once, every chunk's rows arrive as read: no buffer is read again before its copy is done."""
    from lstmgrad_cli.backends._cupy_copies import ChunkFeed, PinnedCopies, fed_rows
    from lstmgrad_cli.backends._xp import chunk_bounds
    from lstmgrad_cli.backends.conformance import LazyRows

    copied, pinned = [], []

    def pinned_empty(shape, dtype):
        pinned.append((tuple(shape), np.dtype(dtype)))
        return np.empty(shape, dtype)

    cp = cuda_host.fake_cupy(copied=copied, eager_copies=eager)
    arrays = _random_inputs(np.random.default_rng(6), 10, 2, 3, 4, np.float32)
    lazy = ("i", "cs", "x")
    t = SeqTensors(**{k: LazyRows(v) if k in lazy else v for k, v in arrays.items()})
    chunks = chunk_bounds(10, 2)
    feed = ChunkFeed(cp, PinnedCopies(cp, pinned_empty, slice_bytes=40, threads=1), t, chunks, 2)
    for j, (lo, hi) in enumerate(chunks):
        copied.clear()
        rows = feed.take(j)
        for name in ("i", "cs", "x", "f", "h_grad"):
            a, b = fed_rows(name, lo, hi)
            np.testing.assert_array_equal(rows[name], arrays[name][a:b], err_msg=f"{name}, chunk {j}")
        straight = sorted(shape for way, kind, shape in copied if way == "in" and kind == np.float32)
        want = sorted((fed_rows(name, lo, hi)[1] - fed_rows(name, lo, hi)[0], *arrays[name].shape[1:])
                      for name in lazy)
        assert straight == want, j  # the lazy rows, each in one copy of its own; the rest staged (bytes)
    buffers = sorted(shape for shape, dtype in pinned if dtype == np.float32)  # (the staging buffers' are bytes)
    assert buffers == sorted((3, *arrays[name].shape[1:]) for name in lazy)  # one a lazy input, of K + 1 rows


@pytest.mark.parametrize("eager", [False, True])
def test_a_chunk_feed_copies_rows_back_once_computed_and_writes_them_without_reusing_a_buffer_in_flight(eager):
    """``ChunkFeed.put``: a chunk's device rows (queued on the current stream) go back on a stream of their own after
    what the current stream has queued, through two pinned buffers taken in turn; they reach the target two puts
    later or at ``close``.  The stand-in's copy stream runs a copy only when an event after it is waited for, or
    (``eager``) at once: a copy run before its product, or into a buffer whose rows are still to be written out,
    shows in the target."""
    from lstmgrad_cli.backends._cupy_copies import ChunkFeed, PinnedCopies
    from lstmgrad_cli.backends._xp import chunk_bounds

    cp = cuda_host.fake_cupy(eager_copies=eager)
    t = SeqTensors(**_random_inputs(np.random.default_rng(4), 6, 2, 3, 4, np.float32))
    feed = ChunkFeed(cp, PinnedCopies(cp, np.empty), t, chunk_bounds(6, 2), 2)
    current, target = cp.cuda.get_current_stream(), np.zeros((6, 2, 3), np.float32)
    for j, (lo, hi) in enumerate(chunk_bounds(6, 2)):
        rows = cp.zeros((2, 2, 3), np.float32)
        current.pending.append(lambda rows=rows, j=j: rows.view(np.ndarray).fill(j + 1))  # its product, queued
        feed.put(target, lo, hi, rows)
        assert not target[lo:hi].any()
        if j == 2:  # the first chunk's rows were written out before their buffer was taken again
            np.testing.assert_array_equal(target[4:6], 1)
            assert not target[:4].any()
    feed.close()
    np.testing.assert_array_equal(target, np.repeat([3, 2, 1], 2)[:, None, None] * np.ones((6, 2, 3)))


@needs_host_kernels
@pytest.mark.parametrize("loop", ["steps", "persistent"])
@pytest.mark.parametrize("peephole, seq_len_max, dtype", [(True, 13, "float32"), (False, 9, "float16"),
                                                          (True, 2, "float64")])
def test_host_inputs_fed_a_chunk_at_a_time_give_the_gradients_of_the_whole_copy(loop, peephole, seq_len_max, dtype):
    """Host arrays through the pinned buffers, on a device that cannot hold them whole: the time-major ones cross a
    chunk of steps at a time, STREAM_CHUNKS chunks (``ChunkFeed``), the device holding two chunks of them; the
    gradients are the numpy backend's with the same chunks (float16 computed in float32)."""
    from lstmgrad_cli.backends._cupy import STREAM_CHUNKS, device_bytes
    from lstmgrad_cli.spec import TIME_MAJOR

    T, B, I, C = 13, 3, 4, 5  # noqa: E741
    tensors = SeqTensors(**_random_inputs(np.random.default_rng(7), T, B, I, C, dtype))
    cdt = np.dtype("float32" if dtype == "float16" else dtype)
    kw = dict(seq_len_max=seq_len_max, use_peephole=peephole, layout="icfo", compute_dtype=cdt)
    K = -(-seq_len_max // STREAM_CHUNKS)
    want = NumpyBackend().block_lstm_grad(tensors, **kw, chunk_steps=K)
    copied = []
    free = device_bytes(tensors, seq_len_max, cdt) - 1
    got = cuda_host.cupy_backend(loop=loop, pinned=True, copied=copied, free_bytes=free).block_lstm_grad(tensors, **kw)
    for field, a, b in zip(want._fields, want, got, strict=True):
        assert type(b) is np.ndarray and b.dtype == a.dtype
        np.testing.assert_allclose(b, a, rtol=1e-5 if dtype != "float16" else 2e-3, atol=1e-6, err_msg=field)
    staged = [shape[0] for way, kind, shape in copied if way == "in" and kind == np.uint8]
    itemsize = np.dtype(dtype).itemsize
    assert max(staged) == max((I + C) * 4 * C * itemsize, (K + 1) * B * C * itemsize)  # w, or cs's rows of a chunk
    # the feed's two sets of K + 1 steps of every time-major tensor, and x_grad's rows of two chunks on their way back
    # (in the compute dtype, then the output's), in place of the whole tensors
    fed = sum((2 * (K + 1) - T) * getattr(tensors, name)[0].nbytes for name in TIME_MAJOR)
    back = 2 * K * B * I * (cdt.itemsize + itemsize)
    assert device_bytes(tensors, seq_len_max, cdt, x_grad_streamed=True, streamed_steps=K) == \
        device_bytes(tensors, seq_len_max, cdt, x_grad_streamed=True) + fed + back


@needs_host_kernels
def test_a_pass_fed_a_chunk_at_a_time_needs_only_two_chunks_of_its_inputs_on_the_device():
    """A sequence whose inputs the device could not hold whole runs, fed a chunk at a time; copied at once it is
    refused before anything is copied."""
    from lstmgrad_cli.backends._cupy import WORKING_BYTES, CupyBackend

    T, B, I, C = 64, 4, 8, 8  # noqa: E741
    tensors = SeqTensors(**_random_inputs(np.random.default_rng(8), T, B, I, C, np.float32))
    inputs = sum(a.nbytes for a in tensors)
    kw = dict(seq_len_max=T, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    free = WORKING_BYTES + inputs // 2
    for copies in ("pinned", "pageable"):
        backend = CupyBackend(cp=cuda_host.fake_cupy(free_bytes=free), launcher=cuda_host.HostLauncher(),
                              copies=copies, pinned_empty=np.empty)
        if copies == "pageable":
            with pytest.raises(BackendUnavailableError, match="^the problem needs about .* of GPU memory"):
                backend.block_lstm_grad(tensors, **kw)
        else:
            got = backend.block_lstm_grad(tensors, **kw)
            np.testing.assert_allclose(got.w_grad, NumpyBackend().block_lstm_grad(tensors, **kw, chunk_steps=8).w_grad,
                                       rtol=1e-5, atol=1e-5)


@needs_host_kernels
@pytest.mark.parametrize("chunk_steps", [64, 1000])
def test_a_pass_of_one_chunk_is_copied_at_once_not_fed(chunk_steps):
    """Chunks of all the steps (``chunk_steps`` >= seq_len_max): nothing to overlap, so the inputs are copied at once,
    not fed (the feed would hold two sets of all the steps); the device's free memory for that copy suffices."""
    from lstmgrad_cli.backends._cupy import CupyBackend, device_bytes

    T, B, I, C = 64, 4, 8, 8  # noqa: E741
    tensors = SeqTensors(**_random_inputs(np.random.default_rng(8), T, B, I, C, np.float32))
    kw = dict(seq_len_max=T, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    copied = []
    backend = CupyBackend(cp=cuda_host.fake_cupy(copied=copied, free_bytes=device_bytes(tensors, T, np.float32)),
                          launcher=cuda_host.HostLauncher(), copies="pinned", pinned_empty=np.empty)
    got = backend.block_lstm_grad(tensors, **kw, chunk_steps=chunk_steps)
    want = NumpyBackend().block_lstm_grad(tensors, **kw, chunk_steps=chunk_steps)
    np.testing.assert_allclose(got.w_grad, want.w_grad, rtol=1e-5, atol=1e-5)
    staged = sum(shape[0] for way, kind, shape in copied if way == "in" and kind == np.uint8)
    assert staged == sum(a.nbytes for a in tensors)


def test_the_cupy_backends_copies_are_named_by_the_environment(monkeypatch):
    from lstmgrad_cli.backends._cupy import COPIES_ENV

    monkeypatch.setenv(COPIES_ENV, "zero-copy")
    with pytest.raises(BackendUnavailableError, match="^LSTMGRAD_CUPY_COPIES='zero-copy' is not one of auto, "
                                                      "pageable, pinned$"):
        from lstmgrad_cli.backends._cupy import CupyBackend

        CupyBackend(cp=cuda_host.fake_cupy())


@needs_host_kernels
def test_cupy_copies_a_calls_host_arrays_through_pinned_buffers_from_32_mb_by_default(monkeypatch):
    """LSTMGRAD_CUPY_COPIES unset ("auto"): inputs of less than PINNED_LEAST_BYTES in all cross packed into one copy
    (``PackedCopies``: one pinned buffer, no ``asarray``), larger ones through the pinned staging buffers: all at
    once where the device holds the pass whole, else the time-major ones a chunk of steps at a time and the rest
    packed; the gradients back by the same rule."""
    from lstmgrad_cli.backends._cupy import COPIES_ENV, PINNED_LEAST_BYTES, STREAM_CHUNKS, CupyBackend, device_bytes
    from lstmgrad_cli.backends._cupy_copies import FED, PACK_ALIGN, fed_rows
    from lstmgrad_cli.backends._xp import chunk_bounds
    from lstmgrad_cli.spec import TIME_MAJOR

    def packed(arrays):  # the bytes of one packed copy of these arrays
        return sum(-(-a.nbytes // PACK_ALIGN) * PACK_ALIGN for a in arrays if a is not None)

    monkeypatch.delenv(COPIES_ENV, raising=False)
    kw = dict(use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    for T, B, I, C, room in ((4, 3, 5, 6, True), (40, 128, 512, 128, True), (40, 128, 512, 128, False)):  # noqa: E741
        tensors = SeqTensors(**_random_inputs(np.random.default_rng(2), T, B, I, C, np.float32))
        inputs = sum(a.nbytes for a in tensors if a is not None)
        copies, copied = [], []
        whole = device_bytes(tensors, T, np.float32)
        cp = cuda_host.fake_cupy(copies=copies, copied=copied, free_bytes=whole if room else whole - 1)
        backend = CupyBackend(cp=cp, launcher=cuda_host.HostLauncher(), pinned_empty=np.empty)
        got = backend.block_lstm_grad(tensors, seq_len_max=T, **kw)
        want = NumpyBackend().block_lstm_grad(tensors, seq_len_max=T, **kw)
        np.testing.assert_allclose(got.x_grad, want.x_grad, rtol=1e-5, atol=1e-6)
        staged = [c for c in copied if c[0] == "in" and c[1] == np.uint8]  # (a staging buffer's slices, packed ones)
        packed_back = [c for c in copied if c[0] == "out" and c[1] == np.uint8]
        assert copies.count("in") == 0 and copies.count("out") == 0  # (never cupy's own copies)
        if (T, B) == (4, 3):
            assert inputs < PINNED_LEAST_BYTES
            assert staged == [("in", np.uint8, (packed(tensors),))]  # one copy in
            assert sorted(n for _, _, (n,) in packed_back) == sorted(a.nbytes for a in got if a is not None)
        elif room:  # every input at once through them; the gradients (under 32 MB) back packed
            assert T * B * I * 4 < PINNED_LEAST_BYTES <= inputs  # (x alone would not be, the call's inputs are)
            assert sum(c[2][0] for c in staged) == inputs
            assert len(packed_back) == 8
        else:  # the time-major tensors fed a chunk of steps at a time through them, the rest packed
            K = -(-T // STREAM_CHUNKS)
            fed = sum(np.subtract(*reversed(fed_rows(name, lo, hi))) * getattr(tensors, name)[0].nbytes
                      for lo, hi in chunk_bounds(T, K) for name in FED)
            rest = packed(a for name, a in tensors._asdict().items() if name not in TIME_MAJOR)
            assert ("in", np.uint8, (rest,)) in staged
            assert sum(c[2][0] for c in staged) == fed + rest and max(c[2][0] for c in staged) <= (K + 1) * B * I * 4
            # x_grad's rows back a chunk at a time, as they are computed; the other gradients packed
            back = [shape for way, _, shape in copied if way == "out" and len(shape) == 3]
            assert sum(n for n, *_ in back) == T and max(n for n, *_ in back) <= K
            assert len(packed_back) == 7
        # the same gradients, bit for bit, as cupy's own copies give (fed: as the staging buffers alone give)
        plain = CupyBackend(cp=cuda_host.fake_cupy(free_bytes=whole if room else whole - 1),
                            launcher=cuda_host.HostLauncher(), copies="pageable" if room else "pinned",
                            pinned_empty=np.empty).block_lstm_grad(tensors, seq_len_max=T, **kw)
        for field, a, b in zip(plain._fields, plain, got, strict=True):
            np.testing.assert_array_equal(b, a, err_msg=field)


def test_the_device_memory_of_a_pass_counts_its_chunk_buffers_beyond_the_hosts_budget():
    """``device_bytes``: WORKING_BYTES holds chunk buffers of up to the host's CHUNK_BYTES; a persistent loop's
    larger budget, or chunks asked for, add what their buffers take beyond it (three times that with lazy inputs);
    a small pass needs the same whatever the budget."""
    from lstmgrad_cli.backends._cupy import PERSISTENT_CHUNK_BYTES, device_bytes
    from lstmgrad_cli.backends._xp import CHUNK_BYTES, chunk_step_bytes
    from lstmgrad_cli.backends.conformance import LazyRows

    def shaped(T, B, I, C):  # noqa: E741 - arrays of these shapes with no memory behind them
        shapes = {"x": (T, B, I), "w": (I + C, 4 * C), "b": (4 * C,), "cs_prev": (B, C), "h_prev": (B, C),
                  "wci": (C,), "wcf": (C,), "wco": (C,)}
        return SeqTensors(**{name: np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, (0,) * len(shape))
                             for name in SeqTensors._fields for shape in [shapes.get(name, (T, B, C))]})

    big = shaped(1000, 64, 512, 512)
    step = chunk_step_bytes(64, 512, 4, 512)
    host = device_bytes(big, 1000, np.float32)
    assert device_bytes(big, 1000, np.float32, chunk_budget=PERSISTENT_CHUNK_BYTES) - host == 500 * step - CHUNK_BYTES
    assert device_bytes(big, 1000, np.float32, chunk_steps=1000) - host == 1000 * step - CHUNK_BYTES
    lazy = big._replace(i=LazyRows(big.i))
    assert device_bytes(lazy, 1000, np.float32, chunk_budget=PERSISTENT_CHUNK_BYTES) - device_bytes(
        lazy, 1000, np.float32) == 3 * (500 * step - CHUNK_BYTES)
    small = shaped(50, 32, 128, 128)
    assert device_bytes(small, 50, np.float32, chunk_budget=PERSISTENT_CHUNK_BYTES) == device_bytes(
        small, 50, np.float32)


@needs_host_kernels
def test_cupy_refuses_a_problem_larger_than_the_free_gpu_memory_before_copying_it():
    from lstmgrad_cli.backends._cupy import WORKING_BYTES, device_bytes

    inputs = _random_inputs(np.random.default_rng(3), 50, 8, 16, 32, np.float32)
    tensors = SeqTensors(**inputs)
    kw = dict(seq_len_max=50, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    need = device_bytes(tensors, 50, np.float32)
    assert need - WORKING_BYTES >= sum(a.nbytes for a in inputs.values())
    copies = []
    with pytest.raises(BackendUnavailableError, match=r"^the problem needs about \d+ MB of GPU memory and 100 MB are "
                                                      r"free: compute it on the host \(backend numpy or numba\)"):
        cuda_host.cupy_backend(free_bytes=100 * 2**20, copies=copies).block_lstm_grad(tensors, **kw)
    assert copies == []  # refused before anything reached the device
    got = cuda_host.cupy_backend(free_bytes=need, copies=copies).block_lstm_grad(tensors, **kw)
    assert copies.count("in") == sum(1 for a in tensors if a is not None) and copies.count("out") == 8
    np.testing.assert_array_equal(got.w_grad, NumpyBackend().block_lstm_grad(tensors, **kw).w_grad)


@needs_host_kernels
def test_cupy_asks_the_driver_for_free_memory_again_only_for_a_pass_that_could_not_fit_its_last_answer():
    """Passes in a row that need at most half the free memory the driver reported under a second ago are weighed
    against that answer; a larger one asks again (and is refused when it does not fit)."""
    from lstmgrad_cli.backends._cupy import WORKING_BYTES, CupyBackend, device_bytes

    class Device:
        asked = 0
        free = 2 * (WORKING_BYTES + 2**20)  # half of it: what a pass needs beyond its arrays, and 1 MB

        @property
        def mem_info(self):
            Device.asked += 1
            return (Device.free, 2 * Device.free)

    cp = cuda_host.fake_cupy()
    cp.cuda.Device = Device
    backend = CupyBackend(cp=cp, launcher=cuda_host.HostLauncher())
    kw = dict(use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    small = SeqTensors(**_random_inputs(np.random.default_rng(3), 4, 3, 5, 6, np.float32))
    for _ in range(3):
        backend.block_lstm_grad(small, seq_len_max=4, **kw)
    assert Device.asked == 1
    assert device_bytes(small, 4, np.float32) < WORKING_BYTES + 2**20
    large = SeqTensors(**_random_inputs(np.random.default_rng(3), 40, 32, 64, 64, np.float32))
    assert WORKING_BYTES + 3 * 2**20 < device_bytes(large, 40, np.float32) < WORKING_BYTES + 6 * 2**20
    Device.free = WORKING_BYTES + 2**20  # (another program took the rest meanwhile)
    with pytest.raises(BackendUnavailableError, match="the problem needs about"):
        backend.block_lstm_grad(large, seq_len_max=40, **kw)
    assert Device.asked == 2


@needs_host_kernels
def test_inputs_already_on_the_gpu_are_not_counted_again_against_its_free_memory():
    """The layer engine hands the backend its activations on the device: only what the pass adds must fit."""
    from lstmgrad_cli.backends._cupy import device_bytes

    inputs = _random_inputs(np.random.default_rng(3), 50, 8, 16, 32, np.float32)
    tensors = SeqTensors(**inputs)
    kw = dict(seq_len_max=50, use_peephole=False, layout="ifco", compute_dtype=np.dtype("float32"))
    free = device_bytes(tensors, 50, np.float32) - sum(a.nbytes for a in inputs.values())
    with pytest.raises(BackendUnavailableError, match="GPU memory"):
        cuda_host.cupy_backend(free_bytes=free).block_lstm_grad(tensors, **kw)
    backend = cuda_host.cupy_backend(free_bytes=free)
    there = SeqTensors(**{name: backend.to_device(a) for name, a in inputs.items()})
    got = backend.block_lstm_grad(there, **kw)
    np.testing.assert_array_equal(backend.to_host(got.w_grad), NumpyBackend().block_lstm_grad(tensors, **kw).w_grad)


@needs_host_kernels
def test_a_gpu_out_of_memory_is_one_line_naming_what_to_do():
    cupy = pytest.importorskip("cupy")
    fake = cuda_host.fake_cupy()

    def out_of_memory(*args, **kwargs):
        raise cupy.cuda.memory.OutOfMemoryError(2**30, 2**29, 2**31)

    fake.asarray = fake.empty = out_of_memory  # (the first device memory a pass asks for, whichever way it copies)
    from lstmgrad_cli.backends._cupy import CupyBackend

    inputs = _random_inputs(np.random.default_rng(3), 3, 2, 4, 5, np.float32)
    with pytest.raises(BackendUnavailableError, match=r"^the GPU ran out of memory \(Out of memory allocating "
                                                      r"1,073,741,824 bytes.*\): compute it on the host") as caught:
        CupyBackend(cp=fake, launcher=cuda_host.HostLauncher()).block_lstm_grad(
            SeqTensors(**inputs), seq_len_max=3, use_peephole=False, layout="ifco", compute_dtype=np.float32)
    assert "\n" not in str(caught.value)


def test_auto_says_what_it_passed_over(runner, tmp_path):
    if not reg.status("cupy", probe_device=False).available or _gpu_usable():
        pytest.skip("needs cupy installed and no usable GPU")
    out = tmp_path / "g.npz"
    result = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out), "--backend", "auto",
                                  "--json"])
    doc = json.loads(result.stdout)["results"][0]
    assert doc["backend"] in ("numba", "numpy")
    assert (f"backend auto: {reg.status('cupy').reason}; used {doc['backend']}") in doc["notes"]
    plain = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(out), "--force", "--json"])
    assert not any("backend auto" in note for note in json.loads(plain.stdout)["results"][0]["notes"])
    refused = runner.invoke(main, ["seq", str(FIXTURES / "seq_v2_peep.in.npz"), "-o", str(tmp_path / "h.npz"),
                                   "--backend", "cupy"])
    assert refused.exit_code == 1 and refused.stderr == f"Error: {reg.status('cupy').reason}\n"
    assert not (tmp_path / "h.npz").exists()


def test_backends_check_builds_every_kernel(runner):
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings and nvidia-cuda-nvrtc (the dev extra)")
    result = runner.invoke(main, ["backends", "--check", "--arch", "sm_90", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    builds = {b["backend"]: b for b in doc["builds"]}
    assert doc["ok"] and builds["numpy"]["ok"] and "meets the backend contract" in builds["numpy"]["detail"]
    assert builds["cupy"] == {"backend": "cupy", "target": "sm_90", "kernels": len(_cupy_kernels.KERNELS), "ok": True,
                              "detail": builds["cupy"]["detail"]}
    if HAVE_NUMBA:
        assert builds["numba"]["ok"] and builds["numba"]["kernels"] == 8
    table = runner.invoke(main, ["backends", "--check", "--arch", "sm_75"])
    assert table.exit_code == 0 and "cupy" in table.stdout and "sm_75" in table.stdout


def test_backends_check_without_a_gpu_or_an_arch_builds_no_cupy_kernel(runner):
    if reg.status("cupy").available:
        pytest.skip("a GPU is usable here")
    result = runner.invoke(main, ["backends", "--check", "--json"], catch_exceptions=False)
    builds = {b["backend"]: b for b in json.loads(result.stdout)["builds"]}
    assert result.exit_code == 0 and builds["cupy"]["ok"] is None and "arch" in builds["cupy"]["detail"]


@pytest.mark.parametrize("args, message", [
    (["--check", "--arch", "sm_20"], "is not one this NVRTC compiles for"),
    (["--check", "--arch", "volta"], "is not an architecture such as sm_90"),
    (["--arch", "sm_90"], "give --check too"),
])
def test_backends_check_refuses_an_unknown_architecture(runner, args, message):
    if "--check" in args:
        pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings and nvidia-cuda-nvrtc")
    result = runner.invoke(main, ["backends", *args])
    assert result.exit_code == 2 and message in result.stderr


def test_backends_check_fails_when_a_kernel_fails(runner, plugins):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = runner.invoke(main, ["backends", "--check", "--json"], catch_exceptions=False)
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    builds = {b["backend"]: b for b in doc["builds"]}
    assert not doc["ok"] and builds["kernfail"]["ok"] is False
    assert builds["kernfail"]["detail"] == "RuntimeError: kernel 'step' did not compile"
    assert builds["boom"]["ok"] is False and "plugin exploded" in builds["boom"]["detail"]
    assert builds["myplug"]["ok"] and "meets the backend contract" in builds["myplug"]["detail"]
    assert builds["gone"]["ok"] is None


@pytest.mark.gpu
@pytest.mark.skipif("not _gpu_usable()", reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("name", SEQ_CASES + CELL_CASES)
def test_cupy_on_gpu_matches_the_fixtures(name):
    inputs, expected, case = load_case(name)
    if case["kind"] == "seq":
        got = _run_seq("cupy", inputs, case["layout"])
    else:
        got = lg.lstm_block_cell_grad_full(**{k: v for k, v in inputs.items() if k != "h"}, backend="cupy")
    for field, want in expected.items():
        assert_close_scaled(getattr(got, field), want, name=field)


@pytest.mark.gpu
@pytest.mark.skipif("not _gpu_usable()", reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("peephole", [False, True])
def test_cupy_on_gpu_matches_numpy_on_a_larger_shape(peephole):
    inputs = _random_inputs(np.random.default_rng(5), 7, 33, 17, 40, np.float32)
    kw = dict(seq_len_max=6, use_peephole=peephole, layout="ifco", compute_dtype=np.dtype("float32"))
    want = NumpyBackend().block_lstm_grad(SeqTensors(**inputs), **kw)
    got = reg.get_backend("cupy").block_lstm_grad(SeqTensors(**inputs), **kw, chunk_steps=4)
    for field, a, b in zip(want._fields, want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(a).max(initial=0))),
                                   err_msg=field)


@pytest.mark.gpu
@pytest.mark.skipif("not _gpu_usable()", reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("loop", ["steps", "persistent"])
def test_cupy_on_gpu_feeds_lazy_inputs_a_chunk_at_a_time_and_matches_numpy(loop):
    """On a GPU: an HDF5-like lazy input's time-major rows are fed through the pinned buffers in chunks (ChunkFeed,
    its streams and events real), x_grad back the same way; host arrays the GPU can hold cross through the same
    buffers at once; the gradients are the numpy backend's with the feed's chunks."""
    from lstmgrad_cli.backends._cupy import STREAM_CHUNKS, CupyBackend
    from lstmgrad_cli.backends.conformance import LazyRows
    from lstmgrad_cli.spec import TIME_MAJOR

    T, B, I, C = 45, 24, 20, 36  # noqa: E741
    inputs = _random_inputs(np.random.default_rng(9), T, B, I, C, np.float32)
    kw = dict(seq_len_max=41, use_peephole=True, layout="ifco", compute_dtype=np.dtype("float32"))
    want = NumpyBackend().block_lstm_grad(SeqTensors(**inputs), **kw, chunk_steps=-(-41 // STREAM_CHUNKS))
    backend = CupyBackend(loop=loop, copies="pinned")
    lazy = {k: LazyRows(v) if k in TIME_MAJOR else v for k, v in inputs.items()}
    for arrays in (inputs, lazy):
        got = backend.block_lstm_grad(SeqTensors(**arrays), **kw)
        for field, a, b in zip(want._fields, want, got, strict=True):
            assert type(b) is np.ndarray
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(a).max(initial=0))),
                                       err_msg=field)


@pytest.mark.gpu
@pytest.mark.skipif("not _gpu_usable()", reason="needs cupy and a CUDA device")
def test_cupy_on_gpu_streams_a_large_npz_file_and_gives_the_numpy_backends_gradients(tmp_path, monkeypatch):
    """On a GPU, file to file: an NPZ input's large members stay in the file (read into the feed's pinned buffers,
    their CRC-32 checked) and the gradients are the numpy backend's; a flipped byte is the one-line CRC error."""
    from lstmgrad_cli.operations.grad import GradOptions, run_grad_file

    T, B, I, C = 40, 64, 32, 256  # noqa: E741  (2.5 MiB a time-major member)
    inputs = _random_inputs(np.random.default_rng(11), T, B, I, C, np.float32)
    src = tmp_path / "in.npz"
    np.savez(src, **inputs, seq_len_max=np.int64(T), use_peephole=np.bool_(True))
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")  # members from 1 MiB left in the file
    options = {name: GradOptions("seq", backend=name, layout="ifco", force=True) for name in ("numpy", "cupy")}
    for name, option in options.items():
        run_grad_file(src, tmp_path / f"{name}.npz", option)
    with np.load(tmp_path / "numpy.npz") as want, np.load(tmp_path / "cupy.npz") as got:
        for key in ("x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "b_grad"):
            a = want[key]
            np.testing.assert_allclose(got[key], a, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(a).max())),
                                       err_msg=key)
    raw = bytearray(src.read_bytes())
    raw[len(raw) // 2] ^= 1
    src.write_bytes(bytes(raw))
    with pytest.raises(InputFileError, match="is corrupt or truncated"):
        run_grad_file(src, tmp_path / "flipped.npz", options["cupy"])
    assert not (tmp_path / "flipped.npz").exists()


# -- arrays already on a GPU ------------------------------------------------------------------------

class _DeviceArrayLike:
    """Something that says it lives in GPU memory (``__cuda_array_interface__``) with no GPU behind it."""

    def __init__(self, a):
        self.shape, self.dtype = a.shape, a.dtype
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str, "data": (0, True), "version": 3}


def test_gpu_arrays_are_recognised_and_never_read_as_host_arrays():
    inputs, _, case = load_case("seq_v2_peep")
    inputs["x"] = _DeviceArrayLike(inputs["x"])
    assert reg.on_gpu(inputs["x"]) and not reg.on_gpu(inputs["w"])
    for backend in (None, "numpy", "numba"):
        with pytest.raises((lg.InvalidArgumentError, BackendUnavailableError), match="GPU") as caught:
            lg.block_lstm_grad_v2(**inputs, backend=backend)
        assert "\n" not in str(caught.value)


@pytest.mark.gpu
@pytest.mark.skipif("not _gpu_usable()", reason="needs cupy and a CUDA device")
@pytest.mark.parametrize("name", ["seq_v2_peep", "seq_v1_clip", "seq_v2_half", "cell_peep"])
def test_cupy_arrays_in_cupy_arrays_out(name):
    import cupy

    inputs, expected, case = load_case(name)
    on_device = {k: cupy.asarray(v) if isinstance(v, np.ndarray) and v.ndim else v for k, v in inputs.items()}
    if case["kind"] == "seq":
        got = _run_seq(None, on_device, case["layout"])  # no backend named: cupy, as the arrays are there
    else:
        got = lg.lstm_block_cell_grad_full(**{k: v for k, v in on_device.items() if k != "h"})
    for field, want in expected.items():
        value = getattr(got, field)
        assert isinstance(value, cupy.ndarray), field
        assert_close_scaled(cupy.asnumpy(value), want, name=field)
    with pytest.raises(lg.InvalidArgumentError, match="the numpy backend computes host arrays"):
        _run_seq("numpy", on_device, "ifco") if case["kind"] == "seq" else lg.lstm_block_cell_grad_full(
            **{k: v for k, v in on_device.items() if k != "h"}, backend="numpy")


@pytest.mark.gpu
@pytest.mark.skipif("not _gpu_usable()", reason="needs cupy and a CUDA device")
def test_a_keras_layer_and_a_torch_module_from_gpu_tensors_give_gpu_gradients():
    import cupy

    fixtures = Path(__file__).resolve().parent.parent / "fixtures"
    with np.load(fixtures / "keras" / "keras_seq.in.npz") as data:
        tensors = {k: data[k] for k in data.files}
    want = lg.keras_lstm_grad(**tensors, backend="numpy")
    got = lg.keras_lstm_grad(**{k: cupy.asarray(v) for k, v in tensors.items()})  # no backend named: cupy
    for name, value in got._asdict().items():
        assert isinstance(value, cupy.ndarray), name
        np.testing.assert_allclose(cupy.asnumpy(value), getattr(want, name), rtol=1e-5, atol=1e-6, err_msg=name)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        return
    lstm = torch.nn.LSTM(4, 3, num_layers=2, bidirectional=True)
    x = torch.randn(5, 2, 4)
    out, _ = lstm(x)
    h_grad = torch.randn_like(out)
    want = lg.torch_lstm_grad(x, state_dict=lstm.state_dict(), h_grad=h_grad, backend="numpy")
    got = lg.torch_lstm_grad(x.cuda(), state_dict=lstm.cuda().state_dict(), h_grad=h_grad.cuda())
    for name, value in want.items():
        assert isinstance(got[name], cupy.ndarray), name
        np.testing.assert_allclose(cupy.asnumpy(got[name]), value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.gpu
@pytest.mark.skipif("not _gpu_usable()", reason="needs cupy and a CUDA device")
def test_torch_cuda_tensors_and_the_forward_op_on_the_gpu():
    import cupy

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    inputs, expected, case = load_case("seq_v2_peep")
    tensors = {k: torch.as_tensor(v).cuda() if isinstance(v, np.ndarray) and v.ndim else v for k, v in inputs.items()}
    got = lg.block_lstm_grad_v2(**tensors)
    assert isinstance(got.x_grad, cupy.ndarray)
    assert_close_scaled(cupy.asnumpy(got.w_grad), expected["w_grad"], name="w_grad")
    forward = {k: cupy.asarray(inputs[k]) for k in ("x", "cs_prev", "h_prev", "w", "wci", "wcf", "wco", "b")}
    outs = lg.block_lstm_v2(inputs["seq_len_max"], **forward, use_peephole=True)
    host = lg.block_lstm_v2(inputs["seq_len_max"], **{k: cupy.asnumpy(v) for k, v in forward.items()},
                            use_peephole=True)
    for a, b in zip(outs, host, strict=True):
        assert isinstance(a, cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(a), b, rtol=1e-5, atol=1e-6)

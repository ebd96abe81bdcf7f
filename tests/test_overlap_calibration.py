"""From what size a host pass runs its time loop beside its chunk products: measured on this machine once and cached
(backends/overlap_calibration.py).  The measurement is real (both schedules timed on real passes); which size wins
depends on the machine, so the tests hold what follows from a measurement, never a machine's own answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lstmgrad_cli.backends import cpu_blas, overlap_calibration
from lstmgrad_cli.backends._numpy import NumpyBackend
from lstmgrad_cli.spec import SeqTensors

B, I, C = overlap_calibration.RUNG_SHAPE  # noqa: E741


def _rung_flops(T: int) -> int:
    return overlap_calibration.flops(T, B, I, C)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LSTMGRAD_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_the_threshold_is_the_smallest_size_the_overlap_won_at_and_at_the_next_size_too():
    slow, fast = {"sequential": 1.0, "overlapped": 1.2}, {"sequential": 1.0, "overlapped": 0.9}
    tie = {"sequential": 1.0, "overlapped": 0.99}  # (within the margin: not a win)
    assert overlap_calibration.decide({16: slow, 64: tie, 256: fast}) == _rung_flops(256)  # the largest: won
    assert overlap_calibration.decide({16: fast}) == _rung_flops(16)
    assert overlap_calibration.decide({16: slow, 64: tie}) == overlap_calibration.BEYOND * _rung_flops(64)
    # a win alone, the next size tied (the VM's noise): from the next two wins in a row
    assert overlap_calibration.decide({16: fast, 32: tie, 64: fast, 128: fast}) == _rung_flops(64)
    assert overlap_calibration.decide({16: fast, 32: slow, 64: fast, 128: tie, 256: fast}) == _rung_flops(256)


def test_a_real_measurement_times_both_schedules_up_to_two_wins_in_a_row():
    seconds = overlap_calibration.measure(rungs=(2, 3, 4), rounds=1)
    assert list(seconds)[:2] == [2, 3] and set(seconds) <= {2, 3, 4}
    if len(seconds) == 2:  # stopped after two rungs: both won
        assert all(t["overlapped"] * overlap_calibration.MARGIN < t["sequential"] for t in seconds.values())
    for times in seconds.values():
        assert set(times) == {"sequential", "overlapped"} and all(0 < s < 10 for s in times.values())
    won = overlap_calibration.decide(seconds)
    assert won in (*map(_rung_flops, seconds), overlap_calibration.BEYOND * _rung_flops(max(seconds)))


@pytest.mark.parametrize("python", [sys.executable, "/nonexistent/python"])
def test_the_measurement_runs_in_a_new_interpreter_or_here_when_none_starts(python):
    """A process that has just timed MKL for the BLAS choice times the sequential schedule slower: the threshold is
    measured where nothing ran before it, or here when no interpreter starts."""
    seconds = overlap_calibration.measure_fresh(rungs=(2, 3), rounds=1, python=python)
    assert list(seconds)[:2] == [2, 3] or list(seconds) == [2, 3]
    for times in seconds.values():
        assert set(times) == {"sequential", "overlapped"} and all(0 < s < 10 for s in times.values())


def test_measured_once_then_cached_per_machine_and_cores(cache):
    calls = []

    def measure_now():
        calls.append(1)
        return overlap_calibration.measure(rungs=(2,), rounds=1)

    first = overlap_calibration.threshold(2, measure_now)
    again = overlap_calibration.threshold(2, measure_now)
    assert len(calls) == 1 and again.flops == first.flops
    assert "measured now" in first.why and "cached" in again.why and overlap_calibration.CACHE_FILE in again.why
    entries = json.loads((cache / overlap_calibration.CACHE_FILE).read_text())["entries"]
    (entry_key, entry), = entries.items()
    assert json.loads(entry_key)["cores"] == 2 and json.loads(entry_key)["blas"] == cpu_blas.describe()
    assert set(entry["seconds"]) == {"2"}
    overlap_calibration.threshold(3, measure_now)  # other cores: measured again, both kept
    assert len(calls) == 2 and len(json.loads((cache / overlap_calibration.CACHE_FILE).read_text())["entries"]) == 2


def test_a_threshold_past_every_size_measured_says_so(cache):
    none_won = {16: {"sequential": 1.0, "overlapped": 1.5}, 64: {"sequential": 1.0, "overlapped": 1.2}}
    found = overlap_calibration.threshold(2, lambda: none_won)
    assert found.flops == overlap_calibration.BEYOND * _rung_flops(64)
    assert f"at no size measured, up to {_rung_flops(64):.2g} flops" in found.why


def test_an_unreadable_cache_is_measured_again(cache):
    (cache / overlap_calibration.CACHE_FILE).write_text('{"entries": {"x": 1}, "schema": 1')  # cut short
    calls = []
    overlap_calibration.threshold(2, lambda: calls.append(1) or {2: {"sequential": 1.0, "overlapped": 0.5}})
    assert calls == [1]
    entry = overlap_calibration.blas_calibration.cached(overlap_calibration.key(2), overlap_calibration.CACHE_FILE)
    assert entry["flops"] == _rung_flops(2)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two usable cores")
def test_overlapped_only_from_the_threshold_with_two_cores_and_two_blas_threads(cache):
    cores = cpu_blas.usable_cores()
    overlap_calibration.threshold(cores, lambda: {16: {"sequential": 1.0, "overlapped": 0.5}})  # won at rung 16
    at = _rung_flops(16)
    if cpu_blas.threads() >= 2:
        assert overlap_calibration.overlaps(at) and not overlap_calibration.overlaps(at - 1)
        assert "from 1.1e+09 flops" in overlap_calibration.describe()
    with cpu_blas.single_threaded():  # one BLAS thread (a batch worker's share): in sequence
        assert not overlap_calibration.overlaps(at * 100)
        assert "in sequence" in overlap_calibration.describe()
    # one usable core, in a real process whose affinity is one core
    code = ("import os; os.sched_setaffinity(0, {0}); from lstmgrad_cli.backends import overlap_calibration as o; "
            f"print(o.overlaps({at * 100}), o.describe())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "LSTMGRAD_CACHE_DIR": str(cache)}).stdout
    assert out.startswith("False time loop and products in sequence (1 core(s) usable"), out


def test_either_schedule_gives_the_same_bits():
    """What the threshold chooses never changes a result: the chunks depend on the shape alone (this one, of 3.4e8
    flops, is cut into the overlapped schedule's chunks, then run overlapped or not)."""
    rng = np.random.default_rng(5)
    T, b, i, c = 20, 32, 128, 128
    shapes = dict(x=(T, b, i), cs_prev=(b, c), h_prev=(b, c), w=(i + c, 4 * c), wci=(c,), wcf=(c,), wco=(c,),
                  b=(4 * c,), i=(T, b, c), cs=(T, b, c), f=(T, b, c), o=(T, b, c), ci=(T, b, c), co=(T, b, c),
                  h=(T, b, c), cs_grad=(T, b, c), h_grad=(T, b, c))
    t = SeqTensors(**{n: rng.uniform(-1, 1, s).astype(np.float32) for n, s in shapes.items()})
    kw = dict(seq_len_max=T, use_peephole=True, layout="ifco", compute_dtype=np.dtype(np.float32))
    results = [NumpyBackend(overlap=o).block_lstm_grad(t, **kw) for o in (True, False, None)]
    for other in results[1:]:
        for a, b_ in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a, b_)


def test_the_setting_overlaps_every_chunked_pass_or_none_without_measuring(cache, monkeypatch):
    monkeypatch.setenv(overlap_calibration.OVERLAP_ENV, "on")
    assert overlap_calibration.overlaps(1.0) and "LSTMGRAD_OVERLAP=on" in overlap_calibration.describe()
    monkeypatch.setenv(overlap_calibration.OVERLAP_ENV, "off")
    assert not overlap_calibration.overlaps(1e15) and "in sequence" in overlap_calibration.describe()
    assert not (cache / overlap_calibration.CACHE_FILE).exists()  # nothing measured
    monkeypatch.setenv(overlap_calibration.OVERLAP_ENV, "sometimes")
    with pytest.warns(UserWarning, match="LSTMGRAD_OVERLAP='sometimes' is not one of auto, on, off"):
        assert overlap_calibration.setting_of_env() == "auto"

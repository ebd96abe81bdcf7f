"""Which BLAS ``LSTMGRAD_BLAS=auto`` takes when MKL or oneDNN is installed beside numpy's OpenBLAS: the one a
backward pass is fastest on, measured once on this processor and cached (backends/blas_calibration.py).  Each case
is a real process (the choice is made once per process); what it chose and why is asked of it, and of its cache
file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lstmgrad_cli.backends import blas_calibration, cpu_blas

needs_both = pytest.mark.skipif(not cpu_blas.other_libraries() or cpu_blas.numpy_openblas() is None,
                                reason="needs the mkl wheel or oneDNN's beside numpy's OpenBLAS")

ASK = """
import json, os
from lstmgrad_cli.backends import cpu_blas
chosen = cpu_blas.describe()
print(json.dumps({"chosen": chosen, "why": cpu_blas.why_chosen(),
                  "loaded": [name for name in ("mkl", "onednn") if getattr(cpu_blas, name).cache_info().currsize],
                  "cores": cpu_blas.usable_cores()}))
"""


def _ask(cache, blas="auto", cores=None) -> dict:
    env = {**os.environ, "LSTMGRAD_CACHE_DIR": str(cache), cpu_blas.BLAS_ENV: blas}
    cmd = [sys.executable, "-c", ASK]
    if cores is not None:  # the process may use this many cores (the cache's key has them)
        cmd = [sys.executable, "-c", f"import os, sys; os.sched_setaffinity(0, {set(range(cores))!r}); "
                                     f"os.execv(sys.executable, {[sys.executable, '-c', ASK]!r})"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _entries(cache) -> dict:
    return json.loads((cache / blas_calibration.CACHE_FILE).read_text())["entries"]


@needs_both
def test_auto_measures_once_then_keeps_the_choice(tmp_path):
    first = _ask(tmp_path)
    ((key, entry),) = _entries(tmp_path).items()
    seconds = entry["seconds"]
    assert set(seconds) == {*cpu_blas.other_libraries(), "openblas"} and all(s > 0 for s in seconds.values())
    faster = min(seconds, key=seconds.get)
    if faster != "openblas" and seconds[faster] * blas_calibration.MARGIN >= seconds["openblas"]:
        faster = "openblas"  # not faster by the margin
    assert entry["library"] == faster
    assert first["chosen"].startswith({"mkl": "MKL ", "onednn": "oneDNN ", "openblas": "OpenBLAS (numpy's)"}[faster])
    assert "(measured now, " in first["why"] and str(tmp_path / blas_calibration.CACHE_FILE) in first["why"]
    again = _ask(tmp_path)
    assert again["chosen"] == first["chosen"] and "(cached, " in again["why"]
    assert _entries(tmp_path)[key] == entry  # not measured again
    assert json.loads(key)["processor"] == blas_calibration.processor()


@needs_both
@pytest.mark.parametrize("library", ["openblas", "mkl", "onednn"])
def test_a_cached_choice_is_taken_and_loads_no_other_library(tmp_path, library):
    installed = cpu_blas.other_libraries()
    if library != "openblas" and library not in installed:
        pytest.skip(f"{library} is not installed here")
    key = blas_calibration.key(installed, cpu_blas.usable_cores())
    seconds = {**dict.fromkeys([*installed, "openblas"], 3.0), library: 1.0}
    (tmp_path / blas_calibration.CACHE_FILE).write_text(json.dumps({"schema": 1, "entries": {key: {
        "library": library, "seconds": seconds, "measured": "2026-01-02"}}}))
    said = _ask(tmp_path)
    assert said["chosen"].startswith({"mkl": "MKL ", "onednn": "oneDNN ", "openblas": "OpenBLAS (numpy's)"}[library])
    assert said["why"].startswith("3.00x faster than ") and "(cached, 2026-01-02;" in said["why"]
    assert said["loaded"] == ([] if library == "openblas" else [library])


@needs_both
def test_another_core_count_is_measured_anew(tmp_path):
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs two cores and sched_setaffinity")
    all_cores = _ask(tmp_path)
    one_core = _ask(tmp_path, cores=1)
    assert one_core["cores"] == 1 and all_cores["cores"] > 1
    keys = [json.loads(k) for k in _entries(tmp_path)]
    assert sorted(k["cores"] for k in keys) == sorted([1, all_cores["cores"]])


@needs_both
def test_an_unreadable_cache_is_measured_again_and_rewritten(tmp_path):
    (tmp_path / blas_calibration.CACHE_FILE).write_text("{not json")
    said = _ask(tmp_path)
    assert "(measured now, " in said["why"] and len(_entries(tmp_path)) == 1


@pytest.mark.parametrize("blas, why", [("openblas", "LSTMGRAD_BLAS=openblas"), ("mkl", "LSTMGRAD_BLAS=mkl"),
                                       ("onednn", "LSTMGRAD_BLAS=onednn")])
def test_lstmgrad_blas_still_chooses_without_measuring(tmp_path, blas, why):
    if blas != "openblas" and blas not in cpu_blas.other_libraries():
        pytest.skip(f"needs {blas}'s wheel")
    said = _ask(tmp_path, blas=blas)
    assert said["why"] == why and not (tmp_path / blas_calibration.CACHE_FILE).exists()


def test_backends_says_which_library_and_why(runner):
    from lstmgrad_cli.cli import main

    doc = json.loads(runner.invoke(main, ["backends", "--json"], catch_exceptions=False).stdout)
    assert doc["host_blas"] == cpu_blas.describe() and doc["host_blas_why"] == cpu_blas.why_chosen()
    table = runner.invoke(main, ["backends"], catch_exceptions=False).stdout
    assert f"numpy and numba products on {cpu_blas.describe()}: {cpu_blas.why_chosen()}" in " ".join(table.split())

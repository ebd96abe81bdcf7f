"""`make gpu-check`: everything that needs a real GPU, in one run of under 5 minutes, ending in one table.

1. the device, its driver and the libraries;
2. `lstmgrad backends --check`: every kernel built for this GPU;
3. the suite's `gpu` tests (tests/test_backends.py);
4. every golden case of the suite (TensorFlow ops, Keras layers, PyTorch layers and whole modules) on cupy:
   tests/test_ops_golden.py, test_frameworks.py, test_modules.py and test_forward_cmd.py (the forward ops against
   TensorFlow's) with LSTMGRAD_TEST_BACKEND=cupy, the time loop as the backend chooses (in one launch for these
   small problems); and again with the time loop launched a step at a time from Python (LSTMGRAD_CUPY_LOOP=steps);
5. `lstmgrad bench` on the GPU for issue 39's six shapes (`make bench-gpu`'s, in two runs: the four small
   shapes, then the two large ones; medians of 3 rounds, to stay inside the budget): the cupy backend from host
   arrays (cupy's copies, and through pinned buffers), on device arrays (the loop it chooses, and each loop) and
   from one file to another, the PCIe floor and the GPU's own GEMM limit, PyTorch's cuDNN backward with TF32 off
   and on;
6. what a user waits for, numpy against cupy with its kernel cache warm (median of 3): `lstmgrad seq` on one
   small TF file and on one PyTorch layer file (issue 38: cupy within 1 s of numpy), and a batch of 100 small
   files (issue 39: no slower per file than numpy); and that batch in one process, the start-up left out
   (benchmarks/gpu_probe.py batch: numpy, cupy with cupy's own copies and with the packed ones, alternating);
7. where the time goes, as far as the budget allows: benchmarks/gpu_pass_parts.py (the device pass by its chunk
   size and the host path by its copies: at once, fed, by staging threads; beside cuDNN and the PCIe floor; a host
   array page-locked in place); benchmarks/gpu_loop_anatomy.py (the persistent loop's time per step, the grid
   barrier's, the elementwise phase's and the product phase's, and its answers against the loop of steps', for
   the six shapes; the loop by its split into row groups and by the loads in flight a thread; the host's profile
   of a small pass); benchmarks/gpu_copy_rates.py (host to device copy rates: cupy's, the DMA alone, the host's
   copy into pinned memory and the staging by thread count; a pass from host arrays fed in chunks against one
   chunk).  (benchmarks/gpu_chunk_sizes.py, the pass by its chunk budget, runs alone.)

Runs with the machine's own Python from the repository root (`make gpu-check PYTHON=python3` sets PYTHONPATH): the
device tool's machines have cupy, torch, numba, h5py, click, rich, pytest and hypothesis (2026-11-27, an H100);
elsewhere pytest and hypothesis come from build/gpu-pylibs when it is carried (`make gpu-pylibs` makes it here).
Paste what it prints into benchmarks/RESULTS.md with the card and the date.

The steps share a time budget (``--budget SECONDS``, 400 by default; a lent GPU's time is short): each step gets
at most what is left, and one left without time says so in the table, which is always printed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# issue 39's six shapes (make bench-gpu), timed in two runs so that a step stopped by its time keeps the first table
SHAPES = (("50,32,128,128", "100,64,256,256", "200,128,512,512", "500,16,256,256"),
          ("100,256,1024,1024", "1000,64,512,512"))
GOLDEN_TESTS = ("tests/test_ops_golden.py", "tests/test_frameworks.py", "tests/test_modules.py",
                "tests/test_forward_cmd.py")


class Budget:
    """The seconds left of the whole check: a step's timeout is at most what is left."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


BUDGET = Budget(400.0)
LEAST_SECONDS = 15.0  # a step given less than this is not started


def run(title: str, cmd: list[str], timeout: float, env: dict | None = None) -> tuple[str, str, float]:
    """(result word, its last lines, seconds) of one step, its output shown as it comes; its timeout at most the
    budget left."""
    timeout = min(timeout, BUDGET.left())
    if timeout < LEAST_SECONDS:
        return "SKIPPED", "no time left in the budget", 0.0
    print(f"\n== {title}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def echo():  # as it comes: a step stopped by its time still shows what it printed
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line.strip())

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(5)
        result = "TIMEOUT", f"stopped after {timeout:.0f} s", time.perf_counter() - start
    else:
        reader.join(5)
        tail = " / ".join(line for line in [line for line in lines if line][-2:])
        result = ("ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"), tail, \
            time.perf_counter() - start
    print(f"-- {title}: {result[0]} in {result[2]:.0f} s", flush=True)  # (the table comes at the end, if ever)
    return result


def wall(cmd: list[str], repeats: int = 3) -> float:
    """Median seconds of ``cmd`` over ``repeats`` runs, after one untimed run (it warms cupy's kernel cache);
    TimeoutExpired once the budget is spent."""
    times = []
    for k in range(repeats + 1):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=max(1.0, BUDGET.left()))
        if k:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def waits(python: str) -> tuple[str, str, float]:
    """(result, summary, seconds) of step 6: one small file and a batch of 100, numpy against cupy."""
    import tempfile  # noqa: PLC0415

    from bench_batch import write_inputs  # noqa: PLC0415 - benchmarks/, beside this script

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lstmgrad-gpu-check-") as tmp:
        folder = Path(tmp) / "in"
        write_inputs(folder, (20, 16, 64, 64), 100)
        runs = {"one TF file": ["fixtures/demo.h5", "--group", "lstm"],
                "one PyTorch layer file": ["fixtures/torch/torch_batch_first.in.npz", "--framework", "torch",
                                           "--batch-first"],
                "100 small files": [str(folder)]}
        parts, worst = [], 0.0
        for label, args in runs.items():
            seconds = {}
            for backend in ("numpy", "cupy"):
                out = Path(tmp) / f"out-{backend}"
                seconds[backend] = wall([python, "-m", "lstmgrad_cli", "seq", *args, "--backend", backend,
                                         "--out-dir", str(out), "--force", "-q"])
            worst = max(worst, seconds["cupy"] - seconds["numpy"])
            parts.append(f"{label}: numpy {seconds['numpy']:.2f} s, cupy {seconds['cupy']:.2f} s")
            print(parts[-1], flush=True)
    return "ok", "; ".join(parts), time.perf_counter() - start


def device_lines() -> list[str]:
    import cupy  # noqa: PLC0415 - the device machine has it

    lines = []
    for index in range(cupy.cuda.runtime.getDeviceCount()):
        props = cupy.cuda.runtime.getDeviceProperties(index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        lines.append(f"GPU {index}: {name}, sm_{props['major']}{props['minor']}, "
                     f"{props['totalGlobalMem'] / 2**30:.0f} GiB, {props['multiProcessorCount']} SMs")
    lines.append(f"driver {cupy.cuda.runtime.driverGetVersion()}, runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
                 f"cupy {cupy.__version__}")
    try:
        import torch  # noqa: PLC0415

        lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    except ImportError:
        lines.append("torch: not installed (no cuDNN comparison)")
    return lines


def main(argv: list[str]) -> int:
    global BUDGET
    if argv[:1] == ["--budget"] and len(argv) == 2:
        BUDGET = Budget(float(argv[1]))
    elif argv:
        print("usage: gpu_check.py [--budget SECONDS]", file=sys.stderr)
        return 2
    started = time.perf_counter()
    python = sys.executable
    print("lstmgrad gpu-check", time.strftime("%Y-%m-%d %H:%M"), flush=True)
    try:
        lines = device_lines()
    except Exception as err:  # noqa: BLE001 - no cupy, no driver, no device
        print(f"no usable GPU here ({type(err).__name__}: {err}): make gpu-check needs one", file=sys.stderr)
        return 2
    for line in lines:
        print(line, flush=True)
    rows = [("backends --check", *run("kernels", [python, "-m", "lstmgrad_cli", "backends", "--check"], 90))]
    if importlib.util.find_spec("pytest") is None:
        why = "pytest is not installed here: carry build/gpu-pylibs (make gpu-pylibs)"
        rows += [("gpu tests", "SKIPPED", why, 0.0), ("golden cases on cupy", "SKIPPED", why, 0.0)]
    else:
        pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short", "-rfE"]
        rows.append(("gpu tests", *run("gpu tests", [*pytest, "-m", "gpu", "-rs", "tests/test_backends.py"], 120)))
        rows.append(("golden cases on cupy", *run("golden cases on cupy", [*pytest, *GOLDEN_TESTS], 150,
                                                  {"LSTMGRAD_TEST_BACKEND": "cupy"})))
    for k, shapes in enumerate(SHAPES, 1):  # (--no-compare: no CPU framework; cuDNN is timed all the same)
        bench = [python, "-m", "lstmgrad_cli", "bench", "--backend", "cupy", "--repeats", "3", "--markdown",
                 "--no-compare", *(arg for shape in shapes for arg in ("--shape", shape))]
        rows.append((f"bench {k} (cupy, cuDNN)", *run(f"bench {k}", bench, 150)))
    if importlib.util.find_spec("pytest") is not None:
        rows.append(("golden cases, loop of steps", *run("golden cases on cupy, loop of steps",
                                                         [*pytest, *GOLDEN_TESTS], 120,
                                                         {"LSTMGRAD_TEST_BACKEND": "cupy",
                                                          "LSTMGRAD_CUPY_LOOP": "steps"})))
    if BUDGET.left() < 60:
        rows.append(("start-up and batch", "SKIPPED", "no time left in the budget", 0.0))
    else:
        print("\n== start-up and a batch, numpy against cupy", flush=True)
        try:
            rows.append(("start-up and batch", *waits(python)))
        except subprocess.TimeoutExpired:
            rows.append(("start-up and batch", "TIMEOUT", "stopped: no time left in the budget", 0.0))
        except (subprocess.CalledProcessError, OSError) as err:
            rows.append(("start-up and batch", f"FAILED ({err})", "", 0.0))
    rows.append(("batch in one process", *run("100 small files in one process: numpy, cupy's copies, packed copies",
                                              [python, "benchmarks/gpu_probe.py", "batch"], 90)))
    # where the time goes, as the budget allows (the checks and the table first)
    rows.append(("pass parts", *run("the device's chunks and the host path's copies, beside cuDNN",
                                    [python, "benchmarks/gpu_pass_parts.py", "--repeats", "3"], 120)))
    rows.append(("loop anatomy", *run("where the persistent loop's time goes",
                                      [python, "benchmarks/gpu_loop_anatomy.py", "--repeats", "3"], 120)))
    rows.append(("copy rates", *run("host arrays to the GPU: copy rates, and a pass fed in chunks",
                                    [python, "benchmarks/gpu_copy_rates.py", "--repeats", "3"], 60)))
    print("\n| step | result | last lines | seconds |\n| --- | --- | --- | ---: |")
    for step, result, tail, seconds in rows:
        print(f"| {step} | {result} | {tail.replace('|', '/')} | {seconds:.0f} |")
    print(f"\nin all {time.perf_counter() - started:.0f} s")
    return 0 if all(result in ("ok", "SKIPPED") for _, result, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Timing the backends on standard shapes (library code: returns results, prints nothing).

For each shape (T, B, I, C) the backward pass does 16*T*B*C*(I+C) flops of matrix products.  Its
*GEMM limit* is the time of the same flops done as the two big products ``[T*B, 4C] @ [4C, I+C]``
and ``[I+C, T*B] @ [T*B, 4C]``, measured in the same run on the same BLAS: the ratio of a
backend's time to it says how close the backend gets to the machine's matrix-product rate.

TensorFlow (``BlockLSTMGradV2``) and PyTorch (the autograd backward of ``nn.LSTM``, the same
products without peepholes) are timed on the same arrays when they are importable, here or in
another interpreter given as ``compare_python`` (this file runs there as a script with numpy
only; neither library is ever a dependency).

Engines are timed round-robin, one call each per round, so a noisy machine slows all of them
alike; the median of the rounds is reported.  Each call starts after a short pause, once the thread
pools of the call before (OpenBLAS, OpenMP) have stopped spinning, as in a fresh ``lstmgrad`` run.
Another interpreter's engines are timed a round at a time between this one's rounds (``_ChildRounds``),
and each backend is compared with each framework round by round (``paired_ratio``): a machine whose
speed drifts over a run (a shared VM) moves both sides of each pair.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

SHAPES = ((50, 32, 128, 128), (100, 64, 256, 256), (200, 128, 512, 512))
DTYPES = ("float32", "float16", "float64")
SCHEMA = 1
FRAMEWORKS = ("tensorflow", "torch")
CHILD_TIMEOUT = 3600.0
SETTLE_SECONDS = 0.3
BACK_TO_BACK = "back-to-back:"  # _round_robin's key prefix for the call made right after the paused one
CHILD_LAUNCH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
CHILD_RATIO_NOTE = "ratio to the GEMM limit timed in the same rounds of its own interpreter"


@dataclass
class Timing:
    engine: str  # backend name, "gemm-limit", "tensorflow" or "torch"; on a GPU also "gpu-gemm-limit",
    # "cupy-device" (the cupy backend on arrays already there), "cupy-device-persistent" (its time loop in one
    # launch), "torch-cudnn" and "torch-cudnn-tf32"
    version: str | None
    shape: tuple[int, int, int, int]
    dtype: str
    seconds: list[float] = field(default_factory=list)
    median: float | None = None
    gflops: float | None = None
    ratio_to_gemm: float | None = None
    note: str = ""
    # Each round also times a call made right after the paused one, as a user's loop runs them (against
    # whatever the call before left spinning); None where an engine was timed without them.
    back_to_back_seconds: list[float] | None = None
    back_to_back_median: float | None = None
    # A backend's time over each framework's (TensorFlow, PyTorch) timed in the same rounds: the median over
    # rounds of the two times' ratio (paired_ratio; below 1: faster than it).
    versus: dict[str, float | None] = field(default_factory=dict)
    versus_back_to_back: dict[str, float | None] = field(default_factory=dict)  # the same of the back-to-back calls


@dataclass
class BenchReport:
    machine: dict
    settings: dict
    results: list[Timing]
    notes: list[str] = field(default_factory=list)  # engines asked for and not timed, and why

    def to_json(self) -> dict:
        from .. import __version__

        return {"lstmgrad": __version__, "schema": SCHEMA, "machine": self.machine, "settings": self.settings,
                "results": [asdict(r) for r in self.results], "notes": self.notes, "gpu_summary": gpu_summary(self)}


def flops(shape) -> int:
    T, B, I, C = shape  # noqa: E741
    return 16 * T * B * C * (I + C)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"T,B,I,C"`` -> a tuple of four positive ints."""
    from ..errors import InvalidArgumentError

    parts = [p.strip() for p in str(text).replace("x", ",").split(",")]
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise InvalidArgumentError(f"shape must be four positive integers T,B,I,C, got {text!r}")
    return dims


def make_inputs(shape, dtype="float32", seed: int = 0) -> dict[str, np.ndarray]:
    """Random BlockLSTMGradV2 inputs of plausible magnitudes (gates in (0,1), tanh values in (-1,1))."""
    T, B, I, C = shape  # noqa: E741
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)

    def n(*s, scale=1.0):
        return (rng.standard_normal(s, dtype=np.float32) * scale).astype(dt)

    def u(lo, hi, *s):
        return rng.uniform(lo, hi, s).astype(dt)

    return dict(x=n(T, B, I), cs_prev=n(B, C), h_prev=u(-1, 1, B, C), w=n(I + C, 4 * C, scale=(I + C) ** -0.5),
                wci=n(C, scale=0.5), wcf=n(C, scale=0.5), wco=n(C, scale=0.5), b=n(4 * C, scale=0.5),
                i=u(0, 1, T, B, C), cs=n(T, B, C), f=u(0, 1, T, B, C), o=u(0, 1, T, B, C), ci=u(-1, 1, T, B, C),
                co=u(-1, 1, T, B, C), h=u(-1, 1, T, B, C), cs_grad=n(T, B, C), h_grad=n(T, B, C))


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    blas = None
    try:
        cfg = np.show_config(mode="dicts")
        info = cfg.get("Build Dependencies", {}).get("blas", {})
        blas = f"{info.get('name')} {info.get('version')}".strip()
    except Exception:  # noqa: BLE001 - informational only
        pass
    from ..backends import cpu_blas, overlap_calibration
    from ..backends.blas_calibration import processor

    return {"cpu": cpu, "cores": os.cpu_count(), "processor": processor(), "python": platform.python_version(),
            "numpy": np.__version__, "blas": blas, "host_blas": cpu_blas.describe(),
            "host_blas_why": cpu_blas.why_chosen(), "host_schedule": overlap_calibration.describe(),
            "platform": platform.platform(),
            "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
                                                   "OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "LSTMGRAD_BLAS",
                                                   "MKL_NUM_THREADS", "MKL_THREADING_LAYER")
                    if os.environ.get(k) is not None}}


# -- engines: each is a zero-argument callable timed round-robin ---------------------------------

def _gemm_limit_call(shape, dtype, matmul=None):
    """The two large products of the GEMM limit, on ``matmul(a, b, out)`` (default ``np.matmul``; ``run``
    passes the BLAS the CPU backends use, MKL when installed)."""
    matmul = matmul or (lambda a, b, out: np.matmul(a, b, out=out))
    T, B, I, C = shape  # noqa: E741
    cdt = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    dg, w, xh = _gemm_operands(shape, cdt)
    out1, out2 = np.empty((T * B, I + C), cdt), np.empty((I + C, 4 * C), cdt)

    def call():
        matmul(dg, w.T, out1)
        matmul(xh.T, dg, out2)

    return call


def _gemm_operands(shape, cdt):
    """The GEMM limit's operands: gate gradients [T*B, 4C], w [I+C, 4C], [x, h] [T*B, I+C]."""
    T, B, I, C = shape  # noqa: E741
    rng = np.random.default_rng(1)
    return (rng.standard_normal((T * B, 4 * C)).astype(cdt), rng.standard_normal((I + C, 4 * C)).astype(cdt),
            rng.standard_normal((T * B, I + C)).astype(cdt))


def _backend_call(backend, inputs, use_peephole):
    from ..ops.validation import resolve_compute_dtype
    from ..spec import LAYOUT_V2, SeqTensors

    T = inputs["x"].shape[0]
    tensors = SeqTensors(**inputs)
    cdt = resolve_compute_dtype(inputs["x"].dtype, None)

    def call():  # BlockLSTMGradV2, as PyTorch and TensorFlow are timed
        backend.block_lstm_grad(tensors, seq_len_max=T, use_peephole=use_peephole, layout=LAYOUT_V2, compute_dtype=cdt)

    return call


def framework_call(name: str, inputs: dict, use_peephole: bool, device: str = "cpu", tf32: bool = False):
    """(callable, version, note) timing TensorFlow or PyTorch on ``inputs``; ImportError if absent.  PyTorch runs
    on ``device`` ("cuda": cuDNN, each call ending when the device is done, TF32 matrix products when ``tf32``)."""
    T, B, I = inputs["x"].shape  # noqa: E741
    C = inputs["w"].shape[1] // 4
    if name == "tensorflow":
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf  # noqa: PLC0415 - optional, never a dependency

        args = {k: tf.constant(v) for k, v in inputs.items()}
        seq_len_max = tf.constant(T, dtype=tf.int64)

        def call():
            out = tf.raw_ops.BlockLSTMGradV2(seq_len_max=seq_len_max, use_peephole=use_peephole, **args)
            out[0].numpy()

        return call, tf.__version__, "BlockLSTMGradV2"
    if name == "torch":
        import torch  # noqa: PLC0415 - optional, never a dependency

        dt = getattr(torch, str(inputs["x"].dtype))
        lstm = torch.nn.LSTM(I, C).to(dt).to(device)
        with torch.no_grad():  # IFCO is torch's gate order (i, f, g, o)
            lstm.weight_ih_l0.copy_(torch.from_numpy(np.ascontiguousarray(inputs["w"][:I].T)))
            lstm.weight_hh_l0.copy_(torch.from_numpy(np.ascontiguousarray(inputs["w"][I:].T)))
            lstm.bias_ih_l0.copy_(torch.from_numpy(inputs["b"]))
            lstm.bias_hh_l0.zero_()

        def tensor(a):
            return torch.from_numpy(a).to(device)

        x = tensor(inputs["x"]).requires_grad_()
        h0 = tensor(inputs["h_prev"])[None].clone().requires_grad_()
        c0 = tensor(inputs["cs_prev"])[None].clone().requires_grad_()
        note = "nn.LSTM backward, no peepholes"
        if device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
            note += f", cuDNN {torch.backends.cudnn.version()}, TF32 {'on' if tf32 else 'off'}"
        out, _ = lstm(x, (h0, c0))
        grad_out = tensor(inputs["h_grad"])
        wrt = [x, h0, c0, *lstm.parameters()]
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

        def call():
            if device == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
            torch.autograd.grad(out, wrt, grad_out, retain_graph=True)
            sync()

        return call, torch.__version__, note
    raise ValueError(f"unknown framework {name!r}")


GPU_LIMIT = "gpu-gemm-limit"
FILES_IO = "files-io"  # the file-to-file run's reading and writing alone (``files_io_call``)


def gpu_calls(shape, dtype: str, inputs: dict, use_peephole: bool, backend) -> tuple[dict, dict, dict]:
    """(calls, versions, notes) of the GPU engines, each call ending when the device is done: the GEMM limit
    on the GPU (cupy.matmul), the cupy backend on arrays already on the device, from one file to another
    (``_files_call``) and that run's reading and writing alone (``files_io_call``), the PCIe floor
    (``_pcie_floor_call``), and PyTorch's cuDNN nn.LSTM backward on the same
    arrays with TF32 off and on, when a CUDA torch is importable.  The cupy backend on host arrays (copies in and
    out) is the ``backend`` row ``run`` times anyway."""
    import cupy  # noqa: PLC0415 - only with the cupy backend

    from ..errors import BackendUnavailableError  # noqa: PLC0415
    from ..ops.validation import resolve_compute_dtype  # noqa: PLC0415
    from ..spec import LAYOUT_V2, SeqTensors  # noqa: PLC0415

    sync = cupy.cuda.get_current_stream().synchronize
    T, B, I, C = shape  # noqa: E741
    cdt = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    dg, w, xh = (cupy.asarray(a) for a in _gemm_operands(shape, cdt))
    out1, out2 = cupy.empty((T * B, I + C), cdt), cupy.empty((I + C, 4 * C), cdt)

    def gemm():
        cupy.matmul(dg, w.T, out=out1)
        cupy.matmul(xh.T, dg, out=out2)
        sync()

    tensors = SeqTensors(**{k: cupy.asarray(v) for k, v in inputs.items()})
    compute = resolve_compute_dtype(inputs["x"].dtype, None)

    def on_device():
        backend.block_lstm_grad(tensors, seq_len_max=T, use_peephole=use_peephole, layout=LAYOUT_V2,
                                compute_dtype=compute)
        sync()

    def on_device_with(loop):  # each of the time loops (backends/_cupy.py), whichever the backend would choose
        other = type(backend)(loop=loop)

        def call():
            other.block_lstm_grad(tensors, seq_len_max=T, use_peephole=use_peephole, layout=LAYOUT_V2,
                                  compute_dtype=compute)
            sync()
        return call

    loops = {"cupy-device-steps": "steps", "cupy-device-persistent": "persistent"}
    calls = {GPU_LIMIT: gemm, "cupy-device": on_device, **{name: on_device_with(loop) for name, loop in loops.items()},
             "cupy-pinned": _backend_call(type(backend)(copies="pinned"), inputs, use_peephole)}
    refused = {}
    try:  # a loop this GPU cannot run for the shape (its weights do not fit a block) is a note, not a failure
        calls["cupy-device-persistent"]()
    except BackendUnavailableError as err:
        refused["cupy-device-persistent"] = f"not run: {err}"
        del calls["cupy-device-persistent"]
    versions = {GPU_LIMIT: None, **dict.fromkeys(("cupy-device", *loops, "cupy-pinned"), backend.version)}
    notes = {"cupy-device": "arrays already on the GPU, the time loop the backend chooses",
             "cupy-device-steps": "arrays already on the GPU, a step's kernel and cuBLAS product launched from Python",
             "cupy-device-persistent": "arrays already on the GPU, each chunk's time loop in one launch",
             "cupy-pinned": "host arrays, copied in and out through pinned staging buffers, at once where the GPU "
                            "holds the pass, else a chunk of steps at a time beside its work (LSTMGRAD_CUPY_COPIES)",
             **refused}
    makers = {"pcie-floor": lambda: _pcie_floor_call(cupy, shape, inputs, backend, sync)}
    try:
        source = _input_file(shape, inputs)
    except Exception as err:  # noqa: BLE001
        notes["cupy-files"] = notes[FILES_IO] = f"failed: {type(err).__name__}: {err}"
    else:
        makers.update({"cupy-files": lambda: _files_call(cupy, shape, inputs, backend, sync, source),
                       FILES_IO: lambda: files_io_call(shape, inputs, source)})
    for name, make in makers.items():
        try:  # a measurement that cannot be made here is a note, never a broken benchmark
            call, versions[name], notes[name] = make()
            call()
            calls[name] = call
        except Exception as err:  # noqa: BLE001
            notes[name] = f"failed: {type(err).__name__}: {err}"
    try:
        import torch  # noqa: PLC0415 - optional, never a dependency

        usable = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - absent or broken: not compared
        usable = False
    if usable:
        for tf32 in (False, True):
            name = "torch-cudnn-tf32" if tf32 else "torch-cudnn"
            call, versions[name], notes[name] = framework_call("torch", inputs, use_peephole, device="cuda",
                                                               tf32=tf32)
            calls[name] = call
    return calls, versions, notes


def _pcie_floor_call(cupy, shape, inputs: dict, backend, sync):
    """(call, version, note): the PCIe floor of a pass from host arrays, measured: the bytes the pass reads copied
    to the device from pinned host memory and the bytes it writes (its gradients) copied back into pinned memory,
    one after the other on the current stream (issue 39's floor)."""
    import cupyx  # noqa: PLC0415 - with cupy

    T, B, I, C = shape  # noqa: E741
    itemsize = inputs["x"].dtype.itemsize
    read = sum(int(a.nbytes) for a in inputs.values())
    written = (T * B * I + 2 * B * C + (I + C) * 4 * C + 4 * C + 3 * C) * itemsize
    host_in, host_out = cupyx.empty_pinned((read,), np.uint8), cupyx.empty_pinned((written,), np.uint8)
    host_in[:] = 1
    device_in, device_out = cupy.empty(read, np.uint8), cupy.zeros(written, np.uint8)

    def call():
        device_in.set(host_in)
        device_out.get(out=host_out)
        sync()

    return call, None, (f"{read / 2**20:.0f} MB in from pinned host memory, {written / 2**20:.0f} MB out to it: "
                        "what a pass from host arrays cannot beat")


FILES_MOST_BYTES = 2 * 2**30  # inputs a benchmark writes to a file to time file to file, at most


def _input_file(shape, inputs: dict) -> str:
    """An NPZ file of ``inputs`` as ``lstmgrad seq`` reads them, in a folder removed at exit (once per shape)."""
    import atexit  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    read = sum(int(a.nbytes) for a in inputs.values())
    if read > FILES_MOST_BYTES:
        raise ValueError(f"not timed: {read / 2**20:.0f} MB of inputs, over the {FILES_MOST_BYTES >> 20} MB a "
                         "benchmark writes to a file")
    folder = tempfile.mkdtemp(prefix="lstmgrad-bench-files-")
    atexit.register(shutil.rmtree, folder, True)
    source = os.path.join(folder, "in.npz")
    np.savez(source, **inputs, seq_len_max=np.int64(shape[0]), use_peephole=np.bool_(False))
    return source


def _files_call(cupy, shape, inputs: dict, backend, sync, source: str):
    """(call, version, note): ``lstmgrad seq`` of the NPZ file ``source`` to another on this backend, in this process
    (reading, checking, the pass, writing and publishing the output: what a user's command does after its start)."""
    from .grad import GradOptions, run_grad_file  # noqa: PLC0415

    options = GradOptions(backend=backend.name, layout="ifco", use_peephole=False, force=True)
    target = os.path.join(os.path.dirname(source), "out.npz")

    def call():
        run_grad_file(source, target, options)

    return call, backend.version, "file to file: read, checked, computed on the GPU, written and fsynced"


def files_io_call(shape, inputs: dict, source: str):
    """(call, version, note): the file-to-file run without its computing: ``source`` read whole with ``np.load``,
    and an NPZ file of the gradients' sizes written beside it with ``np.savez``, fsynced and renamed into place (the
    floor issue 39 states the file-to-file goal against, with the PCIe floor and the device time)."""
    T, B, I, C = shape  # noqa: E741
    dtype = inputs["x"].dtype
    sizes = {"x_grad": (T, B, I), "cs_prev_grad": (B, C), "h_prev_grad": (B, C), "w_grad": (I + C, 4 * C),
             "wci_grad": (C,), "wcf_grad": (C,), "wco_grad": (C,), "b_grad": (4 * C,)}
    target = os.path.join(os.path.dirname(source), "io-floor.npz")

    def call():
        with np.load(source) as archive:
            read = {name: archive[name] for name in archive.files}
        outputs = {name: np.empty(size, dtype) for name, size in sizes.items()}
        outputs["x_grad"][...] = read["x"]  # (the output's pages written once, as a pass's are)
        with open(target + ".tmp", "wb") as f:
            np.savez(f, **outputs)
            f.flush()
            os.fsync(f.fileno())
        os.replace(target + ".tmp", target)

    return call, None, "read and write alone: the input read with np.load, the outputs' bytes saved and fsynced"


def _round_robin(calls: dict, repeats: int, progress=None, others=()) -> dict[str, list[float]]:
    """``repeats`` rounds of two calls per engine: the first after a pause of ``SETTLE_SECONDS`` (under the
    engine's name), the second right after it (under ``BACK_TO_BACK + name``).  ``others``: a round of another
    interpreter's engines (``_ChildRounds.round``) each, after this one's in every round.

    Thread pools spin for a while after their work (OpenBLAS ~0.1 s, OpenMP up to 0.2 s): without the
    pause, an engine would be timed against the previous engine's spinning threads on 2 cores.  A user's
    loop does not pause, though: the second call is timed against what the engine's own first call left
    running, as in a batch or a loop of calls.
    """
    times = {key: [] for name in calls for key in (name, BACK_TO_BACK + name)}
    for call in calls.values():  # warm up: first-call costs (compiles, allocations) are not timed
        call()
    for r in range(repeats):
        _timed_round(calls, times)
        for other in others:
            other()
        if progress:
            progress(f"round {r + 1}/{repeats}")
    return times


def _timed_round(calls: dict, times: dict[str, list[float]]) -> None:
    """One round of ``_round_robin``: each call paused, then again back to back; their seconds appended."""
    for name, call in calls.items():
        if SETTLE_SECONDS:
            time.sleep(SETTLE_SECONDS)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        call()
        t2 = time.perf_counter()
        times.setdefault(name, []).append(t1 - t0)
        times.setdefault(BACK_TO_BACK + name, []).append(t2 - t1)


class _ChildRounds:
    """Frameworks timed in another interpreter (this file as a script there, ``_child_main``) on the same arrays,
    a round at a time between this process's rounds (``round``), so that the machine's noise hits both alike
    and each round's times can be paired.  ``info`` is what the child said when it started (versions, notes,
    errors, the BLAS of its GEMM limit; ``{"error": ...}`` when it could not be run); ``times`` its rounds so far,
    by ``_round_robin``'s keys.  A child that fails later stops being asked; its rounds so far are kept.

    The child times its GEMM limit on the library this process's backends use where it has it
    (``LSTMGRAD_BLAS`` is passed on; ``_child_blas``).
    """

    def __init__(self, python: str, inputs: dict, frameworks, use_peephole: bool):
        from ..backends import cpu_blas

        self.python, self.times, self.proc = python, {}, None
        self._tmp = tempfile.TemporaryDirectory(prefix="lstmgrad-bench-")
        path = os.path.join(self._tmp.name, "inputs.npz")
        np.savez(path, **inputs)
        env = {**os.environ, cpu_blas.BLAS_ENV: cpu_blas.library()}
        # run as a script, without its folder first on sys.path (python FILE puts it there), where this package's
        # modules would shadow the standard library's (inspect.py)
        cmd = [python, "-c", CHILD_LAUNCH, os.path.abspath(__file__), "--child", path,
               "--frameworks", ",".join(frameworks)] + (["--peephole"] if use_peephole else [])
        self._stderr = open(os.path.join(self._tmp.name, "stderr.txt"), "w+")  # noqa: SIM115 - closed in close()
        try:  # (stderr to a file: a framework's log lines would fill a pipe no one reads meanwhile)
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,  # noqa: S603
                                         stderr=self._stderr, text=True, env=env)
        except OSError as err:
            self.info = {"error": f"{python}: {err}"}
            return
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self._answer() or {"error": f"{python}: {self._failure()}"}

    @property
    def names(self) -> list[str]:
        """The frameworks it times."""
        return list(self.info.get("versions", {}))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self) -> dict | None:
        """The child's next JSON object (a line; other lines a library printed are passed over); None when it
        ended or took ``CHILD_TIMEOUT``."""
        while True:
            try:
                line = self._lines.get(timeout=CHILD_TIMEOUT)
            except queue.Empty:
                return None
            if line is None:
                return None
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if isinstance(answer, dict):
                return answer

    def _failure(self) -> str:
        """The last line the child wrote to stderr, once it has ended."""
        self._end()
        self._stderr.seek(0)
        return (self._stderr.read().strip().splitlines() or ["no output"])[-1]

    def round(self) -> None:
        """One round of the child's engines, added to ``times``."""
        if "error" in self.info or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write("round\n")
            self.proc.stdin.flush()
        except OSError:
            return
        answer = self._answer()
        if answer is None:
            self._end()
            return
        for key, seconds in answer.items():
            self.times.setdefault(key, []).append(seconds)

    def _end(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self._end()
        self._stderr.close()
        self._tmp.cleanup()


def paired_ratio(mine: list[float], theirs: list[float]) -> float | None:
    """The median over rounds of ``mine[r] / theirs[r]``: two engines timed in the same rounds, compared round by
    round, so that a round the machine slowed counts against both."""
    pairs = [a / b for a, b in zip(mine, theirs, strict=False) if b > 0]  # (a child may stop early)
    return float(np.median(pairs)) if pairs else None


def run(backends=None, shapes=SHAPES, dtype: str = "float32", repeats: int = 5, use_peephole: bool = False,
        compare: bool = True, compare_python=(), progress=None) -> BenchReport:
    """Time backends (names or objects; default: every usable one) on ``shapes``.

    Returns a ``BenchReport``; each shape has a ``gemm-limit`` row and one row per engine.
    ``progress`` (optional) is called with short status strings.
    """
    from .. import backends as registry
    from ..backends import cpu_blas
    from ..spec import LAYOUT_V2

    if dtype not in DTYPES:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if repeats < 1:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"repeats must be at least 1, got {repeats}")
    if backends is None:
        backends = [s.name for s in registry.statuses() if s.available and s.source == "built-in"]
    loaded = [registry.get_backend(b) for b in backends]  # unknown/unavailable names fail here, first
    frameworks = []
    if compare:
        for name in FRAMEWORKS:
            try:
                module = __import__(name)
            except Exception:  # noqa: BLE001 - absent or broken: just not compared in-process
                continue
            if getattr(module, "__version__", None) is None:  # a folder of that name on sys.path, not the library
                continue
            frameworks.append(name)
    results: list[Timing] = []
    skipped: dict[str, str] = {}  # what an interpreter given with compare_python could not time, and why
    for shape in shapes:
        shape = tuple(int(d) for d in shape)
        say = (lambda msg, s=shape: progress(f"{s}: {msg}")) if progress else None
        inputs = make_inputs(shape, dtype)
        calls = {"gemm-limit": _gemm_limit_call(shape, dtype, cpu_blas.matmul)}
        versions, notes = {"gemm-limit": None}, {}
        gpu_engines = set()
        for backend in loaded:
            calls[backend.name] = _backend_call(backend, inputs, use_peephole)
            versions[backend.name] = backend.version
            if registry.takes_gpu_arrays(backend):  # the GPU's engines, rated against the GPU's GEMM rate
                more, more_versions, more_notes = gpu_calls(shape, dtype, inputs, use_peephole, backend)
                calls.update(more)
                versions.update(more_versions)
                notes.update(more_notes)
                notes[backend.name] = "host arrays: copies in and out included"
                gpu_engines |= {backend.name, *more}
        for name in frameworks:
            try:
                call, versions[name], notes[name] = framework_call(name, inputs, use_peephole)
                call()  # fails here rather than in the timed rounds
                calls[name] = call
            except Exception as err:  # noqa: BLE001 - a comparison never breaks the benchmark
                notes[name] = f"failed: {err}"
        children = []  # frameworks this interpreter lacks, timed in others, a round at a time between ours
        try:
            for python in compare_python if compare else ():
                missing = [f for f in FRAMEWORKS if f not in calls and not any(f in c.names for c in children)]
                if not missing:
                    break
                if say:
                    say(f"starting {python} to time {', '.join(missing)}")
                child = _ChildRounds(python, inputs, missing, use_peephole)
                children.append(child)  # (closed below; one that times nothing is asked for no round)
                if "error" in child.info:
                    skipped.setdefault(python, f"{python} could not be run: {child.info['error']}")
            for child in children:  # what no interpreter could time, and why
                for name, error in child.info.get("errors", {}).items():
                    if not any(name in other.names for other in children):
                        skipped.setdefault(f"{child.python} {name}", f"{name} not timed with {child.python}: {error}")
            times = _round_robin(calls, repeats, say, others=[c.round for c in children if c.names])
        finally:
            for child in children:
                child.close()
        limits = {}  # engines timed in another interpreter: the GEMM limit of their own rounds
        for child in children:
            child_limit = child.times.get("gemm-limit")
            limit_note = f"{CHILD_RATIO_NOTE}, on {child.info.get('blas') or 'numpy.matmul'}"
            for name in child.names:
                if not child.times.get(name):
                    skipped.setdefault(f"{child.python} {name}", f"{name} not timed with {child.python}: it stopped")
                    continue
                times[name] = child.times[name]
                times[BACK_TO_BACK + name] = child.times.get(BACK_TO_BACK + name, [])
                versions[name], notes[name] = child.info["versions"][name], child.info["notes"][name]
                if child_limit:
                    limits[name] = float(np.median(child_limit))
                    notes[name] = "; ".join(filter(None, [notes[name], limit_note]))
        for name, note in notes.items():  # an engine that could not be timed says why (a framework, a GPU row)
            if name not in times and note.startswith(("failed", "not run")):
                skipped.setdefault(f"{shape} {name}", f"{name} at {','.join(map(str, shape))}: {note}")
        limit = float(np.median(times["gemm-limit"]))
        compared = [name for name in FRAMEWORKS if name in times]  # each backend's times over theirs, paired
        if GPU_LIMIT in times:
            limits.update(dict.fromkeys(gpu_engines, float(np.median(times[GPU_LIMIT]))))
        for name, secs in times.items():
            if name.startswith(BACK_TO_BACK):
                continue
            med = float(np.median(secs))
            following = times.get(BACK_TO_BACK + name) or None
            paired = [] if name in compared or name == "gemm-limit" else compared
            versus = {other: paired_ratio(secs, times[other]) for other in paired}
            versus_after = {other: paired_ratio(following, times.get(BACK_TO_BACK + other) or [])
                            for other in paired if following}
            results.append(Timing(name, versions.get(name), shape, dtype, secs, med, flops(shape) / med / 1e9,
                                  med / limits.get(name, limit), notes.get(name, ""), following,
                                  float(np.median(following)) if following else None, versus, versus_after))
    settings = {"dtype": dtype, "repeats": repeats, "use_peephole": use_peephole, "layout": LAYOUT_V2,
                "shapes": [list(s) for s in shapes]}
    return BenchReport(machine_info(), settings, results, list(skipped.values()))


def markdown_table(report: BenchReport) -> str:
    """The results as a Markdown table (for the README)."""
    lines = ["| shape T,B,I,C | engine | version | median | GFLOP/s | x GEMM limit | back-to-back | "
             "x framework, same rounds |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in report.results:
        lines.append(f"| {','.join(map(str, r.shape))} | {r.engine} | {r.version or '-'} | {seconds_text(r.median)} | "
                     f"{r.gflops:.0f} | {r.ratio_to_gemm:.2f} | {seconds_text(r.back_to_back_median)} | "
                     f"{versus_text(r)} |")
    return "\n".join(lines)


def versus_text(timing: Timing) -> str:
    """``0.93x torch (1.05x back to back), 0.31x tensorflow (...)``: ``Timing.versus`` and
    ``versus_back_to_back`` in words; ``-`` when it has none."""
    said = []
    for name, ratio in timing.versus.items():
        after = timing.versus_back_to_back.get(name)
        if ratio is not None:
            said.append(f"{ratio:.2f}x {name}" + (f" ({after:.2f}x back to back)" if after is not None else ""))
    return ", ".join(said) or "-"


def gpu_summary(report: BenchReport) -> list[dict]:
    """Issue 39's figures for each shape timed on a GPU (one with a ``cupy-device`` row): the medians of cuDNN's
    backward (TF32 off), lstmgrad on device arrays (the loop it chooses, and each loop), from host arrays (cupy's
    copies, pinned buffers), file to file, that run's reading and writing alone, and the PCIe floor, and the ratios
    its goals are stated in: device time over cuDNN's, host times over the bound max(PCIe floor, device time), and
    the file-to-file time over max(that bound, the reading and writing alone).  Absent rows are None."""
    by_shape: dict[tuple, dict[str, float | None]] = {}
    for r in report.results:
        by_shape.setdefault(tuple(r.shape), {})[r.engine] = r.median
    rows = []
    for shape, median in by_shape.items():
        device = median.get("cupy-device")
        if device is None:
            continue
        cudnn, floor = median.get("torch-cudnn"), median.get("pcie-floor")
        bound = max(device, floor) if floor is not None else None
        names = {"device": "cupy-device", "steps": "cupy-device-steps", "persistent": "cupy-device-persistent",
                 "host": "cupy", "host_pinned": "cupy-pinned", "files": "cupy-files", "files_io": FILES_IO}
        row = {"shape": list(shape), "cudnn": cudnn, **{key: median.get(name) for key, name in names.items()},
               "pcie_floor": floor}
        file_bound = max(bound, row["files_io"]) if bound is not None and row["files_io"] is not None else None
        for key, base in (("device", cudnn), ("host", bound), ("host_pinned", bound), ("files", file_bound)):
            ratio = row[key] / base if row[key] is not None and base else None
            row[f"{key}_over_{'cudnn' if key == 'device' else 'bound'}"] = ratio
        rows.append(row)
    return rows


def markdown_gpu_summary(rows: list[dict]) -> str:
    """``gpu_summary``'s rows as a Markdown table ("" when there are none)."""
    if not rows:
        return ""

    def ratio(value):
        return "-" if value is None else f"{value:.2f}x"

    lines = ["| T,B,I,C | cuDNN | device (x cuDNN) | steps | persistent | host (x bound) | pinned (x bound) | "
             "files (x file bound) | read+write alone | PCIe floor |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {','.join(map(str, r['shape']))} | {seconds_text(r['cudnn'])} | {seconds_text(r['device'])} "
                     f"({ratio(r['device_over_cudnn'])}) | {seconds_text(r['steps'])} | "
                     f"{seconds_text(r['persistent'])} | {seconds_text(r['host'])} ({ratio(r['host_over_bound'])}) | "
                     f"{seconds_text(r['host_pinned'])} ({ratio(r['host_pinned_over_bound'])}) | "
                     f"{seconds_text(r['files'])} ({ratio(r['files_over_bound'])}) | {seconds_text(r['files_io'])} | "
                     f"{seconds_text(r['pcie_floor'])} |")
    return "\n".join(lines)


def seconds_text(seconds: float | None) -> str:
    """``12.3 ms`` or ``1.23 s``; ``-`` for None."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _child_blas():
    """``backends/cpu_blas.py`` loaded by path (it needs only numpy), or None: in a child interpreter this
    file runs as a script, where lstmgrad itself may not be installed."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "backends", "cpu_blas.py")
    try:
        spec = importlib.util.spec_from_file_location("_lstmgrad_bench_blas", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - the child then times numpy's own matmul
        return None
    return module


def _child_main(argv) -> int:
    """``python bench.py --child INPUTS.npz --frameworks a,b [--peephole]``, for ``_ChildRounds``: one JSON line on
    stdout once the frameworks are loaded and warmed up (``versions`` and ``notes`` of those that run, ``errors`` of
    those that do not, ``blas``: the library of its GEMM limit), then for each line on stdin a round of them and of
    that GEMM limit (``_timed_round``), one JSON line of seconds each, until stdin ends."""
    path = argv[argv.index("--child") + 1]
    names = argv[argv.index("--frameworks") + 1].split(",")
    peephole = "--peephole" in argv
    with np.load(path) as src:
        inputs = {k: src[k] for k in src.files}
    T, B, I = inputs["x"].shape  # noqa: E741
    # The GEMM limit again, in these rounds: the machine's noise then hits the ratio's two sides alike.
    blas = _child_blas()
    matmul = blas.matmul if blas is not None else None
    calls = {"gemm-limit": _gemm_limit_call((T, B, I, inputs["w"].shape[1] // 4), inputs["x"].dtype, matmul)}
    info = {"versions": {}, "notes": {}, "errors": {}, "blas": blas.describe() if blas is not None else None}
    for name in names:
        try:
            call, version, note = framework_call(name, inputs, peephole)
            call()
        except Exception as err:  # noqa: BLE001 - report, do not fail the parent
            info["errors"][name] = str(err)
            continue
        calls[name], info["versions"][name], info["notes"][name] = call, version, note
    calls["gemm-limit"]()  # (every call warmed up, as _round_robin does)
    print(json.dumps(info), flush=True)
    for _line in sys.stdin:
        times: dict[str, list[float]] = {}
        _timed_round(calls, times)
        print(json.dumps({key: seconds[0] for key, seconds in times.items()}), flush=True)
    return 0


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(_child_main(sys.argv))

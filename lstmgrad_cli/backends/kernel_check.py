"""Build every kernel of every installed backend, and say which failed (``lstmgrad backends --check``).

Before a long batch job (it also fills the kernel caches, so the job's first file does not pay for compiling) and
in CI: numba compiles its kernels on the host; cupy compiles its kernels for the GPU it finds, or, without one, for
the architecture named (NVRTC through the ``cuda-bindings`` and ``nvidia-cuda-nvrtc`` wheels, no GPU or driver
needed).  A plugin that has a ``build_kernels()`` method is asked to build its own.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np

from . import get_backend, registry, status


@dataclass(frozen=True)
class KernelBuild:
    """One backend's kernels built for one target: ``ok`` False when any failed (``detail`` says how), None when
    nothing was built (``detail`` says why)."""

    backend: str
    target: str  # "host", a GPU architecture (sm_90), or the GPU found
    kernels: int
    ok: bool | None
    detail: str


def build_all(arch: str | None = None) -> list[KernelBuild]:
    """Every registered backend's kernels built (cupy's for the present GPU, else for ``arch``, e.g. ``sm_90``), and
    every usable backend held to the contract on small problems (``conformance.check``)."""
    builders = {"numpy": _numpy, "numba": _numba, "cupy": lambda: _cupy(arch)}
    return [_conforming(builders.get(name, lambda name=name: _plugin(name))()) for name in registry()]


def _conforming(build: KernelBuild) -> KernelBuild:
    """``build`` with the backend's conformance said: checked where it is usable here and built without failure."""
    if build.ok is False or not status(build.backend).available:
        return build
    from . import conformance  # noqa: PLC0415

    try:
        problems = conformance.check(get_backend(build.backend))
    except Exception as err:  # noqa: BLE001 - a backend that fails to load is reported, not raised
        problems = [f"{type(err).__name__}: {err}"]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return KernelBuild(build.backend, build.target, build.kernels, False,
                           f"does not meet the backend contract: {problems[0]}{more}")
    checked = f"meets the backend contract ({sum(1 for _ in conformance.cases())} cases)"
    return KernelBuild(build.backend, build.target, build.kernels, True if build.ok is not False else build.ok,
                       f"{build.detail}; {checked}" if build.kernels or build.ok else checked)


def _numpy() -> KernelBuild:
    return KernelBuild("numpy", "host", 0, None, "no kernels: numpy's ufuncs and BLAS")


def _numba() -> KernelBuild:
    state = status("numba")
    if not state.available:
        return KernelBuild("numba", "host", 0, None, state.reason)
    from ..spec import LAYOUT_V1, SeqTensors  # noqa: PLC0415
    from ._numba import NumbaBackend  # noqa: PLC0415 - imports numba

    # Every kernel a pass calls, in each dtype: the step and the compiled chunk loop, serial and parallel.
    variants = [NumbaBackend(kernel_min_flops=0, overlap=False, **options)
                for options in ({}, {"parallel_min_elements": 0}, {"compiled_loop": False},
                                {"compiled_loop": False, "parallel_min_elements": 0})]
    built = 0
    try:
        for dtype in (np.float32, np.float64):
            tensors = SeqTensors(**_tiny(dtype))
            for backend in variants:
                for peephole in (False, True):
                    backend.block_lstm_grad(tensors, seq_len_max=2, use_peephole=peephole, layout=LAYOUT_V1,
                                            compute_dtype=np.dtype(dtype))
                built += 1
    except Exception as err:  # noqa: BLE001 - reported, with the kernels built before it
        return KernelBuild("numba", "host", built, False, f"{type(err).__name__}: {err}")
    return KernelBuild("numba", "host", built, True, "compiled (or loaded from numba's cache): step and chunk "
                                                     "loop, serial and parallel, float32/64")


def _tiny(dtype) -> dict:
    rng = np.random.default_rng(0)
    T, B, I, C = 2, 2, 3, 2  # noqa: E741 - B, C >= 2: the compiled loop's condition
    shapes = dict(x=(T, B, I), cs_prev=(B, C), h_prev=(B, C), w=(I + C, 4 * C), wci=(C,), wcf=(C,), wco=(C,),
                  b=(4 * C,), i=(T, B, C), cs=(T, B, C), f=(T, B, C), o=(T, B, C), ci=(T, B, C), co=(T, B, C),
                  h=(T, B, C), cs_grad=(T, B, C), h_grad=(T, B, C))
    return {name: rng.uniform(-1, 1, shape).astype(dtype) for name, shape in shapes.items()}


def _cupy(arch: str | None) -> KernelBuild:
    from . import _cupy_kernels as kernels  # noqa: PLC0415 - text only, no cupy import

    count = len(kernels.KERNELS)
    if importlib.util.find_spec("cupy") is None:
        return KernelBuild("cupy", arch or "-", 0, None, status("cupy", probe_device=False).reason)
    if status("cupy").available:
        return _cupy_on_device(kernels, count)
    if arch is None:
        return KernelBuild("cupy", "-", 0, None, "no usable CUDA device: name a GPU architecture (arch, e.g. "
                                                 "sm_90) to compile the kernels for one")
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return KernelBuild("cupy", arch, 0, False, "compiling without a GPU needs NVRTC's Python bindings: "
                                                   "pip install cuda-bindings nvidia-cuda-nvrtc")
    try:
        compiled = kernels.compile_for_arch(arch)
    except (ImportError, OSError, RuntimeError) as err:  # NVRTC's library missing or failing
        return KernelBuild("cupy", arch, 0, False, f"NVRTC could not run: {err}")
    if not compiled.ok:
        return KernelBuild("cupy", arch, 0, False, "NVRTC: " + _first_error(compiled.log))
    return KernelBuild("cupy", arch, count, True, f"compiled by NVRTC without a GPU ({compiled.size} bytes)")


def _cupy_on_device(kernels, count: int) -> KernelBuild:
    import cupy as cp  # noqa: PLC0415

    device = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    target = f"GPU {device.id} ({name}, sm_{device.compute_capability})"
    try:
        module = kernels.module(cp)
        for kernel in kernels.KERNELS:
            module.get_function(kernel)
    except Exception as err:  # noqa: BLE001 - cupy's CompileException and driver errors alike
        return KernelBuild("cupy", target, 0, False, _first_error(str(err)))
    return KernelBuild("cupy", target, count, True, "compiled for this GPU (or loaded from cupy's kernel cache)")


def _plugin(name: str) -> KernelBuild:
    state = status(name)
    if not state.available:
        return KernelBuild(name, "-", 0, None, state.reason)
    try:
        backend = get_backend(name)
        build = getattr(backend, "build_kernels", None)
        if build is None:
            return KernelBuild(name, "-", 0, None, "the plugin has no build_kernels() to call")
        built = build()
    except Exception as err:  # noqa: BLE001 - a plugin's failure is its report
        return KernelBuild(name, "-", 0, False, f"{type(err).__name__}: {err}")
    return KernelBuild(name, "-", int(built or 0), True, "built by the plugin")


def _first_error(log: str) -> str:
    """The first line of a compiler's log that says what is wrong."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[0] if lines else "failed without a message"

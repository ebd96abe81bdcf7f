"""The cupy backend's kernels: one CUDA C text, built three ways.

* On a GPU, cupy compiles it (NVRTC) for the device: ``module(cp)``.
* Without one, ``compile_for_arch`` compiles it with NVRTC for a named architecture (``sm_90``), through the
  ``cuda-bindings`` and ``nvidia-cuda-nvrtc`` wheels, which need no GPU or driver: a kernel that does not build
  fails there, in the test suite and in ``lstmgrad backends --check``.
* A C compiler builds the very same text for the host (``__CUDACC_RTC__`` undefined: each kernel loops over its
  elements one after another), so the test suite runs the kernels' own arithmetic on the CPU.

One kernel per step, dtype and peephole flag: the elementwise work of one time step of docs/semantics.md, in
place, one thread per element of the ``[B, C]`` step.  Every operation keeps TensorFlow's bracketing and rounds in
the compute dtype: no multiply-add is contracted (``--fmad=false`` here, ``-ffp-contract=off`` on the host), and
float16 is computed an operation at a time in float32, each result rounded to half (``rd``), as TF's CPU kernel and
numpy's half ufuncs do.  The text includes no header, so NVRTC needs none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# (C type, name) of every kernel's parameters, in order; ``T`` is the element type in memory.
PARAMS = (
    ("long long", "n"), ("int", "C"), ("int", "off_i"), ("int", "off_f"), ("int", "off_c"), ("int", "off_o"),
    ("const T*", "in_gate"), ("const T*", "f"), ("const T*", "o"), ("const T*", "ci"), ("const T*", "co"),
    ("const T*", "h_grad"), ("const T*", "cs_grad"), ("const T*", "cs_prev"),
    ("const T*", "carried_h"), ("const T*", "carried_cs"), ("T*", "gates"), ("T*", "new_cs"),
)
PEEPHOLE_PARAMS = (("const T*", "cs"), ("const T*", "wci"), ("const T*", "wcf"), ("const T*", "wco"),
                   ("T*", "acc_i"), ("T*", "acc_f"), ("T*", "acc_o"))

# dtype -> (name suffix, type in memory, type computed in)
DTYPES = {
    np.dtype(np.float16): ("f16", "unsigned short", "float"),
    np.dtype(np.float32): ("f32", "float", "float"),
    np.dtype(np.float64): ("f64", "double", "double"),
}
OPTIONS = ("--fmad=false",)  # NVRTC: no contraction into fused multiply-adds
HOST_OPTIONS = ("-O2", "-ffp-contract=off", "-std=c11")  # a C compiler building the same text for the host
THREADS = 256  # threads a block


def kernel_name(dtype, peephole: bool) -> str:
    return f"lstmgrad_step{'_peephole' if peephole else ''}_{DTYPES[np.dtype(dtype)][0]}"


def params(peephole: bool) -> tuple[tuple[str, str], ...]:
    return PARAMS + PEEPHOLE_PARAMS if peephole else PARAMS


KERNELS = tuple(kernel_name(dtype, peephole) for dtype in DTYPES for peephole in (False, True))

_PRELUDE = r"""
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define KERNEL extern "C" __global__
#define DEVICE static __device__ __forceinline__
#define RESTRICT __restrict__
#define FOR_EACH_ELEMENT(e, n) \
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < (n); \
         e += (long long)gridDim.x * blockDim.x)
DEVICE float half_to_float(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
DEVICE unsigned short float_to_half(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
#else  /* the host: one element after another */
#include <string.h>
#define KERNEL
#define DEVICE static inline
#define RESTRICT restrict
#define FOR_EACH_ELEMENT(e, n) for (long long e = 0; e < (n); ++e)
DEVICE float half_to_float(unsigned short h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
DEVICE unsigned short float_to_half(float f) {
    _Float16 v = (_Float16)f; unsigned short h; memcpy(&h, &v, 2); return h;
}
#endif
/* ld: an element as computed; st: a computed value as stored; rd: a result rounded to the compute dtype */
DEVICE float ld_f16(unsigned short h) { return half_to_float(h); }
DEVICE unsigned short st_f16(float x) { return float_to_half(x); }
DEVICE float rd_f16(float x) { return half_to_float(float_to_half(x)); }
DEVICE float ld_f32(float x) { return x; }
DEVICE float st_f32(float x) { return x; }
DEVICE float rd_f32(float x) { return x; }
DEVICE double ld_f64(double x) { return x; }
DEVICE double st_f64(double x) { return x; }
DEVICE double rd_f64(double x) { return x; }
"""

# One element e = b * C + c of a step; gate g's gradient goes to gates[b, off_g * C + c] ([B, 4C]).  Lines marked
# PEEPHOLE are the peephole kernels' alone.
_BODY = r"""
    FOR_EACH_ELEMENT(e, n) {
        const long long b = e / C, c = e - b * C;
        T* gate = gates + b * 4LL * C + c;
        const S one = 1;
        const S iv = LD(in_gate[e]), fv = LD(f[e]), ov = LD(o[e]), civ = LD(ci[e]), cov = LD(co[e]);
        const S csp = LD(cs_prev[e]);
        const S dh = RD(LD(carried_h[e]) + LD(h_grad[e]));
        const S dc = RD(LD(carried_cs[e]) + LD(cs_grad[e]));
        const S d_o = RD(RD(RD(ov * RD(one - ov)) * dh) * cov);              /* ((o (1-o)) dh) co */
        S dcs = RD(RD(RD(RD(one - RD(cov * cov)) * dh) * ov) + dc);           /* (((1 - co co) dh) o) + dc */
        PEEPHOLE dcs = RD(dcs + RD(d_o * LD(wco[c])));                        /* ... + do wco */
        const S d_c = RD(RD(RD(one - RD(civ * civ)) * dcs) * iv);             /* ((1 - ci ci) dcs) i */
        const S d_f = RD(RD(RD(fv * RD(one - fv)) * dcs) * csp);              /* ((f (1-f)) dcs) cs_prev */
        const S d_i = RD(RD(RD(iv * RD(one - iv)) * dcs) * civ);              /* ((i (1-i)) dcs) ci */
        gate[off_i * C] = ST(d_i);
        gate[off_f * C] = ST(d_f);
        gate[off_c * C] = ST(d_c);
        gate[off_o * C] = ST(d_o);
        S carried = RD(dcs * fv);                                             /* cs_prev_grad = dcs f */
        PEEPHOLE carried = RD(RD(carried + RD(d_i * LD(wci[c]))) + RD(d_f * LD(wcf[c])));
        new_cs[e] = ST(carried);
        PEEPHOLE acc_i[e] = ST(RD(LD(acc_i[e]) + RD(d_i * csp)));
        PEEPHOLE acc_f[e] = ST(RD(LD(acc_f[e]) + RD(d_f * csp)));
        PEEPHOLE acc_o[e] = ST(RD(LD(acc_o[e]) + RD(d_o * LD(cs[e]))));
    }
"""


def _kernel(dtype, peephole: bool) -> str:
    suffix, stored, computed = DTYPES[np.dtype(dtype)]
    args = ", ".join(f"{ctype.replace('T', stored)}{' RESTRICT' if '*' in ctype else ''} {name}"
                     for ctype, name in params(peephole))
    body = "".join(line.replace("PEEPHOLE ", "") for line in _BODY.splitlines(keepends=True)
                   if peephole or "PEEPHOLE " not in line)
    return (f"KERNEL void {kernel_name(dtype, peephole)}({args})\n{{"
            f"\n#define T {stored}\n#define S {computed}\n#define LD ld_{suffix}\n#define ST st_{suffix}"
            f"\n#define RD rd_{suffix}\n{body}#undef T\n#undef S\n#undef LD\n#undef ST\n#undef RD\n}}\n")


def source() -> str:
    """The whole translation unit: every kernel ``KERNELS`` names."""
    return _PRELUDE + "".join(_kernel(dtype, peephole) for dtype in DTYPES for peephole in (False, True))


def module(cp):
    """The kernels compiled by cupy for its current device (on first use; cupy caches the binary on disk)."""
    return cp.RawModule(code=source(), options=OPTIONS, name_expressions=None)


def blocks(n: int) -> int:
    """Blocks of ``THREADS`` for ``n`` elements (the kernels loop when there are more)."""
    return max(1, min(-(-n // THREADS), 2**31 - 1))


@dataclass(frozen=True)
class Compiled:
    """What NVRTC made of ``source()`` for one architecture: ``ok``, its log, the binary's size."""

    arch: str
    ok: bool
    log: str
    size: int


def compile_for_arch(arch: str, code: str | None = None) -> Compiled:
    """``code`` (by default ``source()``) compiled by NVRTC for ``arch`` (``sm_90``, ``compute_90``) without a GPU:
    the ``cuda-bindings`` and ``nvidia-cuda-nvrtc`` wheels.  ImportError when they are not installed, ValueError for
    an architecture this NVRTC does not know."""
    from cuda.bindings import nvrtc  # noqa: PLC0415 - only to build kernels without a GPU

    def check(result):
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
        return rest[0] if len(rest) == 1 else rest

    if not arch.replace("_", "").isalnum() or not arch.startswith(("sm_", "compute_")):
        raise ValueError(f"arch {arch!r} is not an architecture such as sm_90 or compute_90")
    supported = check(nvrtc.nvrtcGetSupportedArchs())
    number = arch.split("_", 1)[1]
    if not number.isdigit() or int(number) not in supported:
        raise ValueError(f"arch {arch!r} is not one this NVRTC compiles for (sm_{', sm_'.join(map(str, supported))})")
    program = check(nvrtc.nvrtcCreateProgram((code or source()).encode(), b"lstmgrad_kernels.cu", 0, [], []))
    try:
        options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in OPTIONS)]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        size = check(nvrtc.nvrtcGetProgramLogSize(program))
        log = bytearray(size)  # (NVRTC writes into it: never a bytes object, b" " * 1 is Python's shared b" ")
        check(nvrtc.nvrtcGetProgramLog(program, log))
        ok = err == nvrtc.nvrtcResult.NVRTC_SUCCESS
        binary = 0
        if ok:
            binary = check(nvrtc.nvrtcGetCUBINSize(program) if arch.startswith("sm_") else
                           nvrtc.nvrtcGetPTXSize(program))
        return Compiled(arch, ok, bytes(log).rstrip(b"\x00 ").decode(errors="replace"), binary)
    finally:
        nvrtc.nvrtcDestroyProgram(program)

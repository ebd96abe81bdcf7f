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
LOOP_THREADS = 512  # threads a block of the loop kernel (one block a multiprocessor: 16 warps to hide latency)


# The time loop of a chunk of steps in one launch (``loop_name``): a step's elementwise work (phase a) and its
# recurrent product carried_h = gates[k] @ w_rec^T (phase b) for every step of the chunk, last first.  Each block
# owns a range of the C columns of carried_h and carried_cs: phase a of a step needs only its own columns, and
# phase b its own columns of every row of w_rec ([C, 4C], w's recurrent rows) but every block's gate gradients, so
# the grid meets once a step, between the two.
LOOP_PARAMS = (
    ("int", "n"), ("int", "B"), ("int", "C"), ("int", "off_i"), ("int", "off_f"), ("int", "off_c"), ("int", "off_o"),
    ("int", "first"),
    ("const T*", "in_gate_all"), ("const T*", "f_all"), ("const T*", "o_all"), ("const T*", "ci_all"),
    ("const T*", "co_all"), ("const T*", "h_grad_all"), ("const T*", "cs_grad_all"),
    ("const T*", "cs_ext"), ("const T*", "cs_prev0"), ("const T*", "w_rec"),
    ("T*", "carried_h"), ("T*", "carried_cs"), ("T*", "gates_all"),
)
LOOP_PEEPHOLE_PARAMS = (("const T*", "wci"), ("const T*", "wcf"), ("const T*", "wco"),
                        ("T*", "acc_i"), ("T*", "acc_f"), ("T*", "acc_o"))
LOOP_MOST_BLOCKS = 1024  # blocks of a loop launch, at most (one a multiprocessor, and at most one a column)

_LOOP_A = r"""
    const long long BC = (long long)B * C, step = (long long)k * BC;
    const int c0 = (int)((long long)C * blk / blocks), cols = (int)((long long)C * (blk + 1) / blocks) - c0;
    const T* in_gate = in_gate_all + step; const T* f = f_all + step; const T* o = o_all + step;
    const T* ci = ci_all + step; const T* co = co_all + step;
    const T* h_grad = h_grad_all + step; const T* cs_grad = cs_grad_all + step;
    const T* cs_prev = k + first > 0 ? cs_ext + (k + first - 1) * BC : cs_prev0;  /* cs of the step before */
    PEEPHOLE const T* cs = cs_ext + (k + first) * BC;
    T* gates = gates_all + (long long)k * B * 4LL * C;
    T* new_cs = carried_cs;  /* in place: each element is read before it is written, by the same thread */
    FOR_EACH_IN_BLOCK(j, (long long)B * cols) {
        const long long b = j / cols, c = c0 + (j - b * cols), e = b * C + c;
@ELEMENT@    }
"""
_LOOP_B = r"""
    const int c0 = (int)((long long)C * blk / blocks), cols = (int)((long long)C * (blk + 1) / blocks) - c0;
    const int groups = (cols + COLS_AT_ONCE - 1) / COLS_AT_ONCE;
    const long long G = 4LL * C;
    const T* gates = gates_all + (long long)k * B * G;
    /* carried_h[b, c] = gates[k, b, :] . w_rec[c, :] for up to COLS_AT_ONCE of the block's columns c at once, one
       warp a row b: lane l sums every LANES-th product from q = l (the warp's reads of a row make whole cache lines,
       and each gate is read once for all those columns), then the lanes' sums meet in a fixed tree */
    FOR_EACH_WARP_IN_BLOCK(j, (long long)B * groups) {
        const long long b = j / groups;
        const int c_lo = c0 + (int)(j - b * groups) * COLS_AT_ONCE;
        const int n_c = c0 + cols - c_lo < COLS_AT_ONCE ? c0 + cols - c_lo : COLS_AT_ONCE;
        const T* g = gates + b * G;
        LANE_SUMS(sum, COLS_AT_ONCE);
        FOR_EACH_LANE(lane) {
            S part[COLS_AT_ONCE];
            UNROLL for (int m = 0; m < COLS_AT_ONCE; ++m) part[m] = 0;
            UNROLL_LOADS for (long long q = lane; q < G; q += LANES) {
                const S gate = LD(LOAD_SHARED(g + q));
                UNROLL for (int m = 0; m < COLS_AT_ONCE; ++m) {
                    if (m < n_c) part[m] += gate * LD(w_rec[(c_lo + m) * G + q]);
                }
            }
            UNROLL for (int m = 0; m < COLS_AT_ONCE; ++m) LANE_SUM(sum, m, lane) = part[m];
        }
        UNROLL for (int m = 0; m < COLS_AT_ONCE; ++m) {
            if (m < n_c) {
                WARP_TREE_SUM(sum, m);
                FIRST_LANE carried_h[b * C + c_lo + m] = ST(LANE_SUM(sum, m, 0));
            }
        }
    }
"""


def loop_name(dtype, peephole: bool) -> str:
    return f"lstmgrad_loop{'_peephole' if peephole else ''}_{DTYPES[np.dtype(dtype)][0]}"


def loop_params(peephole: bool) -> tuple[tuple[str, str], ...]:
    """The loop kernel's parameters; the device's takes ``barrier`` (unsigned int[3], zeros) after them, the host
    build ``blocks`` (how many blocks to run one after another)."""
    return LOOP_PARAMS + LOOP_PEEPHOLE_PARAMS if peephole else LOOP_PARAMS


def _loop(dtype, peephole: bool) -> str:
    name = loop_name(dtype, peephole)
    names = loop_params(peephole)
    signature = _signature(names, dtype, restrict=False)
    arguments = ", ".join(n for _, n in names)
    phase_a = _typed(_LOOP_A.replace("@ELEMENT@", _ELEMENT), dtype, peephole)
    phase_b = _typed(_LOOP_B, dtype, peephole)
    return (
        f"DEVICE void {name}_a(int blk, int blocks, int k, {signature})\n{{\n{phase_a}}}\n"
        f"DEVICE void {name}_b(int blk, int blocks, int k, {signature})\n{{\n{phase_b}}}\n"
        "#if defined(__CUDACC_RTC__) || defined(__CUDACC__)\n"
        f"KERNEL __launch_bounds__({LOOP_THREADS}) void {name}({signature}, unsigned int* barrier)\n{{\n"
        "    for (int k = n - 1; k >= 0; --k) {\n"
        f"        {name}_a(blockIdx.x, gridDim.x, k, {arguments});\n"
        "        if (grid_barrier(barrier, gridDim.x)) return;\n"
        f"        {name}_b(blockIdx.x, gridDim.x, k, {arguments});\n"
        "        __syncthreads();\n"
        "    }\n}\n"
        "#else\n"
        f"KERNEL void {name}_host({signature}, int blocks)\n{{\n"
        "    for (int k = n - 1; k >= 0; --k) {\n"
        f"        for (int blk = 0; blk < blocks; ++blk) {name}_a(blk, blocks, k, {arguments});\n"
        f"        for (int blk = 0; blk < blocks; ++blk) {name}_b(blk, blocks, k, {arguments});\n"
        "    }\n}\n"
        "#endif\n")


def kernel_name(dtype, peephole: bool) -> str:
    return f"lstmgrad_step{'_peephole' if peephole else ''}_{DTYPES[np.dtype(dtype)][0]}"


def params(peephole: bool) -> tuple[tuple[str, str], ...]:
    return PARAMS + PEEPHOLE_PARAMS if peephole else PARAMS


def batch_sum_name(dtype) -> str:
    return f"lstmgrad_batch_sum_{DTYPES[np.dtype(dtype)][0]}"


# The sum over the batch of a [B, n] array (the peephole gradients' last step): rows in order, each sum rounded to
# the dtype, as the numpy backend sums them (``XpGradient.batch_sum``); a parallel reduction would round otherwise.
BATCH_SUM_PARAMS = (("long long", "n"), ("int", "B"), ("const T*", "rows"), ("T*", "total"))
_BATCH_SUM = r"""
    FOR_EACH_ELEMENT(c, n) {
        S sum = B > 0 ? LD(rows[c]) : (S)0;
        for (long long b = 1; b < B; ++b) {
            sum = RD(sum + LD(rows[b * n + c]));
        }
        total[c] = ST(sum);
    }
"""

KERNELS = (*(name(dtype, peephole) for name in (kernel_name, loop_name) for dtype in DTYPES
             for peephole in (False, True)), *(batch_sum_name(dtype) for dtype in DTYPES))

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
#define FOR_EACH_IN_BLOCK(j, n) for (long long j = threadIdx.x; j < (n); j += blockDim.x)
/* One warp an element (its lanes in turn at the element's terms): the lanes' partial sums meet in a shuffle tree,
   lane l adding lane l + 16, then l + 8, ... 1, and lane 0 holds the sum; the host build adds in that order. */
#define LANES 32
#define COLS_AT_ONCE 8
#define FOR_EACH_WARP_IN_BLOCK(j, n) \
    for (long long j = threadIdx.x / LANES; j < (n); j += blockDim.x / LANES)
#define LANE_SUMS(sum, m) S sum[m]
#define FOR_EACH_LANE(lane) for (int lane = threadIdx.x % LANES, once_ = 1; once_; once_ = 0)
#define LANE_SUM(sum, m, lane) sum[m]
#define WARP_TREE_SUM(sum, m) \
    for (int offset = LANES / 2; offset > 0; offset /= 2) { \
        sum[m] += __shfl_down_sync(0xffffffffu, sum[m], offset); \
    }
#define UNROLL _Pragma("unroll")
/* a lane's loop over a row: several iterations' loads issued before their sums (the sums keep their order) */
#define UNROLL_LOADS _Pragma("unroll 4")
#define FIRST_LANE if (threadIdx.x % LANES == 0)
/* what other blocks wrote before the grid barrier: read from L2 (__ldcg), never from a stale line of this SM's L1 */
#define LOAD_SHARED(p) __ldcg(p)
/* All blocks of the grid meet here (they are all resident: the loop is launched with at most one block a
   multiprocessor).  barrier[0] counts arrivals, barrier[1] is the generation, barrier[2] is set when a block waited
   past WAIT_CYCLES, about a second (blocks not resident after all: another program holds part of the GPU): every
   block then stops, and the host says so. */
#define WAIT_CYCLES (1ll << 31)
DEVICE int grid_barrier(unsigned int* barrier, unsigned int blocks) {
    __shared__ int failed;
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned int* generation = barrier + 1;
        volatile unsigned int* stop = barrier + 2;
        const unsigned int gen = *generation;
        __threadfence();
        failed = 0;
        if (atomicAdd(barrier, 1u) == blocks - 1) {
            atomicExch(barrier, 0u);
            __threadfence();
            atomicAdd(barrier + 1, 1u);
        } else {
            const long long began = clock64();
            while (*generation == gen && !*stop) {
                if (clock64() - began > WAIT_CYCLES) { atomicExch(barrier + 2, 1u); }
            }
            failed = *stop != 0;
        }
        __threadfence();
    }
    __syncthreads();
    return failed;
}
#else  /* the host: one element after another */
#include <string.h>
#define KERNEL
#define DEVICE static inline
#define RESTRICT restrict
#define FOR_EACH_ELEMENT(e, n) for (long long e = 0; e < (n); ++e)
#define FOR_EACH_IN_BLOCK(j, n) for (long long j = 0; j < (n); ++j)
#define LANES 32
#define COLS_AT_ONCE 8
#define FOR_EACH_WARP_IN_BLOCK(j, n) for (long long j = 0; j < (n); ++j)
#define LANE_SUMS(sum, m) S sum[m][LANES]
#define FOR_EACH_LANE(lane) for (int lane = 0; lane < LANES; ++lane)
#define LANE_SUM(sum, m, lane) sum[m][lane]
#define WARP_TREE_SUM(sum, m) \
    for (int offset = LANES / 2; offset > 0; offset /= 2) { \
        for (int lane = 0; lane < offset; ++lane) { sum[m][lane] += sum[m][lane + offset]; } \
    }
#define UNROLL
#define UNROLL_LOADS
#define FIRST_LANE
#define LOAD_SHARED(p) (*(p))
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
# PEEPHOLE are the peephole kernels' alone.  It reads carried_cs[e] before it writes new_cs[e]: the two may be one.
_ELEMENT = r"""
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
"""
_STEP = r"""
    FOR_EACH_ELEMENT(e, n) {
        const long long b = e / C, c = e - b * C;
@ELEMENT@    }
"""


def _typed(text: str, dtype, peephole: bool) -> str:
    """``text`` with its PEEPHOLE lines kept (marks dropped) or removed, between the dtype's macros."""
    suffix, stored, computed = DTYPES[np.dtype(dtype)]
    body = "".join(line.replace("PEEPHOLE ", "") for line in text.splitlines(keepends=True)
                   if peephole or "PEEPHOLE " not in line)
    return (f"#define T {stored}\n#define S {computed}\n#define LD ld_{suffix}\n#define ST st_{suffix}"
            f"\n#define RD rd_{suffix}\n{body}#undef T\n#undef S\n#undef LD\n#undef ST\n#undef RD\n")


def _signature(names, dtype, restrict: bool = True) -> str:
    stored = DTYPES[np.dtype(dtype)][1]
    return ", ".join(f"{ctype.replace('T', stored)}{' RESTRICT' if restrict and '*' in ctype else ''} {name}"
                     for ctype, name in names)


def _kernel(dtype, peephole: bool) -> str:
    body = _STEP.replace("@ELEMENT@", _ELEMENT)
    return (f"KERNEL void {kernel_name(dtype, peephole)}({_signature(params(peephole), dtype)})\n{{\n"
            f"{_typed(body, dtype, peephole)}}}\n")


def _batch_sum(dtype) -> str:
    return (f"KERNEL void {batch_sum_name(dtype)}({_signature(BATCH_SUM_PARAMS, dtype)})\n{{\n"
            f"{_typed(_BATCH_SUM, dtype, False)}}}\n")


def source() -> str:
    """The whole translation unit: every kernel ``KERNELS`` names."""
    return _PRELUDE + "".join(_kernel(dtype, peephole) + _loop(dtype, peephole)
                              for dtype in DTYPES for peephole in (False, True)) + "".join(map(_batch_sum, DTYPES))


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

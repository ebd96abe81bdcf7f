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
# recurrent product carried_h = gates[k] @ w_rec^T (phase b) for every step of the chunk, last first.  The blocks
# split the [B, C] step into row groups x column groups (``loop_grid``): phase a of a step needs only the block's own
# elements, and phase b the block's rows of every block's gate gradients (a copy of them laid out [4C, B],
# ``gates_t``, so that a warp's reads of 32 rows make one cache line) and its own columns' rows of w_rec ([C, 4C]:
# w's recurrent rows, held in shared memory for the whole launch), so the grid meets once a step, between the two.
LOOP_PARAMS = (
    ("int", "n"), ("int", "B"), ("int", "C"), ("int", "off_i"), ("int", "off_f"), ("int", "off_c"), ("int", "off_o"),
    ("int", "first"),
    ("const T*", "in_gate_all"), ("const T*", "f_all"), ("const T*", "o_all"), ("const T*", "ci_all"),
    ("const T*", "co_all"), ("const T*", "h_grad_all"), ("const T*", "cs_grad_all"),
    ("const T*", "cs_ext"), ("const T*", "cs_prev0"), ("const T*", "w_rec"),
    ("T*", "carried_h"), ("T*", "carried_cs"), ("T*", "gates_all"), ("T*", "gates_t2"),
)
LOOP_PEEPHOLE_PARAMS = (("const T*", "wci"), ("const T*", "wcf"), ("const T*", "wco"),
                        ("T*", "acc_i"), ("T*", "acc_f"), ("T*", "acc_o"))
LOOP_MOST_BLOCKS = 1024  # blocks of a loop launch, at most (one a multiprocessor)
LOOP_WIDTHS = (1, 2, 4, 8, 16)  # the product's column counts, compiled each: a block's columns round up to one
LOOP_MOST_COLUMNS = LOOP_WIDTHS[-1]  # columns of carried_h a block of the loop owns, at most (a thread's sums are
# registers)
LOOP_LOADS = 8  # gate gradients a thread of the loop's product loads before it adds their terms (in order)
LOOP_WIDEST_PREFERRED = 8  # columns at once a split keeps to where it can (``loop_grid``)
# Shared memory a loop kernel declares itself (the grid barrier's flag), at most: CUDA counts it with the dynamic
# shared memory against a block's limit (a test reads ptxas's report of it)
LOOP_STATIC_SHARED_MOST = 256
LOOP_LEAST_ROWS = 16  # rows a block of the loop owns, at least, when the rows are split among blocks

_LOOP_BLOCK = r"""
    int r0, rows, c0, cols;
    loop_block(blk, blocks, row_groups, B, C, &r0, &rows, &c0, &cols);
"""
_LOOP_STAGE = _LOOP_BLOCK + r"""
    /* the block's rows of w_rec into shared memory, in the compute dtype, laid out [4C, width]: a term's weights
       for the block's columns side by side, zeros past them (width: cols rounded up to a power of two) */
    const int width = loop_width(cols);
    FOR_EACH_IN_BLOCK(j, (long long)width * 4 * C) {
        const int q = (int)(j / width), m = (int)(j - (long long)q * width);
        shared[j] = m < cols ? LD(w_rec[(long long)(c0 + m) * 4 * C + q]) : (S)0;
    }
"""
_LOOP_A = _LOOP_BLOCK + r"""
    const long long BC = (long long)B * C, step = (long long)k * BC;
    const T* in_gate = in_gate_all + step; const T* f = f_all + step; const T* o = o_all + step;
    const T* ci = ci_all + step; const T* co = co_all + step;
    const T* h_grad = h_grad_all + step; const T* cs_grad = cs_grad_all + step;
    const T* cs_prev = k + first > 0 ? cs_ext + (k + first - 1) * BC : cs_prev0;  /* cs of the step before */
    PEEPHOLE const T* cs = cs_ext + (k + first) * BC;
    T* gates = gates_all + (long long)k * B * 4LL * C;
    T* gates_t = gates_t2 + (long long)(k & 1) * 4LL * C * B;  /* the same, [4C, B]; two, as a slow block may
                                                                  still read the step after's */
    T* new_cs = carried_cs;  /* in place: each element is read before it is written, by the same thread */
    FOR_EACH_IN_BLOCK(j, (long long)rows * cols) {
        const long long b = r0 + j / cols, c = c0 + (j - (j / cols) * cols), e = b * C + c;
@ELEMENT@        gates_t[(off_i * C + c) * B + b] = ST(d_i);
        gates_t[(off_f * C + c) * B + b] = ST(d_f);
        gates_t[(off_c * C + c) * B + b] = ST(d_c);
        gates_t[(off_o * C + c) * B + b] = ST(d_o);
        if (k > 0) {  /* the step before's inputs on their way to L2 while this step finishes */
            PREFETCH(in_gate + e - BC); PREFETCH(f + e - BC); PREFETCH(o + e - BC); PREFETCH(ci + e - BC);
            PREFETCH(co + e - BC); PREFETCH(h_grad + e - BC); PREFETCH(cs_grad + e - BC);
        }
    }
"""
_LOOP_B = _LOOP_BLOCK + r"""
    /* carried_h[b, c] = gates[k, b, :] . w_rec[c, :] for the block's rows and columns: the 4C terms cut into
       `slices` ranges of q; thread t takes row r = t % tile of a tile of rows and range s = t / tile, adding its
       terms in order by fused multiply-adds for `width` columns at once (a power of two at least cols, the
       weights past cols zeros), then the ranges' sums meet in a fixed tree (s takes s + span for span = 1, 2,
       4, ...) */
    if (rows == 0 || cols == 0) return;  /* (never launched so: the backend runs an empty batch's steps alone) */
    const int G = 4 * C, width = loop_width(cols);
    const T* gates_t = gates_t2 + (long long)(k & 1) * G * B;
    const S* w = shared;                          /* [4C, width] (staged) */
    S* part = shared + (long long)width * G;      /* [slices, tile, width] */
    const int tile = rows < LOOP_THREADS ? rows : LOOP_THREADS, slices = LOOP_THREADS / tile;
    for (int p0 = 0; p0 < rows; p0 += tile) {
        const int n_rows = rows - p0 < tile ? rows - p0 : tile;
        switch (width) {
@WIDTHS@        }
        SYNC_BLOCK;
        for (int span = 1; span < slices; span *= 2) {
            const int per = n_rows * cols, pairs = (slices + 2 * span - 1) / (2 * span);
            FOR_EACH_IN_BLOCK(j, pairs * per) {
                const int i = (int)j / per, rm = (int)j - i * per, r = rm / cols, m = rm - r * cols;
                const int s = 2 * span * i;
                if (s + span < slices) part[(s * tile + r) * width + m] += part[((s + span) * tile + r) * width + m];
            }
            SYNC_BLOCK;
        }
        FOR_EACH_IN_BLOCK(j, n_rows * cols) {
            const int r = (int)j / cols, m = (int)j - r * cols;
            carried_h[(long long)(r0 + p0 + r) * C + c0 + m] = ST(part[r * width + m]);
        }
        SYNC_BLOCK;
    }
"""
# One case of the product's switch: a thread's terms for WIDTH columns at once.
_LOOP_B_WIDTH = r"""        case WIDTH: FOR_EACH_THREAD(t) {
            const int r = t % tile, s = t / tile;
            if (s < slices && r < n_rows) {
                const int q0 = (int)((long long)G * s / slices), q1 = (int)((long long)G * (s + 1) / slices);
                const T* g = gates_t + r0 + p0 + r;
                S acc[WIDTH];
                UNROLL for (int m = 0; m < WIDTH; ++m) acc[m] = 0;
                int q = q0;
                for (; q + LOOP_LOADS <= q1; q += LOOP_LOADS) {  /* LOOP_LOADS loads in flight, then their sums */
                    S gate[LOOP_LOADS];
                    UNROLL for (int u = 0; u < LOOP_LOADS; ++u) gate[u] = LD(LOAD_SHARED(g + (long long)(q + u) * B));
                    UNROLL for (int u = 0; u < LOOP_LOADS; ++u) {
                        const S* wq = w + (q + u) * WIDTH;
                        UNROLL for (int m = 0; m < WIDTH; ++m) acc[m] = FMA(gate[u], wq[m], acc[m]);
                    }
                }
                for (; q < q1; ++q) {
                    const S gate = LD(LOAD_SHARED(g + (long long)q * B));
                    const S* wq = w + q * WIDTH;
                    UNROLL for (int m = 0; m < WIDTH; ++m) acc[m] = FMA(gate, wq[m], acc[m]);
                }
                UNROLL for (int m = 0; m < WIDTH; ++m) part[(s * tile + r) * WIDTH + m] = acc[m];
            }
        } break;
"""
_LOOP_B = _LOOP_B.replace("@WIDTHS@", "".join(_LOOP_B_WIDTH.replace("WIDTH", str(n)) for n in LOOP_WIDTHS))

def loop_name(dtype, peephole: bool) -> str:
    return f"lstmgrad_loop{'_peephole' if peephole else ''}_{DTYPES[np.dtype(dtype)][0]}"


def loop_params(peephole: bool) -> tuple[tuple[str, str], ...]:
    """The loop kernel's parameters; after them the device's takes ``row_groups`` and ``barrier`` (unsigned
    int[2], zeros), the host build ``row_groups`` and ``blocks`` (how many blocks to run one after another)."""
    return LOOP_PARAMS + LOOP_PEEPHOLE_PARAMS if peephole else LOOP_PARAMS


def loop_width(cols: int) -> int:
    """The columns a loop block's product computes at once for ``cols`` columns: the next power of two (the
    kernel's own ``loop_width``)."""
    return 1 << max(0, cols - 1).bit_length()


def compute_itemsize(dtype) -> int:
    """Bytes of the type a kernel computes in for ``dtype`` (float16 is computed in float32)."""
    return 8 if np.dtype(dtype) == np.float64 else 4


@dataclass(frozen=True)
class LoopGrid:
    """How a loop launch splits a [B, C] step: ``row_groups`` x ``blocks // row_groups`` column groups, and the
    shared memory a block takes (its columns' rows of w_rec and its partial sums)."""

    blocks: int
    row_groups: int
    shared_bytes: int


def loop_grid(B: int, C: int, dtype, multiprocessors: int, shared_limit: int,
              row_groups: int | None = None) -> LoopGrid | None:
    """The split of a loop launch over at most ``multiprocessors`` blocks (one each: all resident), or None when a
    block's share of w_rec cannot be held in ``shared_limit`` bytes or in ``LOOP_MOST_COLUMNS`` columns.
    ``row_groups``: that many row groups, the columns over the rest of the blocks (for tests and timing).

    Among the splits that fit, one whose block computes at most ``LOOP_WIDEST_PREFERRED`` columns at once where
    there is one, and then the one whose block does least a step, counted as its gate reads (rows x 4C) and its
    multiply-adds (rows x cols x 4C) at four multiply-adds a read: rows x (4 + cols).  More row groups read fewer
    rows but own more columns; a block keeps at least ``LOOP_LEAST_ROWS`` rows, as one warp's reads of a column
    of the gates are then at least half a cache line.  Timed on an H100 (benchmarks/RESULTS.md), a step with 16
    columns at once was slower than with 8 and twice the rows (200,128,512,512: 24.1 against 22.1 us;
    1000,64,512,512: 16.5 against 13.9 us), and fewer than 16 rows a block slower than 16 or more."""
    if B <= 0 or C <= 0:
        return None  # (nothing to loop over: the backend runs such a pass a step at a time)
    best = None
    most = max(1, min(multiprocessors, LOOP_MOST_BLOCKS))
    most_groups = min(B, most)
    for groups in range(1, most_groups + 1) if row_groups is None else [g for g in (row_groups,) if g <= most_groups]:
        rows = -(-B // groups)
        if row_groups is None and groups > 1 and rows < LOOP_LEAST_ROWS:
            break
        col_blocks = min(C, most // groups)
        cols = -(-C // col_blocks)
        width = loop_width(cols)
        shared = (width * 4 * C + LOOP_THREADS * width) * compute_itemsize(dtype)
        if cols > LOOP_MOST_COLUMNS or shared > shared_limit:
            continue
        cost = (width > LOOP_WIDEST_PREFERRED, rows * (4 + cols))
        if best is None or cost < best[0]:
            best = (cost, LoopGrid(groups * col_blocks, groups, shared))
    return None if best is None else best[1]


def _loop(dtype, peephole: bool) -> str:
    name = loop_name(dtype, peephole)
    names = loop_params(peephole)
    signature = _signature(names, dtype, restrict=False)
    arguments = ", ".join(n for _, n in names)
    computed = DTYPES[np.dtype(dtype)][2]
    head = f"(int blk, int blocks, int row_groups, int k, {computed}* shared, {signature})"
    phases = "".join(f"DEVICE void {name}_{part}{head}\n{{\n{_typed(text, dtype, peephole)}}}\n"
                     for part, text in (("stage", _LOOP_STAGE), ("a", _LOOP_A.replace("@ELEMENT@", _ELEMENT)),
                                        ("b", _LOOP_B)))
    call = f"(blockIdx.x, gridDim.x, row_groups, k, shared, {arguments});"
    host_call = f"(blk, blocks, row_groups, k, shared, {arguments});"
    return (
        phases +
        "#if defined(__CUDACC_RTC__) || defined(__CUDACC__)\n"
        f"KERNEL __launch_bounds__({LOOP_THREADS}) void {name}({signature}, int row_groups, unsigned int* barrier)"
        "\n{\n"
        f"    {computed}* shared = ({computed}*)lstmgrad_shared;\n"
        "    if (*(volatile unsigned int*)(barrier + 1)) return;  /* a launch before in the pass gave up */\n"
        f"    {{ const int k = n - 1; {name}_stage{call} }}\n"
        "    __syncthreads();\n"
        "    for (int k = n - 1; k >= 0; --k) {\n"
        f"        {name}_a{call}\n"
        "        if (grid_barrier(barrier, gridDim.x)) return;\n"
        f"        {name}_b{call}\n"
        "    }\n}\n"
        "#else\n"
        f"KERNEL void {name}_host({signature}, int row_groups, int blocks)\n{{\n"
        "    const int col_blocks = blocks / row_groups, most = loop_width((C + col_blocks - 1) / col_blocks);\n"
        f"    {computed}* shared = ({computed}*)malloc(sizeof({computed}) * (size_t)most * "
        f"(4 * (size_t)C + {LOOP_THREADS}));\n"
        "    if (!shared) return;\n"
        "    for (int k = n - 1; k >= 0; --k) {\n"
        f"        for (int blk = 0; blk < blocks; ++blk) {name}_a{host_call}\n"
        f"        for (int blk = 0; blk < blocks; ++blk) {{ {name}_stage{host_call} {name}_b{host_call} }}\n"
        "    }\n"
        "    free(shared);\n}\n"
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
#define FOR_EACH_THREAD(t) for (int t = threadIdx.x, once_ = 1; once_; once_ = 0)
#define SYNC_BLOCK __syncthreads()
#define UNROLL _Pragma("unroll")
/* what other blocks wrote before the grid barrier: read from L2 (__ldcg), never from a stale line of this SM's L1 */
#define LOAD_SHARED(p) __ldcg(p)
#define PREFETCH(p) asm volatile("prefetch.global.L2 [%0];" :: "l"(p))
extern __shared__ double lstmgrad_shared[];  /* a loop block's: its share of w_rec, then its partial sums */
DEVICE float fma_f(float a, float b, float c) { return fmaf(a, b, c); }
DEVICE double fma_d(double a, double b, double c) { return fma(a, b, c); }
/* All blocks of the grid meet here (they are all resident: the loop is launched with at most one block a
   multiprocessor).  barrier[0] counts arrivals (zero at the launch), barrier[1] is set when a block waited past
   WAIT_CYCLES, about a second (blocks not resident after all: another program holds part of the GPU): every block
   then stops, and the host says so. */
#define WAIT_CYCLES (1ll << 31)
DEVICE int grid_barrier(unsigned int* barrier, unsigned int blocks) {
    __shared__ int failed;
    __syncthreads();
    if (threadIdx.x == 0) {
        /* one atomic a block: block 0 adds 2^31 - (blocks - 1), the others 1, so the counter's top bit flips
           when the last one arrives, and every block waits for that flip */
        volatile unsigned int* arrived = barrier;
        volatile unsigned int* stop = barrier + 1;
        const unsigned int add = blockIdx.x == 0 ? 0x80000000u - (blocks - 1) : 1u;
        __threadfence();
        const unsigned int before = atomicAdd(barrier, add);
        failed = 0;
        const long long began = clock64();
        while (((before ^ *arrived) & 0x80000000u) == 0 && !*stop) {
            if (clock64() - began > WAIT_CYCLES) { atomicExch(barrier + 1, 1u); }
        }
        failed = *stop != 0;
        __threadfence();
    }
    __syncthreads();
    return failed;
}
#else  /* the host: one element after another */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#define KERNEL
#define DEVICE static inline
#define RESTRICT restrict
#define FOR_EACH_ELEMENT(e, n) for (long long e = 0; e < (n); ++e)
#define FOR_EACH_IN_BLOCK(j, n) for (long long j = 0; j < (n); ++j)
#define FOR_EACH_THREAD(t) for (int t = 0; t < LOOP_THREADS; ++t)
#define SYNC_BLOCK
#define UNROLL
#define LOAD_SHARED(p) (*(p))
#define PREFETCH(p) (void)(p)
DEVICE float fma_f(float a, float b, float c) { return fmaf(a, b, c); }  /* C's fmaf: one rounding, as the GPU's */
DEVICE double fma_d(double a, double b, double c) { return fma(a, b, c); }
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
/* A loop block's share of a [B, C] step: row group blk / col_blocks, column group blk % col_blocks, each range cut
   as evenly as integers allow */
DEVICE void loop_block(int blk, int blocks, int row_groups, int B, int C, int* r0, int* rows, int* c0, int* cols) {
    const int col_blocks = blocks / row_groups, rg = blk / col_blocks, cb = blk - rg * col_blocks;
    *r0 = (int)((long long)B * rg / row_groups);
    *rows = (int)((long long)B * (rg + 1) / row_groups) - *r0;
    *c0 = (int)((long long)C * cb / col_blocks);
    *cols = (int)((long long)C * (cb + 1) / col_blocks) - *c0;
}
DEVICE int loop_width(int cols) { int w = 1; while (w < cols) w *= 2; return w; }
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
    fma = "fma_d" if computed == "double" else "fma_f"
    return (f"#define T {stored}\n#define S {computed}\n#define LD ld_{suffix}\n#define ST st_{suffix}"
            f"\n#define RD rd_{suffix}\n#define FMA {fma}\n{body}"
            "#undef T\n#undef S\n#undef LD\n#undef ST\n#undef RD\n#undef FMA\n")


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
    sizes = f"#define LOOP_THREADS {LOOP_THREADS}\n#define LOOP_LOADS {LOOP_LOADS}\n"
    return sizes + _PRELUDE + "".join(_kernel(dtype, peephole) + _loop(dtype, peephole)
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


def compile_for_arch(arch: str, code: str | None = None, extra_options: tuple[str, ...] = ()) -> Compiled:
    """``code`` (by default ``source()``) compiled by NVRTC for ``arch`` (``sm_90``, ``compute_90``) without a GPU:
    the ``cuda-bindings`` and ``nvidia-cuda-nvrtc`` wheels.  ImportError when they are not installed, ValueError for
    an architecture this NVRTC does not know.  ``extra_options`` follow ``OPTIONS`` (``--ptxas-options=-v`` puts
    each kernel's registers and shared memory in the log)."""
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
        options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in (*OPTIONS, *extra_options))]
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

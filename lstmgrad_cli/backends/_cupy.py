"""The cupy backend: the numpy backend's array code (``_xp``) on a CUDA device, plus fused kernels.

The inputs are copied to the device once, or a chunk of steps at a time: the time-major inputs of a call that
crosses through the pinned buffers and that the device cannot hold whole (``ChunkFeed``: each chunk's copies run
while the device computes the chunk before), and a lazy input's (an HDF5 or NPZ file's).  The whole backward pass
runs there (cuBLAS for the matrix products, the time loop in fused kernels: ``_cupy_kernels``), and the outputs
are copied back once (a lazy x_grad output a chunk at a time).  The kernels keep TensorFlow's bracketing and
contract no multiply-add: results equal the numpy backend's up to the matrix products.

Usable only when ``cupy.is_available()`` (cupy installed *and* a CUDA device); the registry checks
that before importing this module.  Without a GPU the test suite runs all of it on the CPU: the
shared ``_xp`` code on numpy, and the kernels' own C text compiled for the host.
"""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np

from ..errors import BackendUnavailableError
from ..spec import TIME_MAJOR
from . import _cupy_kernels as kernels
from . import gpu_array, on_gpu
from ._cupy_copies import ChunkFeed, PackedCopies, PinnedCopies
from ._xp import CHUNK_BYTES, XpGradient, chunk_step_bytes, default_chunk_steps

COPIES_ENV = "LSTMGRAD_CUPY_COPIES"
COPIES = ("auto", "pageable", "pinned")  # how host arrays cross: cupy's own copies, _cupy_copies.PinnedCopies, or
# ("auto", the default) the pinned buffers for a call's arrays of PINNED_LEAST_BYTES or more in all, and below that
# packed into one pinned buffer and one copy each way (_cupy_copies.PackedCopies).
# Measured on an H100 (benchmarks/RESULTS.md, three runs): through the pinned buffers 2.0-2.3x faster at 0.5-1.4 GB
# of inputs, 1.1-1.2x at 60-75 MB, and level or up to 10% slower at 7 MB (one staging buffer is 32 MB: below it
# nothing overlaps).
PINNED_LEAST_BYTES = 32 * 2**20
# A pass is weighed against the device's free memory as the driver last said it, for this long, when it needs at
# most half of that (CupyBackend._free_for)
FREE_MEMORY_FRESH_SECONDS = 1.0
LOOP_ENV = "LSTMGRAD_CUPY_LOOP"
LOOPS = ("auto", "steps", "persistent")
# "auto" runs a chunk's time loop in one launch where a step's recurrent product, B * C * 4C multiply-adds, is at
# most this: measured on an H100 (benchmarks/RESULTS.md, docs/speed.md), where the one launch (its blocks holding
# their share of w_rec in shared memory) won at 128 * 2**20 (200,128,512,512: 12.0 against 16.7 ms) and lost at
# 1024 * 2**20 (100,256,1024,1024: 50.5 against 21.7 ms) to cuBLAS's tiled products.  Measured in float32; float64
# and float16 (computed in float32) take the same threshold, not measured apart.
PERSISTENT_MOST_MACS = 128 * 2**20
# Host inputs crossing through the pinned buffers that the device cannot hold whole, and lazy ones (a file's), are fed
# to the device a chunk of steps at a time, in this many chunks (``ChunkFeed``): a chunk's copies run while the
# device computes the chunk before, and the device holds two chunks of the inputs.  Host arrays it can hold are
# copied at once: on an H100 that was 1.4-2.2x faster at every shape timed (200,128,512,512: 50 against 108 ms;
# benchmarks/RESULTS.md, ninth session): the host's copies into the pinned buffers bound both ways.
STREAM_CHUNKS = 8
# Budget for a pass's chunk buffers on the device (a chunk's gate gradients and [x, h_prev, 1]) where its time loop
# runs in one launch: fewer, larger chunks make fewer loop launches and larger cuBLAS products.  Measured on an H100
# (benchmarks/gpu_chunk_sizes.py, benchmarks/RESULTS.md): 200,128,512,512 8.91 ms against 9.18 with the host's
# 64 MB, 1000,64,512,512 23.15 against 24.45.  A loop of steps keeps the host's ``CHUNK_BYTES``: 100,256,1024,1024
# took 20.94 ms with it and 21.7-21.9 with 128-512 MB.  The chunks still depend on the shape alone.
PERSISTENT_CHUNK_BYTES = 512 * 2**20


def describe() -> str:
    """How the cupy backend runs its time loop and copies host arrays here, in words (cupy is not imported)."""
    loop = os.environ.get(LOOP_ENV) or "auto"
    copies = os.environ.get(COPIES_ENV) or "auto"
    loops = {"auto": f"in one launch where a step's product is at most {PERSISTENT_MOST_MACS:.2g} multiply-adds "
                     "and a block's share of w fits its shared memory, else a step at a time",
             "steps": "a step at a time", "persistent": "in one launch"}
    fed = (f"the time-major ones in {STREAM_CHUNKS} chunks of steps where the GPU cannot hold them whole, each while "
           "the device computes the one before")
    how = {"pageable": "by cupy from pageable memory", "pinned": f"through pinned staging buffers ({fed})",
           "auto": f"through pinned staging buffers from {PINNED_LEAST_BYTES // 2**20} MB a call ({fed}), below "
                   "that packed into one pinned buffer, one copy each way"}
    if loop not in loops or copies not in how:
        return f"cupy: {LOOP_ENV}={loop!r} or {COPIES_ENV}={copies!r} is not a setting it takes"
    return (f"cupy: a chunk's time loop {loops[loop]} ({LOOP_ENV}={loop}), host arrays copied {how[copies]} "
            f"({COPIES_ENV}={copies})")


class CupyGradient(XpGradient):
    """``XpGradient`` over cupy with each step's elementwise work in a kernel of ``_cupy_kernels``.

    ``loop``: how a chunk's time loop runs.  "steps": from Python, one elementwise kernel and one cuBLAS product a
    step.  "persistent": the whole chunk in one launch of the loop kernel (each block owns some columns of the
    carried gradients and of w's recurrent rows; the grid meets once a step), faster where a step's launches and
    Python cost more than its work (small batches, long sequences).  "auto" (the default): persistent where a
    step's product is at most ``PERSISTENT_MOST_MACS``.  ``LSTMGRAD_CUPY_LOOP`` sets it too.

    ``launcher``: what runs the kernels (``step``, ``loop``); by default cupy on its device, compiled on first use.
    The test suite gives one that runs the same kernels built for the host, with numpy as ``xp``.
    """

    def __init__(self, xp, launcher=None, loop: str | None = None):
        super().__init__(xp)
        self._launcher = launcher
        self._pass = threading.local()  # the pass under way in this thread: its loop launches' barrier
        loop = loop or os.environ.get(LOOP_ENV) or "auto"
        if loop not in LOOPS:
            raise BackendUnavailableError(f"{LOOP_ENV}={loop!r} is not one of {', '.join(LOOPS)}")
        self.loop = loop

    @property
    def launcher(self):
        if self._launcher is None:
            self._launcher = DeviceLauncher(self.xp)
        return self._launcher

    def step(self, a, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws, one_core=False):
        B, C = carried_h.shape
        args = [B * C, C, offsets["i"], offsets["f"], offsets["c"], offsets["o"],
                a.i, a.f, a.o, a.ci, a.co, a.h_grad, a.cs_grad, a.cs_prev, carried_h, carried_cs, gates, new_cs]
        if peep is not None:
            args += [a.cs, *peep, *acc]
        peephole = peep is not None
        self.launcher.step(kernels.kernel_name(carried_h.dtype, peephole), B * C, kernels.params(peephole), args)

    def block_lstm_grad(self, *args, **kwargs):
        """``XpGradient.block_lstm_grad``, and then whether every loop launch of the pass had all its blocks running
        (asked once, at the end: the products after a loop are queued behind it meanwhile); NotAllResident if not.
        The pass's launches share one barrier word pair (``_steps``): once a block of one gave up waiting, the
        blocks of the later ones stop at once."""
        self._pass.barrier = None
        try:
            result = super().block_lstm_grad(*args, **kwargs)
        finally:
            barrier, self._pass.barrier = self._pass.barrier, None
        if barrier is not None and int(barrier[1:].get()[0]):  # (one word back: waits for the pass)
            raise NotAllResident("the GPU's blocks of the persistent time loop were not all running at once (another "
                                 f"program is using the GPU?): use {LOOP_ENV}=steps")
        return result

    def chunk_budget(self, B: int, C: int) -> int:
        """``PERSISTENT_CHUNK_BYTES`` where a chunk's time loop runs in one launch, the host's ``CHUNK_BYTES`` where it
        runs a step at a time."""
        return PERSISTENT_CHUNK_BYTES if self.persistent(B, C) else CHUNK_BYTES

    def persistent(self, B: int, C: int) -> bool:
        """Whether a chunk's time loop runs in one launch, for a batch of B and C cells."""
        return self.loop == "persistent" or (self.loop == "auto" and B * C * 4 * C <= PERSISTENT_MOST_MACS)

    def batch_sum(self, rows):
        """The batch sum in the numpy backend's order (``XpGradient.batch_sum``), one thread a column."""
        B, C = rows.shape
        total = self.xp.empty(C, dtype=rows.dtype)
        self.launcher.step(kernels.batch_sum_name(rows.dtype), C, kernels.BATCH_SUM_PARAMS,
                           [C, B, self.xp.ascontiguousarray(rows), total])
        return total

    def _steps(self, lo, acts, cs_ext, first, cs_prev, carried_h, carried_cs, new_cs, gates, w_h_t, peep, acc,
               offsets, ws, observe, one_core=False):
        B, C = carried_h.shape
        if observe is not None or not B or not C or not self.persistent(B, C) or \
                not self._loop_fits(B, C, carried_h.dtype):
            return super()._steps(lo, acts, cs_ext, first, cs_prev, carried_h, carried_cs, new_cs, gates, w_h_t,
                                  peep, acc, offsets, ws, observe)
        xp = self.xp
        w_rec = xp.ascontiguousarray(w_h_t.T)  # w's recurrent rows [C, 4C]: a block holds its own columns'
        gates_t = xp.empty((2, 4 * C, B), dtype=gates.dtype)  # a step's gate gradients laid out [4C, B], two steps
        args = [gates.shape[0], B, C, offsets["i"], offsets["f"], offsets["c"], offsets["o"], first,
                *(acts[name] for name in ("i", "f", "o", "ci", "co", "h_grad", "cs_grad")), cs_ext, cs_prev, w_rec,
                carried_h, carried_cs, gates, gates_t]
        if peep is not None:
            args += [*peep, *acc]
        peephole = peep is not None
        if getattr(self._pass, "barrier", None) is None:  # [arrivals, stop]: zeros before the pass's first launch
            self._pass.barrier = xp.zeros(2, dtype=np.uint32)
        self.launcher.loop(kernels.loop_name(carried_h.dtype, peephole), B, C, kernels.loop_params(peephole), args,
                           self._pass.barrier)
        return carried_cs, new_cs  # (the loop updates carried_cs in place)

    def _loop_fits(self, B: int, C: int, dtype) -> bool:
        """Whether the launcher can run this loop in one launch (each block's share of w_rec in its shared
        memory); asked for by name ("persistent"), a loop that cannot is refused."""
        if self.launcher.loop_grid(B, C, dtype) is not None:
            return True
        if self.loop == "persistent":
            raise BackendUnavailableError(
                f"the persistent time loop cannot hold w's recurrent rows ({C} cells) in this GPU's shared memory: "
                f"use {LOOP_ENV}=steps")
        return False


class DeviceLauncher:
    """Runs ``_cupy_kernels``'s kernels on cupy's device; compiled on first use (cupy caches the binaries)."""

    def __init__(self, cp):
        self._cp = cp
        self._module = kernels.module(cp)
        self._functions = {}
        self._device = None

    def _function(self, name):
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = self._module.get_function(name)
        return function

    def step(self, name, n, params, args) -> None:
        typed = tuple(_typed(ctype, value) for (ctype, _), value in zip(params, args, strict=True))
        self._function(name)((kernels.blocks(n),), (kernels.THREADS,), typed)

    def loop_grid(self, B: int, C: int, dtype):
        """How a loop launch splits the step on this device (``_cupy_kernels.loop_grid``), or None."""
        if self._device is None:
            attributes = self._cp.cuda.Device().attributes
            self._device = (int(attributes["MultiProcessorCount"]),
                            int(attributes["MaxSharedMemoryPerBlockOptin"]) - kernels.LOOP_STATIC_SHARED_MOST)
        return kernels.loop_grid(B, C, dtype, *self._device)

    def loop(self, name, batch, columns, params, args, barrier):
        """A loop kernel on at most one block a multiprocessor (all resident: its blocks wait for each other every
        step).  ``barrier``: the grid barrier's two words, [arrivals, stop] (zeros before a pass's first launch,
        shared by its launches); a block that waited too long (some were not resident) sets stop, and all stop."""
        named = {pname: value for (_, pname), value in zip(params, args, strict=True)}
        grid = self.loop_grid(batch, columns, named["carried_h"].dtype)
        typed = tuple(_typed(ctype, value) for (ctype, _), value in zip(params, args, strict=True))
        function = self._function(name)
        if function.max_dynamic_shared_size_bytes < grid.shared_bytes:
            function.max_dynamic_shared_size_bytes = grid.shared_bytes
        function((grid.blocks,), (kernels.LOOP_THREADS,), (*typed, np.int32(grid.row_groups), barrier),
                 shared_mem=grid.shared_bytes)


class NotAllResident(BackendUnavailableError):
    """The persistent loop's blocks could not all run at once, so they stopped; the pass's state is spent."""


def _typed(ctype: str, value):
    """A kernel argument as cupy passes it: integers at the parameter's width, arrays (contiguous) as pointers."""
    if ctype == "long long":
        return np.int64(value)
    if ctype == "int":
        return np.int32(value)
    if not value.flags.c_contiguous:
        raise ValueError("a kernel argument is not contiguous")  # (the backend makes every input contiguous)
    return value


class CupyBackend:
    """Host arrays are copied to the device and the gradients back; arrays already there (cupy's, or anything
    ``backends.gpu_array`` takes) stay there, and so do the gradients computed from them."""

    name = "cupy"
    gpu_arrays = True

    def __init__(self, cp=None, launcher=None, loop: str | None = None, copies: str | None = None,
                 pinned_empty=None):
        if cp is None:
            import cupy as cp  # noqa: PLC0415 - imported only when this backend is used
        if not cp.is_available():
            raise BackendUnavailableError(f"cupy is installed but no CUDA device is usable{_why_not(cp)}")
        self._cp = cp
        self._gradient = CupyGradient(cp, launcher, loop)
        copies = copies or os.environ.get(COPIES_ENV) or "auto"
        if copies not in COPIES:
            raise BackendUnavailableError(f"{COPIES_ENV}={copies!r} is not one of {', '.join(COPIES)}")
        self._copies, self._pinned_empty, self._pinned, self._packed = copies, pinned_empty, None, None
        self._free_seen = None  # (time.monotonic(), free bytes) of the driver's last answer

    def _free_for(self, need: int) -> int | None:
        """Free device memory for a pass needing ``need`` bytes: the driver's answer of under
        ``FREE_MEMORY_FRESH_SECONDS`` ago while the pass takes at most half of it, else asked anew (the driver's
        query took ~50 µs of a small pass's ~0.55 ms of host time on the H100's profile)."""
        seen, now = self._free_seen, time.monotonic()
        if seen is not None and now - seen[0] < FREE_MEMORY_FRESH_SECONDS and need <= seen[1] // 2:
            return seen[1]
        free = _free_bytes(self._cp)
        self._free_seen = None if free is None else (now, free)
        return free

    @property
    def version(self) -> str:
        return self._cp.__version__

    @property
    def array_module(self):
        """The module of this backend's device arrays: cupy (contract.OPTIONAL)."""
        return self._cp

    def to_device(self, a):
        """A host array copied to the device (contract.OPTIONAL)."""
        return self._cp.ascontiguousarray(self._cp.asarray(a))

    def to_host(self, a):
        """A device array (cupy's, or any other on a GPU: ``__cuda_array_interface__``, DLPack) copied back to the
        host (contract.OPTIONAL)."""
        return np.asarray(self._cp.asnumpy(a if isinstance(a, self._cp.ndarray) else gpu_array(a)))

    def _to_device(self, arrays: list, kept: frozenset = frozenset()) -> list:
        """Arrays (None passes) on the device, C-contiguous: host ones copied there (through pinned buffers with
        ``copies="pinned"``, and with "auto" from ``PINNED_LEAST_BYTES`` in all), device ones as they are; lazy
        inputs (an HDF5 file's), and the arrays at the indexes in ``kept``, stay where they are, for the pass to
        copy a chunk of steps at a time."""
        cp = self._cp
        hosts = [i for i, a in enumerate(arrays) if a is not None and not _lazy(cp, a) and i not in kept
                 and not isinstance(a, cp.ndarray) and not on_gpu(a)]
        copier = self._copier(sum(_nbytes(arrays[i]) for i in hosts))
        staged = hosts if copier is not None else []
        out = [a if a is None or i in kept or _lazy(cp, a) or _contiguous_on(cp, a) else None if i in staged
               else cp.ascontiguousarray(cp.asarray(a)) for i, a in enumerate(arrays)]
        if staged:
            for i, copied in zip(staged, copier.to_device([arrays[i] for i in staged]), strict=True):
                out[i] = copied
        return out

    def _to_host(self, arrays: list) -> list:
        copier = self._copier(sum(int(a.nbytes) for a in arrays))
        if copier is not None:
            return copier.to_host(arrays)
        return [np.asarray(self._cp.asnumpy(a)) for a in arrays]

    def _copier(self, nbytes: int) -> PinnedCopies | PackedCopies | None:
        """How a call's host arrays of ``nbytes`` in all cross: through the staging buffers (``_pinned_copies``),
        packed into one copy each way (``copies="auto"`` below ``PINNED_LEAST_BYTES``), or None: cupy's own copies,
        an array at a time (``copies="pageable"``)."""
        staged = self._pinned_copies(nbytes)
        if staged is not None or self._copies != "auto":
            return staged
        if self._packed is None:
            self._packed = PackedCopies(self._cp, self._pinned_empty_function())
        return self._packed

    def _pinned_copies(self, nbytes: int) -> PinnedCopies | None:
        """The pinned buffers' copier for a call copying ``nbytes`` (made on first use), or None for cupy's own."""
        if self._copies == "pageable" or (self._copies == "auto" and nbytes < PINNED_LEAST_BYTES):
            return None
        if self._pinned is None:
            self._pinned = PinnedCopies(self._cp, self._pinned_empty_function())
        return self._pinned

    def _pinned_empty_function(self):
        """What makes a pinned host array: the one given, else an array over cupy's pinned memory (as cupyx's
        ``empty_pinned`` makes it)."""
        if self._pinned_empty is None:
            alloc = self._cp.cuda.alloc_pinned_memory

            def pinned_empty(shape, dtype):
                dtype = np.dtype(dtype)
                return np.ndarray(shape, dtype, buffer=alloc(max(math.prod(shape) * dtype.itemsize, 1)))

            self._pinned_empty = pinned_empty
        return self._pinned_empty

    def _fed(self, tensors, seq_len_max: int, compute_dtype, chunk_steps,
             return_dgates: bool) -> tuple[PinnedCopies, int] | None:
        """The pinned copier that feeds this pass its time-major inputs a chunk at a time (``ChunkFeed``), and the
        chunk's steps: ``chunk_steps`` when given, else ``STREAM_CHUNKS`` chunks, smaller where the pass's chunk
        buffers would outgrow their budget (``default_chunk_steps``, as a pass copied at once sizes them).
        None: copy them all at once (cupy's own copies, arrays on the device already, a single chunk, host arrays
        the device can hold whole: ``_fits_at_once``)."""
        cp = self._cp
        hosts = [getattr(tensors, name) for name in TIME_MAJOR]
        if seq_len_max < 2 or any(isinstance(a, cp.ndarray) or on_gpu(a) for a in hosts):
            return None
        copies = self._pinned_copies(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in tensors
                                         if a is not None and not isinstance(a, cp.ndarray)))
        if copies is None or (not any(_lazy(cp, a) for a in hosts)
                              and self._fits_at_once(tensors, seq_len_max, compute_dtype, return_dgates, chunk_steps)):
            return None
        T, B, I = tensors.x.shape  # noqa: E741
        C = tensors.w.shape[1] // 4
        cdt = np.dtype(compute_dtype)
        K = min(chunk_steps or min(-(-seq_len_max // STREAM_CHUNKS), default_chunk_steps(
            seq_len_max, B, C, cdt.itemsize, I, np.dtype(tensors.x.dtype) != cdt, self._gradient.chunk_budget(B, C))),
                seq_len_max)
        return None if K >= seq_len_max else (copies, K)

    def _fits_at_once(self, tensors, seq_len_max: int, compute_dtype, return_dgates: bool, chunk_steps) -> bool:
        """Whether the device's free memory holds the whole pass with its host inputs copied at once."""
        need = device_bytes(tensors, seq_len_max, compute_dtype, return_dgates, chunk_steps=chunk_steps,
                            chunk_budget=self._gradient.chunk_budget(tensors.x.shape[1], tensors.w.shape[1] // 4))
        free = self._free_for(need)
        return free is None or need <= free

    def block_lstm_grad(self, tensors, *, seq_len_max, use_peephole, layout, compute_dtype,
                        chunk_steps=None, return_dgates=False, x_grad_out=None, observe=None):
        cp = self._cp
        fed = self._fed(tensors, seq_len_max, compute_dtype, chunk_steps, return_dgates)
        copies = None
        if fed is not None:  # the time-major inputs cross a chunk of steps at a time, as the device computes,
            copies, chunk_steps = fed
            if x_grad_out is None:  # and x_grad's rows come back so (steps from seq_len_max on: zeros)
                x_grad_out = np.zeros(tensors.x.shape, dtype=tensors.x.dtype)
        _check_fits(cp, tensors, seq_len_max, compute_dtype, return_dgates, x_grad_out is not None, self._free_for,
                    streamed_steps=chunk_steps if copies is not None else None, chunk_steps=chunk_steps,
                    chunk_budget=self._gradient.chunk_budget(tensors.x.shape[1], tensors.w.shape[1] // 4))
        try:
            # Host inputs: the time-major ones fed a chunk at a time (large ones, through the pinned buffers), the
            # rest copied at once; lazy ones (an HDF5 file's) a chunk at a time; a lazy x_grad_out filled so.
            kept = frozenset(i for i, name in enumerate(tensors._fields) if copies is not None and name in TIME_MAJOR)
            on_device = type(tensors)(*self._to_device(list(tensors), kept))
            args = (on_device, seq_len_max, use_peephole, layout, compute_dtype, chunk_steps, return_dgates)
            feed = None if copies is None else lambda t, chunks, K: ChunkFeed(cp, copies, t, chunks, K)
            try:
                result = self._gradient.block_lstm_grad(*args, observe=observe, x_grad_out=x_grad_out, feed=feed)
            except NotAllResident:
                if self._gradient.loop != "auto":
                    raise
                # chosen, not asked for: the pass again from its inputs (left as they were), a step at a time
                steps = CupyGradient(self._cp, self._gradient.launcher, "steps")
                result = steps.block_lstm_grad(*args, observe=observe, x_grad_out=x_grad_out, feed=feed)
        except Exception as err:
            reported = _device_error(err)
            if reported is err:
                raise
            raise reported from err
        outs, dgates = result if return_dgates else (result, None)
        if isinstance(tensors.x, getattr(cp, "ndarray", ())):  # the caller's arrays are on the device: so are these
            return (outs, dgates) if return_dgates else outs
        back = [a for a in outs if a is not x_grad_out]  # (a lazy x_grad_out was filled as the pass went)
        copied = iter(self._to_host(back + ([dgates] if return_dgates else [])))  # one copy out
        outs = type(outs)(*(a if a is x_grad_out else next(copied) for a in outs))
        return (outs, next(copied)) if return_dgates else outs


def _why_not(cp) -> str:
    """``": <why>"`` cupy has no device (as ``backends.status`` says it, else the driver's words), or ``""``."""
    from . import status  # noqa: PLC0415 - (the registry imports this module)

    reason = status("cupy").reason
    if reason:
        return ": " + reason.split(": ", 1)[-1]
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except AttributeError:  # (not the cupy module)
        return ""
    except Exception as err:  # noqa: BLE001 - CUDARuntimeError: no driver, or one older than cupy's CUDA
        return ": " + (str(err).split(": ", 1)[-1] or type(err).__name__)
    return "" if count else ": the driver finds no CUDA device"


# Device memory a pass needs beyond its inputs and outputs: the chunk buffers (_xp.CHUNK_BYTES), cuBLAS's
# workspace and cupy's rounding of allocations.
WORKING_BYTES = 160 * 2**20


def device_bytes(tensors, seq_len_max: int, compute_dtype, return_dgates: bool = False,
                 x_grad_streamed: bool = False, streamed_steps: int | None = None, chunk_steps: int | None = None,
                 chunk_budget: int = CHUNK_BYTES) -> int:
    """About the device memory a pass of these tensors takes: every input (a lazy one, read a chunk of steps at a
    time, as ``LAZY_BYTES`` for them all; with ``streamed_steps``, the time-major ones as the feed's two chunks of
    that many steps, one more, and x_grad's rows of two chunks on their way back), the outputs (x_grad not, when it
    is ``x_grad_streamed`` to a lazy output), the gate gradients of all steps when ``return_dgates``, and
    ``WORKING_BYTES`` (chunk buffers of up to ``_xp.CHUNK_BYTES``), more where the pass's chunks of ``chunk_steps``
    steps, or those its ``chunk_budget`` gives (``CupyGradient.chunk_budget``), take more (three times that more with
    lazy inputs, whose chunks' rows and their casts are as large)."""
    fed = TIME_MAJOR if streamed_steps is not None else ()
    inputs = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for name, a in tensors._asdict().items()
                 if a is not None and hasattr(a, "__array__") and name not in fed)
    inputs += sum(2 * (streamed_steps + 1) * math.prod(getattr(tensors, name).shape[1:])
                  * np.dtype(getattr(tensors, name).dtype).itemsize for name in fed)
    lazy = LAZY_BYTES if any(a is not None and not hasattr(a, "__array__") and name not in fed
                             for name, a in tensors._asdict().items()) else 0
    T, B, I = tensors.x.shape  # noqa: E741
    C = tensors.w.shape[1] // 4
    itemsize = np.dtype(compute_dtype).itemsize
    outputs = ((0 if x_grad_streamed else T * B * I) + 2 * B * C + (I + C + 1) * 4 * C + 3 * C) * np.dtype(
        tensors.x.dtype).itemsize
    dgates = seq_len_max * B * 4 * C * itemsize if return_dgates else 0
    back = 0 if streamed_steps is None else 2 * streamed_steps * B * I * (itemsize + np.dtype(tensors.x.dtype).itemsize)
    casting = np.dtype(tensors.x.dtype) != np.dtype(compute_dtype)
    steps = min(chunk_steps or default_chunk_steps(seq_len_max, B, C, itemsize, I, casting, chunk_budget),
                max(seq_len_max, 1))
    larger = max(0, steps * chunk_step_bytes(B, C, itemsize, I, casting) - CHUNK_BYTES)  # chunks over the host's
    return inputs + lazy + outputs + dgates + back + WORKING_BYTES + larger * (3 if lazy else 1)


# A chunk of steps of the lazy inputs on the device, their rows cast to the compute dtype, and x_grad's rows on
# their way to a lazy output: the chunks are sized for the host's _xp.CHUNK_BYTES, so twice that at most (more with
# a larger chunk budget: device_bytes).
LAZY_BYTES = 2 * CHUNK_BYTES


def _contiguous_on(cp, a) -> bool:
    """A C-contiguous array of ``cp``'s device, taken as it is (two cupy calls a tensor saved: ~40 µs of a small
    pass's host time, of the H100's profile)."""
    return isinstance(a, cp.ndarray) and a.flags.c_contiguous


def _nbytes(a) -> int:
    """Bytes of a host array (numpy's, or anything with ``nbytes`` or ``__array__``), without copying it."""
    return int(a.nbytes) if hasattr(a, "nbytes") else int(np.asarray(a).nbytes)


def _lazy(cp, a) -> bool:
    """An input read by slicing (an HDF5 file's dataset), neither an array nor the device's."""
    return not hasattr(a, "__array__") and not isinstance(a, cp.ndarray)


def _check_fits(cp, tensors, seq_len_max, compute_dtype, return_dgates, x_grad_streamed=False,
                free_for=None, streamed_steps=None, chunk_steps=None, chunk_budget=CHUNK_BYTES) -> None:
    """Refuse, before anything is copied, a problem the device's free memory cannot hold (inputs already on the
    device, as the layer engine gives them, hold their memory already: not counted again).  ``free_for(need)``:
    the free memory to weigh it against (by default the driver's answer now, ``_free_bytes``)."""
    there = sum(int(a.nbytes) for a in tensors if isinstance(a, getattr(cp, "ndarray", ())))
    need = device_bytes(tensors, seq_len_max, compute_dtype, return_dgates, x_grad_streamed, streamed_steps,
                        chunk_steps, chunk_budget) - there
    free = free_for(need) if free_for is not None else _free_bytes(cp)
    if free is not None and need > free:
        raise BackendUnavailableError(
            f"the problem needs about {_mb(need)} of GPU memory and {_mb(free)} are free: compute it on the host "
            "(backend numpy or numba), or free the GPU")


def _free_bytes(cp) -> int | None:
    """Free device memory, counting what cupy's pool holds and would reuse; None when cupy does not say."""
    try:
        free = cp.cuda.Device().mem_info[0]
        return int(free) + int(cp.get_default_memory_pool().free_bytes())
    except AttributeError:  # (not the cupy module)
        return None


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB"


def _device_error(err: Exception) -> Exception:
    """What a failure on the device means, as an error the command line reports in one line."""
    if isinstance(err, BackendUnavailableError):
        return err
    kind = type(err).__name__
    if kind == "OutOfMemoryError":  # cupy.cuda.memory.OutOfMemoryError
        return BackendUnavailableError(f"the GPU ran out of memory ({' '.join(str(err).split())}): compute it on "
                                       "the host (backend numpy or numba), or free the GPU")
    if kind == "CompileException":  # cupy.cuda.compiler.CompileException: the kernels did not build for this GPU
        first = next((line.strip() for line in str(err).splitlines() if "error" in line.lower()), kind)
        return BackendUnavailableError(f"the cupy kernels did not compile for this GPU ({first}): compute on the "
                                       "host (backend numpy or numba)")
    if kind.startswith("CUDA") or type(err).__module__.startswith(("cupy", "cupy_backends")):
        return BackendUnavailableError(f"the GPU failed: {kind}: {' '.join(str(err).split())}")
    return err

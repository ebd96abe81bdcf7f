"""Host arrays to a GPU and back through pinned staging buffers, for the cupy backend (``copies="pinned"``).

cupy copies a host array, pageable memory, through the driver's own staging, one piece after another: ~7 GB/s on the
H100 machine lent here, where copies from pinned memory ran at ~54 GB/s (benchmarks/RESULTS.md).  Here each array
crosses in slices of at most ``SLICE_BYTES`` through two pinned buffers taking turns: while one slice's DMA runs on
a copy stream, the next is copied into the other buffer by ``THREADS`` host threads (numpy lets go of the GIL for
large copies), and back the other way likewise.  The cupy backend copies so a call's host arrays of 32 MB or more
in all (``LSTMGRAD_CUPY_COPIES=auto``, the default; ``pinned`` always, ``pageable`` never): on an H100 this was
2.0-2.3x faster than cupy's own copies at 0.5-1.4 GB, 1.1-1.2x at 60-75 MB, and level or slower at 7 MB
(`lstmgrad bench`'s ``cupy-pinned`` row against ``cupy``'s, benchmarks/RESULTS.md).  Where the device cannot hold
such a call's time-major inputs whole, and for a file's, they are fed to the pass a chunk of steps at a time
(``ChunkFeed``), each chunk's copies beside the device's work on the chunk before, and x_grad comes back the same
way.  A call's host arrays under 32 MB in all cross packed instead (``PackedCopies``, with ``auto``): one pinned
buffer and one DMA each way, where cupy's own copies cost ~30 µs an array.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._xp import STEP_NAMES

SLICE_BYTES = 32 * 2**20  # a staging buffer
# Host threads copying a slice into or out of a staging buffer: up to 8, not more than the cores this process may
# use.  On the H100 machine (16 cores) the staged copies ran at 18.9 GB/s with 4 threads and 22.8 with 8
# (benchmarks/gpu_copy_rates.py, benchmarks/RESULTS.md).
THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
ONE_THREAD_BYTES = 2**20  # a slice this small is copied by one thread


class PinnedCopies:
    """Copies between host arrays and ``cp``'s device through two pinned buffers (``pinned_empty``: cupyx's
    ``empty_pinned``) and one copy stream; each call returns once every copy it made is complete."""

    def __init__(self, cp, pinned_empty, slice_bytes: int = SLICE_BYTES, threads: int = THREADS):
        self._cp, self._pinned_empty = cp, pinned_empty
        self._slice, self._threads = int(slice_bytes), int(threads)
        self._pool = None  # the host threads, made on first use and kept

    def host_buffer(self, shape, dtype) -> np.ndarray:
        """A pinned host array, for copies of the caller's own."""
        return self._pinned_empty(shape, dtype)

    def _staging(self, arrays) -> _Staging:
        if self._pool is None and self._threads > 1:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="lstmgrad-pinned")
        largest = max((a.nbytes for a in arrays if a is not None), default=0)
        return _Staging(self._pinned_empty, max(1, min(self._slice, largest)), self._pool, self._threads)

    def to_device(self, arrays) -> list:
        """Each host array of ``arrays`` (None passes through) as a new C-contiguous device array."""
        cp = self._cp
        hosts = [None if a is None else np.ascontiguousarray(a) for a in arrays]
        devices = [None if a is None else cp.empty(a.shape, a.dtype) for a in hosts]
        self.copy_in([(h, d) for h, d in zip(hosts, devices, strict=True) if h is not None])
        return devices

    def copy_in(self, pairs, after=None, stream=None) -> None:
        """Each ``(host, device)`` pair's host array into its C-contiguous device array of the same bytes, on a copy
        stream that first waits for the event ``after`` (by default, for all the current stream has queued), or on
        ``stream`` (``copy_stream``'s, holding copies of the caller's own); returns once every copy on it is
        complete."""
        if stream is None:  # (after allocations: their memory may be in use on the current stream)
            stream = self.copy_stream(after)
        try:
            staging = self._staging([host for host, _ in pairs])
            for host, device in pairs:
                source, target = _bytes(np.ascontiguousarray(host)), device.reshape(-1).view(np.uint8)
                for lo in range(0, source.size, staging.size):
                    hi = min(lo + staging.size, source.size)
                    buffer = staging.take(hi - lo)  # (once the DMA that last read it is done)
                    staging.copy(buffer, source[lo:hi])
                    target[lo:hi].set(buffer, stream=stream)
                    staging.give_back(stream.record())
        finally:  # (never a pinned buffer freed, nor an error raised, while a copy from it runs)
            stream.synchronize()

    def to_host(self, arrays) -> list:
        """Each device array of ``arrays`` as a new host array: a slice's DMA into one buffer runs while the slice
        before is copied out of the other."""
        devices = [self._cp.ascontiguousarray(a) for a in arrays]  # (queued on the current stream: before it)
        hosts = [np.empty(a.shape, a.dtype) for a in devices]
        stream = self.copy_stream()
        try:
            staging = self._staging(devices)
            waiting = None  # (event, buffer, where its bytes go) of the slice in flight
            for device, host in zip(devices, hosts, strict=True):
                source, target = device.reshape(-1).view(np.uint8), _bytes(host)
                for lo in range(0, target.size, staging.size):
                    hi = min(lo + staging.size, target.size)
                    buffer = staging.take(hi - lo)
                    source[lo:hi].get(out=buffer, stream=stream, blocking=False)
                    event = stream.record()
                    if waiting is not None:
                        staging.drain(*waiting)
                    waiting = (event, buffer, target[lo:hi])
            if waiting is not None:
                staging.drain(*waiting)
        finally:
            stream.synchronize()
        return hosts


    def copy_stream(self, after=None):
        """A stream of its own, after ``after`` (an event), by default after all the current stream has queued: the
        arrays it reads were computed there, and the memory the pool hands out for those it writes may be in use
        there still."""
        cuda = self._cp.cuda
        stream = cuda.Stream(non_blocking=True)
        stream.wait_event(after if after is not None else cuda.get_current_stream().record())
        return stream


class _Staging:
    """Two pinned buffers of ``size`` bytes taken in turn; a buffer is handed out again once the copy stream's work
    that used it (``give_back``'s event) is complete.  ``pool``: the threads copying large slices, or None."""

    def __init__(self, pinned_empty, size: int, pool, threads: int):
        self.size = size
        self._buffers = [pinned_empty((size,), np.uint8) for _ in range(2)]
        self._events = [None, None]
        self._turn = 0
        self._pool, self._threads = pool, threads

    def take(self, n: int):
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
            self._events[self._turn] = None
        return self._buffers[self._turn][:n]

    def give_back(self, event) -> None:
        self._events[self._turn] = event

    def drain(self, event, buffer, target) -> None:
        """Wait for ``event`` (the DMA into ``buffer``), then copy the buffer out to ``target``."""
        event.synchronize()
        self.copy(target, buffer)

    def copy(self, target, source) -> None:
        """``target[:] = source`` (equal byte sizes), by the pool's threads when it is large."""
        if self._pool is None or source.size < ONE_THREAD_BYTES:
            np.copyto(target, source)
            return
        bounds = np.linspace(0, source.size, self._threads + 1).astype(np.int64)
        parts = [self._pool.submit(np.copyto, target[lo:hi], source[lo:hi])
                 for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
        for part in parts:
            part.result()


# Where each array of a packed copy starts in its buffers: a multiple of this many bytes (cudaMalloc's alignment, so
# that each device view is aligned as a separate allocation would be).
PACK_ALIGN = 256


class PackedCopies:
    """A call's small host arrays to ``cp``'s device in one copy, and its gradients back after one wait.

    cupy copies each host array by itself from pageable memory and waits for it: ~30 µs an array on an H100 machine,
    and a pass of the op has 17 inputs and 9 gradients (a batch of 100 small files: 0.53 ms of a file's 5.15 ms on
    cupy went to the inputs' copies and 0.19 ms to the gradients'; benchmarks/RESULTS.md, twelfth session).  Here
    the inputs are copied into their places in one pinned buffer (this thread's, kept and grown), which crosses by
    one DMA on the current stream into one device buffer: the arrays are views of it.  Back, each gradient's DMA
    goes into its place in another pinned buffer, all queued on the current stream, then one wait, and each is
    copied out into an array of its own.  A buffer is refilled only once the DMA that last used it is done."""

    def __init__(self, cp, pinned_empty):
        self._cp, self._pinned_empty = cp, pinned_empty
        self._held = threading.local()  # per thread, per way ("in", "out"): (pinned buffer, event of its last DMA)

    def _buffer(self, way: str, nbytes: int) -> np.ndarray:
        """This thread's pinned buffer for copies ``way``, of at least ``nbytes``, once its last DMA is done."""
        buffer, event = getattr(self._held, way, (None, None))
        if event is not None:
            event.synchronize()
        if buffer is None or buffer.size < nbytes:
            buffer = self._pinned_empty((max(nbytes, 2 * (0 if buffer is None else buffer.size)),), np.uint8)
        setattr(self._held, way, (buffer, None))
        return buffer

    def to_device(self, arrays) -> list:
        """Each host array of ``arrays`` (None passes through) as a C-contiguous device array, all of them views of
        one device buffer filled by one copy."""
        cp = self._cp
        hosts = [None if a is None else _native(np.asarray(a, order="C")) for a in arrays]  # (0-d ones stay so)
        places, total = _places(hosts)
        if not total:
            return [None if a is None else cp.empty(a.shape, a.dtype) for a in hosts]
        pinned = self._buffer("in", total)
        for host, at in zip(hosts, places, strict=True):
            if host is not None:
                np.copyto(pinned[at:at + host.nbytes], _bytes(host))
        device = cp.empty(total, np.uint8)
        stream = cp.cuda.get_current_stream()
        device.set(pinned[:total], stream=stream)  # (from pinned memory: queued, not waited for)
        setattr(self._held, "in", (pinned, stream.record()))
        return [None if host is None else device[at:at + host.nbytes].view(host.dtype).reshape(host.shape)
                for host, at in zip(hosts, places, strict=True)]

    def to_host(self, arrays) -> list:
        """Each device array of ``arrays`` as a new host array: every DMA queued on the current stream (after the
        work that computed them), one wait, then each copied out of the pinned buffer."""
        cp = self._cp
        devices = [cp.ascontiguousarray(a) for a in arrays]
        places, total = _places(devices)
        pinned = self._buffer("out", total)
        stream = cp.cuda.get_current_stream()
        for device, at in zip(devices, places, strict=True):
            if device.size:
                device.reshape(-1).view(np.uint8).get(out=pinned[at:at + device.nbytes], stream=stream,
                                                      blocking=False)
        stream.synchronize()
        return [pinned[at:at + device.nbytes].view(device.dtype).reshape(a.shape).copy()
                for a, device, at in zip(arrays, devices, places, strict=True)]


def _places(arrays) -> tuple[list[int], int]:
    """Each array's first byte in a packed buffer (``PACK_ALIGN``-aligned; None takes no room), and the bytes of all."""
    places, total = [], 0
    for a in arrays:
        places.append(total)
        if a is not None:
            total += -(-int(a.nbytes) // PACK_ALIGN) * PACK_ALIGN
    return places, total


def _native(host: np.ndarray) -> np.ndarray:
    """A host array in this machine's byte order (as cupy holds arrays)."""
    return host if host.dtype.isnative else host.astype(host.dtype.newbyteorder("="))


def _bytes(host: np.ndarray) -> np.ndarray:
    """A C-contiguous host array's bytes, as a flat uint8 view."""
    return host.reshape(-1).view(np.uint8)


# What a chunk of a pass reads of its time-major inputs (``XpGradient.block_lstm_grad``): the step tensors and cs
# (from one step earlier) for the time loop, x and h (the h_prev of each step) for the weight gradients.
FED = (*STEP_NAMES, "cs", "x", "h")


def fed_rows(name: str, lo: int, hi: int) -> tuple[int, int]:
    """The rows of ``name`` that chunk ``[lo, hi)`` reads: cs from the step before the chunk where there is one, h of
    the steps before (h_prev of step 0 is not h's), every other tensor the chunk's own steps."""
    if name == "cs":
        return max(lo - 1, 0), hi
    if name == "h":
        return max(lo - 1, 0), hi - 1
    return lo, hi


class ChunkFeed:
    """A pass's time-major inputs (host arrays, or lazy ones: an HDF5 file's or an NPZ file's, read here straight into
    pinned buffers) on the device a chunk of steps at a time: ``XpGradient.block_lstm_grad``'s ``feed``.

    ``take(j)`` is asked once chunk j-1's work is queued on the current stream: chunk j's rows then cross through
    ``copies`` while the device still computes chunk j-1, into one of two sets of device buffers taken in turn.
    A set is refilled only after the device is done with the chunk before last, which used it (the event
    recorded when that chunk's successor was taken, before the successor's work was queued).  Device memory:
    two chunks of the inputs, whatever T.
    """

    def __init__(self, cp, copies: PinnedCopies, t, chunks, K: int):
        self._cp, self._copies, self._t, self._chunks, self._K = cp, copies, t, chunks, K
        # both sets made now, before the pass queues anything: no memory the pass frees is handed to them
        self._slots = tuple({name: cp.empty((K + 1, *getattr(t, name).shape[1:]), dtype=getattr(t, name).dtype)
                             for name in FED} for _ in range(2))
        self._freed = [None, None]  # per set: an event after which the device no longer reads it
        self._back = None  # put's stream, and its two pinned buffers taken in turn
        self._host = {}  # name -> [K+1, ...] pinned host buffer a lazy input's rows are read into
        self._puts = []  # (event, device rows, pinned rows, target, lo, hi) of rows on their way back
        self._turn = 0

    def take(self, j: int) -> dict:
        """Chunk j's rows by name (``FED``; ``fed_rows`` says which), on the device."""
        lo, hi = self._chunks[j]
        now = self._cp.cuda.get_current_stream().record()  # all before chunk j: chunk j-1's work done
        after = self._freed[j % 2] if self._freed[j % 2] is not None else now
        self._freed[(j - 1) % 2] = now
        slot, rows, staged = self._slots[j % 2], {}, []
        stream = self._copies.copy_stream(after)
        try:
            for name in FED:
                a, b = fed_rows(name, lo, hi)
                rows[name] = slot[name][:b - a]
                if b <= a:
                    continue
                source = getattr(self._t, name)
                if hasattr(source, "read_into"):  # read into pinned memory, its DMA beside the next one's read
                    rows[name].set(self._read(name, source, a, b), stream=stream)
                else:
                    staged.append((np.asarray(source[a:b]), rows[name]))
            self._copies.copy_in(staged, stream=stream)
        finally:  # (a read that failed: the DMAs queued before it are done before the error goes on)
            stream.synchronize()
        return rows

    def _read(self, name: str, source, a: int, b: int) -> np.ndarray:
        """Rows [a, b) of the lazy input ``name`` (an HDF5 dataset's, a stored NPZ member's: ``read_into``, with
        ``pread`` where it can) read into a pinned buffer kept for the pass, which a DMA reads straight from: a
        file's rows cross with one host copy, the kernel's, not two."""
        buffer = self._host.get(name)
        if buffer is None:
            buffer = self._host[name] = self._copies.host_buffer((self._K + 1, *source.shape[1:]), source.dtype)
        return source.read_into(a, b, buffer[:b - a])

    def put(self, target, lo: int, hi: int, rows) -> None:
        """``target[lo:hi] = rows``, device rows (a chunk's x_grad) queued on the current stream: copied back on a
        stream of their own once computed, into one of two pinned buffers taken in turn, while the device goes on;
        written into ``target`` (a host array, or a lazy output) at the next ``put`` or at ``close``.  The device rows
        are held until their copy is done (their memory is not handed out again meanwhile)."""
        cuda = self._cp.cuda
        if self._back is None:
            shape = (self._K, *rows.shape[1:])
            self._back = (cuda.Stream(non_blocking=True),
                          [self._copies.host_buffer(shape, rows.dtype) for _ in range(2)])
        stream, buffers = self._back
        self._settle(keep=1)  # those of two chunks ago, whose buffer this one takes
        self._turn ^= 1
        stream.wait_event(cuda.get_current_stream().record())
        pinned = buffers[self._turn][:hi - lo]
        rows.get(out=pinned, stream=stream, blocking=False)
        self._puts.append((stream.record(), rows, pinned, target, lo, hi))

    def _settle(self, keep: int) -> None:
        """Write the rows copied back into their targets, all but the last ``keep``, waiting for their copies."""
        while len(self._puts) > keep:
            event, _, pinned, target, lo, hi = self._puts.pop(0)
            event.synchronize()
            target[lo:hi] = pinned

    def close(self) -> None:
        """Write what is still on its way back (a pass that failed: wait for it all the same, its pinned buffers in
        use); every ``take`` returned once its copies were complete."""
        try:
            self._settle(keep=0)
        finally:
            for event, *_ in self._puts:
                event.synchronize()
            self._puts.clear()

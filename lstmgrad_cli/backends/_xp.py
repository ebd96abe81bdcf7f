"""The backward pass of TensorFlow's block-LSTM ops, written once against an array module ``xp``.

numpy and cupy spell everything used here the same way, so both backends run this code; the numba
and cupy backends replace the per-step elementwise kernel (``XpGradient.step``), and numba also a
chunk's whole time loop (``XpGradient._steps``).

Structure (docs/semantics.md, reorganised for speed, same maths):

* Only the recurrent product ``dgates[t] @ w_h^T`` has to be done step by step.  The gate gradients
  of a chunk of K time steps are collected in one ``[K, B, 4C]`` buffer; after the chunk,
  ``x_grad = dgates @ w_x^T`` and ``[w_grad; b_grad] += [x, h_prev, 1]^T @ dgates`` are two large
  products over all K steps at once (16*T*B*C*(I+C) flops in all, three quarters of them here).
* The elementwise work of a step runs on ``[B, C]`` slices that stay in cache, in preallocated
  buffers with in-place ufuncs: no temporaries are allocated inside the time loop.  The generic
  step makes 24 passes over ``[B, C]`` (no peephole; 13 of them are the formula's own operations,
  10 the derivative factors, 1 the gradient carried into h): the minimum for one ufunc per
  operation, since every operation must round on its own (below).
* The bracketing of every operation is TensorFlow's (docs/semantics.md), so with
  ``compute_dtype=float16`` every operation rounds to half exactly where TF's CPU kernel does, and
  in float32 the gate gradients are bit-identical to TF's.
* Inputs whose dtype differs from the compute dtype (float16 files computed in float32) are cast
  one chunk at a time into preallocated buffers; the chunk length bounds the memory.
* On host arrays, problems of 2e8 flops or more are cut into five chunks (smaller when three do
  not fit the budget; the first one half as long), and a chunk's products run on a second thread
  while this one does the next chunk's time loop (``_run_overlapped``): the loop alone keeps one
  core busy, not two.  Once the loop is done this thread takes products too: w_grad and b_grad are
  summed in two blocks of columns, each in chunk order, so both threads can work on them to the end.
  The chunks depend on the shape only, and the schedule never changes a bit of the result.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np

from ..results import BlockLSTMGradOutputs
from ..spec import LAYOUTS, SeqTensors
from . import cpu_blas, cpu_placement

# Budget for one chunk's buffers (gate gradients, and the cast inputs when casting).
CHUNK_BYTES = 64 * 2**20

# Problems of at least this many flops are cut into this many chunks, which may then run overlapped
# (``XpGradient._run_overlapped``: from the size measured on the machine, ``overlap_calibration``) or in sequence,
# with the same bits; the chunks depend on the shape alone (the smallest crossover measured on any machine:
# ~1e8 flops for numba, ~2e8 for numpy, on an Intel AVX2 one).
OVERLAP_CHUNKS = 5
OVERLAP_MIN_FLOPS = 2 * 10**8
# ... and at least this many chunks' gate gradients fit CHUNK_BYTES (a ring of slots; more when they fit).
OVERLAP_SLOTS = 3
# On the host, w_grad and b_grad are summed in this many blocks of columns, each its own chain of products in chunk
# order, so that both threads of the overlapped schedule can take a share of them (``XpGradient._run_overlapped``).
WB_PARTS = 2
# ... and x_grad in this many blocks of each chunk's steps, so that the last products, which the two threads share,
# are short and both threads end together.
X_PARTS = 2

# Per-step activations, in the order the step kernels take them.
STEP_NAMES = ("i", "f", "o", "ci", "co", "h_grad", "cs_grad")


def default_chunk_steps(L: int, B: int, C: int, itemsize: int, I: int = 0, casting: bool = False,  # noqa: E741
                        budget: int = CHUNK_BYTES) -> int:
    """Time steps per chunk so the chunk's buffers stay near ``budget`` (the host's ``CHUNK_BYTES`` by default);
    chunks of equal length."""
    if L <= 0:
        return 1
    k_max = max(1, budget // max(chunk_step_bytes(B, C, itemsize, I, casting), 1))
    chunks = -(-L // k_max)
    return -(-L // chunks)


def chunk_step_bytes(B: int, C: int, itemsize: int, I: int = 0, casting: bool = False) -> int:  # noqa: E741
    """Bytes a step takes in a chunk's buffers: its gate gradients, [x, h_prev, 1], and (``casting``) the activations
    and cs cast to the compute dtype."""
    return (4 * C + I + C + 1 + ((len(STEP_NAMES) + 1) * C if casting else 0)) * B * max(itemsize, 1)


def contiguous_transpose(xp, a, tile: int = 128):
    """``a.T`` as a C-contiguous copy; on the host by numpy's OpenBLAS (``cpu_blas.transpose_into``), else in square
    tiles.

    A plain strided copy reads columns whose elements lie a row apart, and when rows are a multiple
    of 4 KiB long those all fall in the same cache sets: w_h of 200,128,512,512 ([512, 2048] float32)
    took 11 ms that way, 3 ms in tiles and 0.35 ms in OpenBLAS, on the critical path before the first step.
    """
    if xp is not np:
        return xp.ascontiguousarray(a.T)
    rows, cols = a.shape
    out = np.empty((cols, rows), dtype=a.dtype)
    if cpu_blas.transpose_into(a, out):
        return out
    for i in range(0, rows, tile):
        for j in range(0, cols, tile):
            out[j:j + tile, i:i + tile] = a[i:i + tile, j:j + tile].T
    return out


class _ReadAhead:
    """The time-major inputs a chunk's time loop reads (``STEP_NAMES`` and cs, one row earlier), for inputs on
    disk: each chunk's rows go into one of two sets of buffers kept for the whole pass, and the next chunk's
    are read on a thread while this chunk's loop runs.  ``LazyDataset.read_into`` reads plain contiguous
    datasets with ``pread``, which leaves the GIL to the loop (through h5py the thread would gain nothing).
    Chunks are taken in order, ``take(0)``, ``take(1)``, ...
    """

    def __init__(self, t, chunks, K: int):
        self._t, self._chunks, self._K = t, chunks, K
        self._slots = ({}, {})  # name -> [K+1, ...] buffer, for even and odd chunks
        self._ahead = None  # (j, future) of the chunk being read on the thread
        self._pool = None
        self._inline = False  # no thread could start
        # The thread starts in the loop, where the overlapped schedule holds the caller on one CPU: it takes the
        # CPUs the pass was called with instead (cpu_placement).
        self._cpus = cpu_placement.allowed()

    def take(self, j: int) -> dict:
        """Chunk j's rows by name ("cs": from one step before the chunk, as the loop wants it)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == j:
            rows = ahead[1].result()  # a read error is raised here, in the loop's thread
        else:
            if ahead is not None:
                ahead[1].exception()  # not wanted (never happens in order), but its buffers must be free
            rows = self._read(j)
        if j + 1 < len(self._chunks) and not self._inline:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 - only passes on disk

                held = {} if self._cpus is None else dict(initializer=cpu_placement.hold, initargs=(self._cpus,))
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="lstmgrad-read", **held)
            try:
                self._ahead = (j + 1, self._pool.submit(self._read, j + 1))
            except RuntimeError:  # no thread can start (a tight ulimit -v): every chunk is read in line
                self.close()
                self._inline = True
        return rows

    def close(self) -> None:
        """Wait for a read still running (it fills buffers of this pass) and end the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _read(self, j: int) -> dict:
        lo, hi = self._chunks[j]
        first = 1 if lo > 0 else 0
        slot = self._slots[j % 2]
        return {name: self._rows(slot, name, lo - first if name == "cs" else lo, hi) for name in (*STEP_NAMES, "cs")}

    def _rows(self, slot: dict, name: str, a: int, b: int):
        source = getattr(self._t, name)
        if not hasattr(source, "read_into"):
            return source[a:b]
        buf = slot.get(name)
        if buf is None:
            buf = slot[name] = np.empty((self._K + 1, *source.shape[1:]), dtype=source.dtype)
        return source.read_into(a, b, buf[:b - a])


def _rows_into(source, lo: int, hi: int, out, dest, xp=np) -> None:
    """``out[dest] = source[lo:hi]``; a lazy input of ``out``'s dtype (h5py) is read straight into place, or, for
    a device's ``out`` (``xp`` not numpy), read and then copied there."""
    if hasattr(source, "read_into") and type(out) is np.ndarray and source.dtype == out.dtype:
        source.read_into(lo, hi, out, dest)
    else:
        out[dest] = _on(xp, source[lo:hi])


def _on(xp, rows):
    """Rows read from a lazy input (a host array) where ``xp`` computes: copied to its device, unless that is the
    host or they are there already."""
    return rows if xp is np or isinstance(rows, xp.ndarray) else xp.asarray(rows)


def chunk_bounds(L: int, K: int, short_first: bool = False) -> list[tuple[int, int]]:  # noqa: E741
    """``(lo, hi)`` of each chunk of at most K steps, last steps first, covering ``[0, L)``.

    With ``short_first`` the first chunk is half as long: in the overlapped schedule the second
    thread idles until the first chunk's gate gradients exist (100,64,256,256: 110 vs 116 ms a
    call, 15 of 21 alternating pairs; 50,32,128,128: 10.1 vs 10.4 ms, 28 of 41).
    """
    first = -(-K // 2) if short_first and L > K else K
    bounds = [(max(0, L - first), L)] if L > 0 else []
    return bounds + [(max(0, hi - K), hi) for hi in range(L - first, 0, -K)]


class _OverlappedWork:
    """The products of the overlapped schedule (``XpGradient._run_overlapped``): which one a free thread takes
    next, and what is done.  Every change is made under one lock and wakes the threads waiting for one."""

    def __init__(self, chunks, slots, fill, chains, x_products):
        import threading  # noqa: PLC0415 - only overlapped passes

        self._chunks, self._chains, self._x_products = chunks, chains, x_products
        self._slots, self._fill = slots, fill
        self._changed = threading.Condition()
        self._ready = 0  # chunks whose gate gradients exist
        self._next_fill = 0  # the first chunk whose [x, h_prev, 1] nobody took to fill
        self._filled = [False] * len(chunks)
        self._next = [0] * len(chains)  # each chain's next chunk
        self._busy = [False] * len(chains)  # a thread is running that chain's product
        self._next_x = 0  # the first x product nobody took yet, counted over chunks then their blocks
        per_chunk = len(chains) + len(x_products)
        self._pending = [per_chunk] * len(chunks)  # products still to do, per chunk
        self._left = len(chunks) * (per_chunk + 1)  # (and the fills)
        self._failure = None

    def ready(self, j: int) -> None:
        """Chunk j's gate gradients exist: its products may start."""
        with self._changed:
            self._ready = j + 1
            self._changed.notify_all()

    def chunk_done(self, j: int) -> bool:
        return not self._pending[j]

    def all_done(self) -> bool:
        return not self._left

    def failed(self) -> bool:
        return self._failure is not None

    def fail(self, exc: BaseException) -> None:
        """Stop every thread at its next product; the first failure is the one raised."""
        with self._changed:
            if self._failure is None:
                self._failure = exc
            self._changed.notify_all()

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def help_until(self, done) -> None:
        """Run products until ``done()`` or a failure, waiting while none can be taken."""
        while True:
            with self._changed:
                while True:
                    if self._failure is not None or done():
                        return
                    task = self._take()
                    if task is not None:
                        break
                    self._changed.wait()
            product, j = task
            product(j, *self._chunks[j])
            with self._changed:
                self._left -= 1
                if product is self._fill:
                    self._filled[j] = True
                else:
                    if product in self._chains:
                        chain = self._chains.index(product)
                        self._busy[chain] = False
                        self._next[chain] += 1
                    self._pending[j] -= 1
                self._changed.notify_all()

    def _take(self):
        """(product, chunk) to run next, or None: the chain furthest behind whose next chunk is ready (its gate
        gradients and its [x, h_prev, 1]) and that no thread is running, else the next fill whose slot is free, else
        the first x product nobody took."""
        free = [c for c, busy in enumerate(self._busy)
                if not busy and self._next[c] < self._ready and self._filled[self._next[c]]]
        if free:
            chain = min(free, key=self._next.__getitem__)
            self._busy[chain] = True
            return self._chains[chain], self._next[chain]
        j = self._next_fill
        if j < len(self._chunks) and (j < self._slots or self.chunk_done(j - self._slots)):
            self._next_fill += 1
            return self._fill, j
        j, block = divmod(self._next_x, len(self._x_products))
        if j < self._ready:
            self._next_x += 1
            return self._x_products[block], j
        return None


class Step(NamedTuple):
    """What one time step's elementwise kernel reads: ``[B, C]`` arrays in the compute dtype."""

    i: object
    f: object
    o: object
    ci: object
    co: object
    h_grad: object
    cs_grad: object
    cs_prev: object  # cs of the step before (cs_prev at t = 0)
    cs: object


class XpGradient:
    """The chunked backward pass over an array module; subclasses may replace ``step``."""

    def __init__(self, xp, overlap: bool | None = None):
        self.xp = xp
        self.overlap = overlap  # None: by size and cores; True/False: always/never overlap (tests)

    def chunk_budget(self, B: int, C: int) -> int:  # noqa: ARG002 - a subclass's budget may depend on them
        """Bytes for one chunk's buffers where the chunks are not cut for the overlapped schedule: ``CHUNK_BYTES``,
        sized for the host's caches."""
        return CHUNK_BYTES

    # -- the per-step elementwise kernel ------------------------------------------------------
    def step(self, a: Step, carried_h, carried_cs, gates, new_cs, peep, acc, offsets, ws, one_core=False):
        """One step of docs/semantics.md, in place, with TF's bracketing (``one_core``: as in ``_steps``).

        ``carried_h``/``carried_cs`` are the gradients carried from the step after; the gate
        gradients go into ``gates`` ([B, 4C]) and the gradient carried to the step before into
        ``new_cs``.  With peepholes, ``peep`` is (wci, wcf, wco) and ``acc`` three [B, C]
        accumulators of di*cs_prev, df*cs_prev, do*cs (summed over the batch at the end).
        ``ws`` holds the [B, C] scratch buffers dh, dc, dcs, tmp.
        """
        xp = self.xp
        C = carried_h.shape[1]
        do, dci, df, di = (gates[:, offsets[g] * C:(offsets[g] + 1) * C] for g in "ocfi")
        dh, dc, dcs, tmp = ws
        xp.add(carried_h, a.h_grad, out=dh)          # dh = carried + incoming
        xp.add(carried_cs, a.cs_grad, out=dc)        # dc = carried + incoming
        xp.subtract(1, a.o, out=tmp)                 # do = ((o (1-o)) dh) co
        xp.multiply(a.o, tmp, out=tmp)
        xp.multiply(tmp, dh, out=tmp)
        xp.multiply(tmp, a.co, out=do)
        xp.multiply(a.co, a.co, out=tmp)             # dcs = (((1 - co co) dh) o) + dc
        xp.subtract(1, tmp, out=tmp)
        xp.multiply(tmp, dh, out=tmp)
        xp.multiply(tmp, a.o, out=tmp)
        xp.add(tmp, dc, out=dcs)
        if peep is not None:
            wci, wcf, wco = peep
            xp.multiply(do, wco, out=tmp)            # dcs += do wco
            xp.add(dcs, tmp, out=dcs)
        xp.multiply(a.ci, a.ci, out=tmp)             # dci = ((1 - ci ci) dcs) i
        xp.subtract(1, tmp, out=tmp)
        xp.multiply(tmp, dcs, out=tmp)
        xp.multiply(tmp, a.i, out=dci)
        xp.subtract(1, a.f, out=tmp)                 # df = ((f (1-f)) dcs) cs_prev
        xp.multiply(a.f, tmp, out=tmp)
        xp.multiply(tmp, dcs, out=tmp)
        xp.multiply(tmp, a.cs_prev, out=df)
        xp.subtract(1, a.i, out=tmp)                 # di = ((i (1-i)) dcs) ci
        xp.multiply(a.i, tmp, out=tmp)
        xp.multiply(tmp, dcs, out=tmp)
        xp.multiply(tmp, a.ci, out=di)
        xp.multiply(dcs, a.f, out=new_cs)            # cs_prev_grad = dcs f
        if peep is not None:
            xp.multiply(di, wci, out=tmp)            # ... + di wci
            xp.add(new_cs, tmp, out=new_cs)
            xp.multiply(df, wcf, out=tmp)            # ... + df wcf
            xp.add(new_cs, tmp, out=new_cs)
            xp.multiply(di, a.cs_prev, out=tmp)
            xp.add(acc[0], tmp, out=acc[0])
            xp.multiply(df, a.cs_prev, out=tmp)
            xp.add(acc[1], tmp, out=acc[1])
            xp.multiply(do, a.cs, out=tmp)
            xp.add(acc[2], tmp, out=acc[2])

    # -- the whole backward pass --------------------------------------------------------------
    def block_lstm_grad(self, t: SeqTensors, seq_len_max: int, use_peephole: bool, layout: str,
                        compute_dtype, chunk_steps: int | None = None, return_dgates: bool = False, *,
                        x_grad_out=None, observe=None, feed=None):
        """BlockLSTMGrad(V2) on validated arrays already on this module's device.

        Returns ``BlockLSTMGradOutputs`` in the input dtype (and the gate gradients of all steps
        when ``return_dgates``, used for LSTMBlockCellGrad's ``dicfo``).

        The time-major tensors are only ever read a chunk of steps at a time (``t.i[lo:hi]``), so
        they may be lazy arrays such as h5py datasets: memory then stays bounded by the chunk.
        ``x_grad_out``, a zero-filled writable ``[T, B, I]`` array-like (an h5py dataset, say),
        receives ``x_grad`` chunk by chunk instead of an array in memory, and is returned as
        ``x_grad``.  ``observe(t, carried_h, carried_cs)`` is called after each step with the
        gradients carried into ``h`` and ``cs`` of step t-1 (for per-step diagnostics).  ``feed(t, chunks, K)``,
        when given, makes what hands each chunk its time-major rows where this module computes, asked in chunk order
        (``take(j)`` once chunk j-1's work is queued; ``_cupy_copies.ChunkFeed``): the pass then never slices them.
        """
        xp = self.xp
        out_dtype = np.dtype(t.x.dtype)
        cdt = np.dtype(compute_dtype)
        casting = out_dtype != cdt
        T, B, I = t.x.shape  # noqa: E741
        C = t.w.shape[1] // 4
        L = seq_len_max
        offsets = LAYOUTS[layout]

        def cast(a):
            return a if a.dtype == cdt else a.astype(cdt)

        w = cast(t.w)
        # [4C, I] and [4C, C], compact: oneDNN's threads split a product by a transposed operand as they like, so its
        # bits would depend on the thread count (OpenBLAS's do not: the same bits either way)
        w_x_t = contiguous_transpose(xp, w[:I])
        w_h_t = contiguous_transpose(xp, w[I:])            # (the per-step product)
        peep = tuple(cast(p) for p in (t.wci, t.wcf, t.wco)) if use_peephole else None
        acc = tuple(xp.zeros((B, C), dtype=cdt) for _ in range(3)) if use_peephole else None
        cs_prev, h_prev = cast(t.cs_prev), cast(t.h_prev)

        if x_grad_out is None:  # the chunk products write steps [0, L); no zero-filling pass under them
            x_grad = xp.empty((T, B, I), dtype=out_dtype)
            x_grad[L:] = 0
        else:
            x_grad = x_grad_out
        # w_grad, then b_grad as the last row; the first chunk's product writes it, so zeros only without steps
        wb_grad = (xp.empty if L > 0 else xp.zeros)((I + C + 1, 4 * C), dtype=cdt)
        carried_cs = xp.zeros((B, C), dtype=cdt)
        new_cs = xp.empty((B, C), dtype=cdt)
        carried_h = xp.zeros((B, C), dtype=cdt)
        ws = tuple(xp.empty((B, C), dtype=cdt) for _ in range(4))

        # The chunks depend on the shape only, so a result never depends on the schedule or machine.
        overlap_chunks = self._overlap_chunks(L, B, I, C, cdt)
        overlap = (overlap_chunks and not return_dgates and observe is None and feed is None
                   and self._overlap_now(L, B, I, C))  # (a feed is taken in the loop's order, one chunk ahead)
        gates_step = B * 4 * C * cdt.itemsize
        slot_step = gates_step + B * (I + C + 1) * cdt.itemsize  # a step's gate gradients and [x, h_prev, 1]
        if overlap_chunks:  # a fifth of the steps each, or fewer so that a few chunks fit the budget
            k_fit = CHUNK_BYTES // max(OVERLAP_SLOTS * slot_step, 1)
            K = max(1, min(chunk_steps or min(-(-L // OVERLAP_CHUNKS), k_fit), L))
        else:
            K = max(1, min(chunk_steps or default_chunk_steps(L, B, C, cdt.itemsize, I, casting,
                                                              self.chunk_budget(B, C)), max(L, 1)))
        chunks = chunk_bounds(L, K, short_first=overlap_chunks and not chunk_steps)
        # Overlapped, the chunks' gate gradients and their [x, h_prev, 1] live in a ring of slots until their
        # products are done: as many as fit CHUNK_BYTES, and two at least (one filled while one is used).
        slots = max(1, min(len(chunks), max(2, CHUNK_BYTES // max(K * slot_step, 1)))) if overlap else 1
        if return_dgates:
            dgates_all = xp.empty((L, B, 4 * C), dtype=cdt)
        else:
            dgates_buf = xp.empty((slots, K, B, 4 * C), dtype=cdt)
        cast_bufs = {}  # name -> [K(+1), B, C] buffer in the compute dtype, made on first use
        xh_bufs = None  # [x, h_prev, 1] of a chunk's steps, [slots, K, B, I+C+1]
        if L > 0:
            xh_bufs = xp.empty((slots, K, B, I + C + 1), dtype=cdt)
            xh_bufs[:, :, :, I + C] = 1
        # w/b product's blocks of columns (4C of them in all): a host's each a chain, a device's one product
        parts = WB_PARTS if xp is np and C > 0 else 1
        columns = [np.s_[4 * C * p // parts:4 * C * (p + 1) // parts] for p in range(parts)]
        # Inputs on disk (h5py datasets): each chunk's rows read into reused buffers, the next chunk's ahead.
        on_disk = xp is np and any(hasattr(getattr(t, name), "read_into") for name in (*STEP_NAMES, "cs"))
        reader = feed(t, chunks, K) if feed is not None else _ReadAhead(t, chunks, K) if on_disk else None
        fed = {}  # chunk -> x's and h's rows a feed gave (never overlapped), until the chunk's fill takes them

        def chunk(name, a, b, src=None):
            """``t.<name>[a:b]`` (``src``: those rows, read already) in the compute dtype (a view when no cast is
            needed)."""
            if src is None:
                src = _on(xp, getattr(t, name)[a:b])  # (a lazy input's rows reach a device a chunk at a time)
            if src.dtype == cdt:
                return src
            buf = cast_bufs.get(name)
            if buf is None:
                buf = cast_bufs[name] = xp.empty((K + 1, *src.shape[1:]), dtype=cdt)
            dst = buf[:b - a]
            dst[...] = src
            return dst

        def gates_of(j, lo, hi):
            return dgates_all[lo:hi] if return_dgates else dgates_buf[j % slots, :hi - lo]

        def steps(j, lo, hi):
            nonlocal carried_cs, new_cs
            read = reader.take(j) if reader is not None else {}
            if "x" in read or "h" in read:
                fed[j] = read
            acts = {name: chunk(name, lo, hi, read.get(name)) for name in STEP_NAMES}
            first = 1 if lo > 0 else 0                     # cs_ext[k + first] is cs of step lo + k
            cs_ext = chunk("cs", lo - first, hi, read.get("cs"))
            carried_cs, new_cs = self._steps(lo, acts, cs_ext, first, cs_prev, carried_h, carried_cs, new_cs,
                                             gates_of(j, lo, hi), w_h_t, peep, acc, offsets, ws, observe,
                                             one_core=overlap)

        def x_part(p, parts):
            def x_product(j, lo, hi):  # the p-th block of the chunk's steps
                n = hi - lo
                blocks = parts if n // parts * B >= 2 else 1  # (a product of one row is a gemv: it rounds otherwise)
                a, b = lo + n * p // blocks, lo + n * (p + 1) // blocks
                if p < blocks and a < b:
                    self._x_grad_product(a, b, gates_of(j, lo, hi)[a - lo:b - lo], w_x_t, x_grad, cdt,
                                         getattr(reader, "put", None))
            return x_product

        x_parts = X_PARTS if xp is np else 1
        x_products = [x_part(p, x_parts) for p in range(x_parts)]

        def xh_of(j, lo, hi):
            return xh_bufs[j % slots, :hi - lo]

        def fill(j, lo, hi):
            self._fill_xh(t, lo, hi, xh_of(j, lo, hi), h_prev, fed.pop(j, {}))

        def wb_chain(cols):
            def wb_product(j, lo, hi):
                self._wb_product(xh_of(j, lo, hi), gates_of(j, lo, hi), wb_grad, hi == L, cols)
            return wb_product

        wb_chains = [wb_chain(cols) for cols in columns]
        try:
            if overlap:
                self._run_overlapped(chunks, slots, steps, fill, x_products, wb_chains)
            else:
                with self._threads_for(L, B, I, C):
                    for j, (lo, hi) in enumerate(chunks):
                        steps(j, lo, hi)
                        for product in (fill, *x_products, *wb_chains):
                            product(j, lo, hi)
        finally:
            if reader is not None:
                reader.close()

        peep_grads = [self.batch_sum(a) for a in acc] if use_peephole else [xp.zeros(C, dtype=cdt) for _ in range(3)]

        def out(a):  # no copy when the compute dtype is the output dtype
            return a.astype(out_dtype, copy=False)

        outs = BlockLSTMGradOutputs(
            x_grad, out(carried_cs), out(carried_h), out(wb_grad[:I + C]), *map(out, peep_grads), out(wb_grad[I + C]),
        )
        cpu_blas.check_mkl()  # a product MKL could not compute left its output as it was
        if return_dgates:
            return outs, dgates_all.astype(out_dtype)
        return outs

    def batch_sum(self, rows):
        """``rows`` [B, C] summed over the batch in one defined order, that of every backend: row after row, each
        sum rounded to the dtype (a GPU's parallel reduction, or numpy's pairwise sum of one column, rounds
        otherwise)."""
        if not len(rows):
            return self.xp.zeros(rows.shape[1:], dtype=rows.dtype)
        return self.xp.add.accumulate(rows, axis=0)[-1]

    def _steps(self, lo, acts, cs_ext, first, cs_prev, carried_h, carried_cs, new_cs, gates, w_h_t, peep, acc,
               offsets, ws, observe, one_core=False):
        """The time loop of one chunk, last step first: ``self.step`` then the recurrent product.

        ``acts`` maps ``STEP_NAMES`` to the chunk's ``[n, B, C]`` activations, ``cs_ext[k + first]``
        is cs of step ``lo + k``.  Returns the swapped pair (carried_cs, new_cs): the first holds
        the cell gradient carried out of the chunk.  ``one_core``: the other core is busy with the
        products (``_run_overlapped``), so a subclass's kernels should not spread out.
        """
        for k in range(gates.shape[0] - 1, -1, -1):
            step_in = Step(*(acts[name][k] for name in STEP_NAMES),
                           cs_ext[k + first - 1] if lo + k > 0 else cs_prev, cs_ext[k + first])
            self.step(step_in, carried_h, carried_cs, gates[k], new_cs, peep, acc, offsets, ws, one_core)
            carried_cs, new_cs = new_cs, carried_cs
            self._matmul(gates[k], w_h_t, carried_h)
            if observe is not None:
                observe(lo + k, carried_h, carried_cs)
        return carried_cs, new_cs

    def _matmul(self, a, b, out):
        """``out = a @ b``; on the host through the one BLAS of every product (``cpu_blas.matmul``)."""
        if self.xp is np:
            cpu_blas.matmul(a, b, out)
        else:
            self.xp.matmul(a, b, out=out)

    def _overlap_chunks(self, L, B, I, C, cdt) -> bool:  # noqa: E741
        """Chunks for the overlapped schedule: host arrays, and big enough to pay for a second
        thread (~0.5 ms; ``overlap=True`` skips this)."""
        big_enough = self.overlap is True or 16 * L * B * C * (I + C) >= OVERLAP_MIN_FLOPS
        return self.xp is np and L >= 2 and big_enough

    def _threads_for(self, L, B, I, C):  # noqa: E741
        """BLAS threads for a host pass run in sequence: one for a small pass, the library's own count otherwise
        (``cpu_blas.threads_for_pass``)."""
        return cpu_blas.threads_for_pass(L, B, I, C) if self.xp is np else contextlib.nullcontext()

    def _overlap_now(self, L, B, I, C) -> bool:  # noqa: E741
        """Run those chunks' products beside the loop (``_run_overlapped``), unless set: where that is faster on
        this machine for a pass of this size (``overlap_calibration.overlaps``)."""
        if self.overlap is not None:
            return self.overlap
        from . import overlap_calibration  # noqa: PLC0415

        return overlap_calibration.overlaps(overlap_calibration.flops(L, B, I, C))

    def _run_overlapped(self, chunks, slots, steps, fill, x_products, chains):
        """Each chunk's time loop on this thread while a second thread does the products of the chunks before.

        ``steps(j, lo, hi)`` runs here in chunk order (the recurrence) and fills slot ``j % slots`` of the gate
        gradients, once chunk ``j - slots`` is done with it; ``fill(j, lo, hi)`` fills the same slot's
        [x, h_prev, 1] once it is free (from the inputs, whatever the loop has done), so the second thread has work
        while the first chunk's loop runs.  Each of ``chains`` (w_grad and b_grad's blocks
        of columns) is called in chunk order, on one thread at a time, so every element is summed in the same order
        on every run; each of ``x_products`` writes its own rows of x_grad in any order.  Whichever thread is free
        takes the next task, a chain's product first, then a fill, then an x product (``_OverlappedWork``): the
        worker from the start, this thread while it waits for a slot and once its loop is done, so that at the end
        both threads share what is left.  BLAS runs single-threaded meanwhile (``cpu_blas.single_threaded``): two
        threads, held on different CPUs where they can be (``cpu_placement``).  Results equal the sequential
        schedule with the same chunks, bit for bit.
        """
        import _thread
        import threading

        work = _OverlappedWork(chunks, slots, fill, chains, x_products)
        errstate = np.geterr()  # numpy's error state is per thread: the worker takes the caller's
        worker_done = threading.Event()
        placement = cpu_placement.claim()  # the two threads on different CPUs, where they can be

        def worker():
            try:
                if placement is not None:
                    cpu_placement.hold(placement.worker)
                np.seterr(**errstate)
                work.help_until(work.all_done)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                work.fail(exc)
            finally:
                worker_done.set()

        # With no other Python thread alive, nothing else can be inside BLAS: OpenBLAS's idle workers,
        # which spin for ~0.1 s after a threaded call, can be stopped to free the core they take.
        stop_spinning = threading.active_count() == 1

        with cpu_blas.single_threaded():
            if stop_spinning:
                cpu_blas.stop_spinning_workers()  # before either thread calls BLAS
            try:
                _thread.start_new_thread(worker, ())  # returns at once, unlike Thread.start()
            except RuntimeError:  # no thread can start (a tight ulimit -v): this thread does every product
                worker_done.set()
                if placement is not None:
                    cpu_placement.release(placement)
                placement = None
            try:
                if placement is not None:  # after the worker starts, so that it does not start on this CPU only
                    cpu_placement.hold(placement.caller)
                for j, (lo, hi) in enumerate(chunks):
                    if j >= slots:  # the slot waits for the products of chunk j - slots: help or wait
                        work.help_until(lambda j=j: work.chunk_done(j - slots))
                    if work.failed():
                        break
                    steps(j, lo, hi)
                    work.ready(j)
                work.help_until(work.all_done)
            except BaseException as exc:
                work.fail(exc)
                raise
            finally:
                if placement is not None:  # before the wait, which a second Ctrl-C may cut short
                    cpu_placement.release(placement)
                if not (work.all_done() or work.failed()):  # fail() above was itself cut short by a second Ctrl-C
                    work.fail(KeyboardInterrupt())
                worker_done.wait()
        work.raise_failure()

    def _x_grad_product(self, lo, hi, gates, w_x_t, x_grad, cdt, put=None):
        """``x_grad[lo:hi] = dgates @ w_x^T``, one large product over the chunk's steps.  A device's rows for a host
        ``x_grad`` are copied back by ``put(x_grad, lo, hi, rows)`` where the feed has one (while the device goes
        on), else here."""
        xp = self.xp
        n, B, G4 = gates.shape
        I = w_x_t.shape[1]  # noqa: E741
        flat = gates.reshape(n * B, G4)
        if x_grad.dtype == cdt and isinstance(x_grad, xp.ndarray):  # an array where xp computes, to write into
            self._matmul(flat, w_x_t, x_grad[lo:hi].reshape(n * B, I))
        else:  # another dtype, or a lazy output such as an h5py dataset (on the host: a device's rows copied back)
            product = xp.empty((n * B, I), dtype=cdt)
            self._matmul(flat, w_x_t, product)
            rows = product.reshape(n, B, I).astype(x_grad.dtype, copy=False)
            on_host = xp is not np and not isinstance(x_grad, xp.ndarray)
            if on_host and put is not None:
                put(x_grad, lo, hi, rows)
            else:
                x_grad[lo:hi] = rows.get() if on_host else rows

    def _fill_xh(self, t, lo, hi, xh, h_prev, rows=None):
        """``xh`` ([n, B, I+C+1] in the compute dtype, its last column ones) := [x, h_prev, 1] of steps [lo, hi),
        which also casts other-dtype inputs.  ``rows``: x's rows of the chunk and h's of the steps before it
        (``_cupy_copies.fed_rows``), where a feed gave them; else they are sliced from ``t``."""
        xp = self.xp
        n = hi - lo
        I = t.x.shape[2]  # noqa: E741
        C = xh.shape[2] - I - 1
        rows = rows or {}
        x, h = rows.get("x"), rows.get("h")

        def fill(source, a, b, dest, given):
            if given is not None:
                xh[dest] = given
            else:
                _rows_into(source, a, b, xh, dest, xp)

        fill(t.x, lo, hi, np.s_[:, :, :I], x)
        # h_prev of step s is h[s-1], and the input h_prev at s = 0 (never read h at t = L-1).
        if lo > 0:
            fill(t.h, lo - 1, hi - 1, np.s_[:, :, I:I + C], h)
        else:
            xh[0, :, I:I + C] = h_prev
            if n > 1:
                fill(t.h, 0, hi - 1, np.s_[1:n, :, I:I + C], h)

    def _wb_product(self, xh, gates, wb_grad, first, cols=np.s_[:]):
        """Columns ``cols`` of w_grad and b_grad from one chunk's steps: ``[w_grad; b_grad] += [x, h_prev, 1]^T @
        dgates`` with ``xh`` from ``_fill_xh``.

        One product into ``wb_grad`` ([I+C+1, 4C]): about 10% faster than separate x and h products plus a sum over
        the batch.  The ``first`` chunk (the last steps) writes it in place; later ones add into it in the same
        BLAS call where a BLAS is reachable (``cpu_blas.matmul_into``: 113 vs 118 ms a call at 100,64,256,256).
        Every element is summed over the same steps in the same order whichever block of columns holds it.
        """
        xp = self.xp
        n, B, G4 = gates.shape
        flat = gates.reshape(n * B, G4)[:, cols]
        xh = xh.reshape(n * B, xh.shape[2])
        out = wb_grad[:, cols]
        if xp is np and cpu_blas.matmul_into(xh.T, flat, out, accumulate=not first):
            return  # one BLAS call adds the product in: no [I+C+1, 4C] temporary, no extra pass
        if first:  # not written yet
            xp.matmul(xh.T, flat, out=out)
        else:
            out += xh.T @ flat

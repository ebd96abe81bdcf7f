"""HDF5 outputs written so that a failed write (disk full, a file-size limit) never reaches HDF5.

HDF5 cannot recover from a write that fails while it flushes or closes a file: the close fails, the file stays
open with its metadata half flushed, h5py retries the close as each of its objects is collected (a traceback
each), and HDF5's own cleanup at exit crashes the process.  Here HDF5 writes through a file object (h5py's
"fileobj" driver) onto the temporary file atomic_file holds; the first failed write is kept and raised once HDF5
has closed the file as if all went well, and atomic_file then discards it (``hdf5_writer``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import threading
from collections.abc import Iterator

from ..errors import LstmGradError
from .atomic import Temporary, errno_in


@contextlib.contextmanager
def hdf5_writer(tmp: Temporary):
    """An HDF5 file open for writing into the temporary file ``tmp``, closed when the block ends; the first write
    that failed (disk full, file-size limit) raises as an OSError from the block (once HDF5 has closed the file).

    HDF5 writes through ``_HDF5Target`` (h5py's "fileobj" driver), never to the file itself, because HDF5 cannot
    recover from a write that fails while it flushes or closes a file: the close fails, the file stays open with
    its metadata half flushed, h5py retries the close when each of its objects is collected (a traceback each)
    and HDF5's own cleanup at exit crashes the process (SIGSEGV, exit 139).  So no write fails as far as HDF5
    knows: the first error is kept and raised from the block, HDF5 closes the file as if all went well, and
    the temporary file is then discarded (atomic_file)."""
    target = _HDF5Target(tmp)
    with signals_held():  # (HDF5 writes the new file's superblock through ``target``)
        out = _output_file_class()(target, "w", track_order=True)
    out._lstmgrad_target = target
    try:
        yield out
        target.raise_failure()  # (a failed write leaves nothing worth flushing)
        with signals_held():
            out.close()  # (HDF5 flushes it; what failed is in target.error)
    except BaseException as err:
        with signals_held(), contextlib.suppress(Exception):
            out.close()  # (HDF5 saw no failed write, so this succeeds: nothing of the file is left open)
        if target.error is not None and isinstance(err, Exception) and not isinstance(err, (OSError, LstmGradError)):
            raise target.failure() from None  # what followed a failed write (HDF5 reading what was not written)
        raise
    target.raise_failure()


class _HDF5Target:
    """The temporary file of an HDF5 output as h5py's file object: its writes go to the file's descriptor, and
    the first that fails (ENOSPC, EFBIG, EIO) is kept in ``error`` instead of being reported to HDF5.  From then
    on nothing is written to the file: small writes (metadata, which HDF5 may read back) are kept in memory,
    larger ones (raw data) are dropped, so that HDF5 can go on and close the file, which will be discarded.
    h5py calls ``seek`` and then ``read``, ``write``; ``truncate`` and ``flush`` when it flushes."""

    KEEP_AT_MOST = 1 << 20  # the largest write kept in memory once writing failed (HDF5's metadata is smaller)

    def __init__(self, tmp: Temporary) -> None:
        self.fd = tmp.fd
        self.name = str(tmp.path)
        self.pos = 0
        self.end = 0  # the end of the file as HDF5 sees it (the file is new: it was empty)
        self.error: OSError | None = None
        self._kept: dict[int, bytes] = {}  # offset -> data written after the error

    def __repr__(self) -> str:  # h5py names the HDF5 file so (its ``filename``)
        return self.name

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = offset + (self.end if whence == os.SEEK_END else self.pos if whence == os.SEEK_CUR else 0)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size, offset = len(view), self.pos
        if self.error is None:
            try:
                done = 0
                while done < size:
                    written = _pwrite(self.fd, view[done:], offset + done)
                    if written <= 0:
                        raise OSError(errno.EIO, os.strerror(errno.EIO))
                    done += written
            except OSError as err:
                self.error = err
        if self.error is not None and size <= self.KEEP_AT_MOST:
            self._kept.pop(offset, None)
            self._kept[offset] = bytes(view)  # (in the order written: a later write over an earlier one wins)
        self.pos = offset + size
        self.end = max(self.end, self.pos)
        return size

    def read(self, size: int) -> bytes:
        """``size`` bytes from ``pos``: zeros past the end of the file, as HDF5's own driver reads them.  A read
        that fails fails the output (as a write would: HDF5 gets zeros, so that it goes on to close the file)."""
        offset = self.pos
        self.pos = offset + size
        data = b""
        try:
            data = _pread(self.fd, size, offset)  # (all of it, but for a read past the end or a signal)
            while len(data) < size:
                more = _pread(self.fd, size - len(data), offset + len(data))
                if not more:
                    break
                data += more
        except OSError as err:
            if self.error is None:
                self.error = err
        if len(data) == size and not self._kept:
            return data
        whole = bytearray(data)
        whole += bytes(size - len(whole))
        for start, kept in self._kept.items():
            lo, hi = max(start, offset), min(start + len(kept), offset + size)
            if lo < hi:
                whole[lo - offset:hi - offset] = kept[lo - start:hi - start]
        return bytes(whole)

    def truncate(self, size: int | None = None) -> int:
        size = self.pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as err:  # (making the file longer may pass the file-size limit too)
                self.error = err
        self.end = size
        return size

    def flush(self) -> None:
        """Nothing to do: writes go straight to the file, and atomic_file fsyncs it."""

    def failure(self) -> OSError:
        err = self.error
        code = err.errno if err.errno is not None else errno_in(err)
        return OSError(code, err.strerror or str(err), self.name)

    def raise_failure(self) -> None:
        """Raise the error that stopped writing, if a write failed (the output can no longer be complete)."""
        if self.error is not None:
            raise self.failure()


def _pwrite(fd: int, data, offset: int) -> int:
    if hasattr(os, "pwrite"):
        return os.pwrite(fd, data, offset)
    os.lseek(fd, offset, os.SEEK_SET)  # (Windows: h5py makes one call at a time, and nothing else moves it)
    return os.write(fd, data)


def _pread(fd: int, size: int, offset: int) -> bytes:
    if hasattr(os, "pread"):
        return os.pread(fd, size, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, size)


@functools.cache
def _output_file_class():
    """h5py.File whose datasets raise the write error of their file as soon as a write of theirs returns (HDF5 got
    none: ``_HDF5Target``), so that a long streamed output stops at the first failed write, not at its end.  Each
    write holds SIGINT and SIGTERM back until it returns (``signals_held``): HDF5 calls ``_HDF5Target`` (Python)
    from inside it, and a KeyboardInterrupt raised there would be a failed write to HDF5 (h5py's SystemError and
    a traceback); a stream's writes are a chunk each, so an interrupt waits one chunk's write at most."""
    import h5py  # noqa: PLC0415

    class OutputDataset(h5py.Dataset):
        _lstmgrad_target: _HDF5Target

        def __setitem__(self, key, value) -> None:
            with signals_held():
                super().__setitem__(key, value)
            self._lstmgrad_target.raise_failure()

        def write_direct(self, source, source_sel=None, dest_sel=None) -> None:
            with signals_held():
                super().write_direct(source, source_sel, dest_sel)
            self._lstmgrad_target.raise_failure()

    class OutputFile(h5py.File):
        _lstmgrad_target: _HDF5Target

        def create_dataset(self, name, *args, **kwargs):
            self._lstmgrad_target.raise_failure()
            with signals_held():
                made = super().create_dataset(name, *args, **kwargs)
            dataset = OutputDataset(made.id)
            dataset._lstmgrad_target = self._lstmgrad_target
            self._lstmgrad_target.raise_failure()
            return dataset

    return OutputFile


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back meanwhile: their handlers run when the block ends, as they would have then.

    For every HDF5 call that may write (creating the file and its datasets, writing them, their attributes, the
    flush and close), which call ``_HDF5Target`` (Python): a KeyboardInterrupt raised there would be a
    write that failed as far as HDF5 knows, the very thing it cannot recover from.  Signal handlers run only in the
    main thread; in another one there is nothing to hold back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            if callable(signal.getsignal(sig)):
                previous[sig] = signal.signal(sig, lambda signum, frame: held.append(signum))
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)  # (its own handler now: a KeyboardInterrupt from here, say)

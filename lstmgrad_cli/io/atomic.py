"""Files that appear complete or not at all: a temporary file beside the target, fsynced, then renamed into place.

``atomic_file`` is how every output is written.  Without ``force`` the rename is a hard link, which
fails when the target appeared meanwhile, so nothing is ever clobbered.  On any failure the temporary
file is removed, the target is untouched and the caller gets an ``OutputFileError`` saying what happened;
but one that comes once the output's name is in place (an interrupt just after the rename) leaves the
complete output there, as its temporary file's descriptor shows (``_in_place``).

Two blocks change when the durable steps happen, never their order for a file (its data is fsynced
before its name appears):

* ``directories_synced_at_end``: the directory of each output is fsynced once, when the block ends,
  instead of after every file (a batch writes many files into a few directories);
* ``published_behind``: each output's fsync and rename run on one thread behind the caller, in order,
  while the caller goes on with the next file; the caller asks ``Publisher.outcome`` before it reports
  the output as written;
* ``handed_to_parent``: a local worker process writes its output's temporary file and hands the fsync and
  the rename to the process that reports it (``publish_handed``), and goes on with its next file.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import os
import re
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import NamedTuple

from ..errors import OutputExistsError, OutputFileError
from ..execution import interrupts
from ..messages import Message, Param
from ._common import reason


class Temporary(NamedTuple):
    """A temporary output: its path, and the descriptor ``atomic_file`` keeps open on it."""

    path: Path
    fd: int


class Handoff(NamedTuple):
    """An output written completely to its temporary file, for another process to fsync and rename into place."""

    tmp: Path
    path: Path
    force: bool


class InterruptedInPlace(KeyboardInterrupt):
    """An interrupt that came once an output was in place (``_fsync_and_rename``): its data fsynced, its name
    linked or renamed.  The output stays, complete, and is its file's result; the run stops all the same."""


class _Blocks(threading.local):
    """The blocks open in this thread (another thread's writes are its own business)."""

    def __init__(self) -> None:
        self.deferred_syncs: list[set[Path]] = []  # directories_synced_at_end: the directories each block will sync
        self.publishers: list[Publisher] = []  # published_behind: the innermost block publishes
        self.handoffs: list[list[Handoff]] = []  # handed_to_parent: the outputs each block left to its parent


_open = _Blocks()


@contextlib.contextmanager
def directories_synced_at_end() -> Iterator[set[Path]]:
    """Within the block, outputs' directories are fsynced once each when it ends instead of after every file
    (a batch's outputs share a few).  Each file's data is still fsynced before it is renamed into place, so an
    output that exists is complete; the block's end makes the new names durable.  Yields the set of
    directories, to which a caller adds those of outputs written by other processes."""
    directories: set[Path] = set()
    _open.deferred_syncs.append(directories)
    try:
        yield directories
    finally:
        _open.deferred_syncs.remove(directories)
        for directory in directories:
            _fsync_dir(directory)


class Publisher:
    """Outputs written within a ``published_behind`` block, fsynced and renamed into place by one thread."""

    def __init__(self) -> None:
        self._pending: dict[Path, cf.Future] = {}
        self._thread: cf.ThreadPoolExecutor | None = cf.ThreadPoolExecutor(max_workers=1,
                                                                           thread_name_prefix="lstmgrad-publish")
        try:
            self._thread.submit(lambda: None)  # starts the thread now
        except RuntimeError:  # none can start (a tight ulimit -v leaves no room for its stack): publish in line
            self._thread.shutdown(wait=False)
            self._thread = None

    def _hand_over(self, path: Path, finish: Callable[[], None]) -> None:
        if self._thread is None:
            finish()
        else:
            self._pending[path] = self._thread.submit(finish)

    def outcome(self, path: str | os.PathLike) -> BaseException | None:
        """Wait until the output ``path`` is in place; the error that stopped it (then nothing was written, an
        ``OutputExistsError`` when another run published it first), or None.  None too for a path never handed
        over (an output not written in the block)."""
        future = self._pending.pop(Path(path), None)
        return None if future is None else future.exception()

    def _close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


@contextlib.contextmanager
def published_behind() -> Iterator[Publisher]:
    """Within the block, ``atomic_file`` returns once the data is written; the fsync and the rename follow on a
    thread (system calls: they overlap the caller's next computation).  Every output handed over is finished
    (in place or removed) when the block ends."""
    publisher = Publisher()
    _open.publishers.append(publisher)
    try:
        yield publisher
    finally:
        _open.publishers.remove(publisher)
        publisher._close()


@contextlib.contextmanager
def handed_to_parent() -> Iterator[list[Handoff]]:
    """Within the block (a task in a local worker process), ``atomic_file`` writes and closes the temporary
    file and leaves the fsync and the rename to the process the task reports to (``publish_handed``), which
    runs them while this one computes its next file.  Yields the outputs so left."""
    handoffs: list[Handoff] = []
    _open.handoffs.append(handoffs)
    try:
        yield handoffs
    finally:
        _open.handoffs.remove(handoffs)


def publish_handed(handoff: Handoff) -> Exception | None:
    """Fsync an output a worker process wrote (``handed_to_parent``) and rename it into place; the error that
    stopped it (then its temporary file is removed and nothing was written; an ``OutputExistsError`` when
    another run published it first), or None.  An interrupt raises: ``InterruptedInPlace`` when the output was
    already in place (it stays), KeyboardInterrupt when it was not (nothing was written)."""
    try:
        # writable: Windows flushes only through a descriptor open for writing
        fd = os.open(handoff.tmp, os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    except BaseException as err:
        with contextlib.suppress(OSError):
            handoff.tmp.unlink()
        failure = _failure(handoff.path, err)
        if not isinstance(failure, Exception):
            raise
        return failure
    try:
        _fsync_and_rename(fd, handoff.tmp, handoff.path, handoff.force, _deferred_syncs())
    except Exception as failure:  # noqa: BLE001 - _failure's: this output's, returned as the caller takes them
        return failure
    return None


@contextlib.contextmanager
def atomic_file(path: Path, force: bool) -> Iterator[Temporary]:
    """A temporary file beside ``path`` for the block to fill (by name, or through its open descriptor ``fd``);
    fsynced and renamed into place after (behind the caller within ``published_behind``).

    On any failure the temporary file is removed and ``path`` is untouched.
    """
    parent = path.parent if str(path.parent) else Path(".")
    made: list[tuple[int, Path]] = []
    handing = False
    try:
        with interrupts.held():  # a stop signal waits until the file is made and recorded, then raises below
            try:
                made.append(_create_temporary(path, parent))
            except OSError as err:
                raise OutputFileError(_create_failure(path, parent, err)) from None
        fd, tmp = made[0]
        yield Temporary(tmp, fd)
        # Handed over whole: from here the output will be in place, so the caller's work is committed (a stop
        # signal no longer interrupts it, and the result that reports the output is not lost: interrupts.commit).
        with interrupts.held():
            handing = True  # (what fails from here cleans up after itself: the descriptor may be another's now)
            _hand_over(fd, tmp, path, force)
            interrupts.commit()
    except BaseException as err:
        if made and not handing:
            _discard(*made[0])
        failure = _failure(path, err)
        if failure is err:
            raise
        raise failure from None


def _hand_over(fd: int, tmp: Path, path: Path, force: bool) -> None:
    """An output written to ``tmp`` (open as ``fd``), fsynced and renamed into place as ``path``: here, behind the
    caller (``published_behind``) or by the parent process (``handed_to_parent``)."""
    directories = _deferred_syncs()  # (finish may run on the publishing thread)

    def finish() -> None:
        _fsync_and_rename(fd, tmp, path, force, directories)

    if _open.handoffs:  # the parent process fsyncs and renames it
        try:
            os.close(fd)
        except OSError as err:  # a write that failed late (NFS reports some at close)
            _discard(fd, tmp)
            raise _failure(path, err) from None
        _open.handoffs[-1].append(Handoff(tmp, path, force))
    elif _open.publishers:
        _open.publishers[-1]._hand_over(path, finish)
    else:
        finish()


@contextlib.contextmanager
def synced_behind(fd: int, every: float) -> Iterator[None]:
    """Meanwhile, what has been written to ``fd`` is flushed to disk every ``every`` seconds by a thread, so
    that the fsync which publishes a large output (written over seconds, chunk by chunk) finds little left to
    write: ~0.25 s of a 260 MB streamed x_grad, which the thread's flushes overlap with the computation.
    Best effort: the fsync before the rename is what makes the output durable, and finds any error again."""
    stop = threading.Event()
    datasync = getattr(os, "fdatasync", os.fsync)  # (macOS has no fdatasync)

    def flush() -> None:
        while not stop.wait(every):
            try:
                datasync(fd)
            except OSError:
                return

    thread = threading.Thread(target=flush, name="lstmgrad-sync-behind", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # no thread can start (a tight ulimit -v): the fsync at the end does it all
        yield
        return
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _fsync_and_rename(fd: int, tmp: Path, path: Path, force: bool, directories: set[Path] | None) -> None:
    """Fsync the temporary file ``tmp``, open as ``fd`` (its data however it was written: by name too, or by
    another process), and rename it into place as ``path``; the descriptor is closed after.  ``directories``:
    those of the ``directories_synced_at_end`` block it was written in, if any.

    Stopped before the rename, the temporary file is removed and ``_failure`` of what stopped it is raised.
    Stopped once ``path`` names the file (an interrupt just after the rename or between link and unlink:
    ``_in_place``), the output stays: an error then is no failure, an interrupt is ``InterruptedInPlace``.
    """
    parent = path.parent if str(path.parent) else Path(".")
    try:
        os.fsync(fd)
        _publish(tmp, path, force)
    except BaseException as err:
        if _in_place(fd, path):
            _finish_in_place(fd, tmp, parent, directories)
            if isinstance(err, KeyboardInterrupt):
                raise InterruptedInPlace from None
            if isinstance(err, Exception):  # (removing the temporary name failed): the output is there all the same
                return
            raise
        _discard(fd, tmp)
        failure = _failure(path, err)
        if failure is err:
            raise
        raise failure from None
    with contextlib.suppress(OSError):
        os.close(fd)
    _sync_directory(parent, directories)


def _in_place(fd: int, path: Path) -> bool:
    """Whether ``path`` names the temporary file open as ``fd``: publishing it got as far as its rename (or link)."""
    try:
        mine, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _finish_in_place(fd: int, tmp: Path, parent: Path, directories: set[Path] | None) -> None:
    """What is left of publishing an output already in place (``_in_place``) when it stopped: closing its descriptor,
    removing the temporary name where the link left it, making the new name durable."""
    with contextlib.suppress(OSError):
        if _in_place(fd, tmp):
            tmp.unlink()
    with contextlib.suppress(OSError):
        os.close(fd)
    _sync_directory(parent, directories)


def _deferred_syncs() -> set[Path] | None:
    """The directories the innermost ``directories_synced_at_end`` block open in this thread will sync, if any."""
    return _open.deferred_syncs[-1] if _open.deferred_syncs else None


def _sync_directory(parent: Path, directories: set[Path] | None) -> None:
    """Make a new name in ``parent`` durable: now, or when the ``directories_synced_at_end`` block whose
    ``directories`` these are ends."""
    if directories is not None:
        directories.add(parent)
    else:
        _fsync_dir(parent)


def _discard(fd: int, tmp: Path) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(OSError):
        tmp.unlink()


def _failure(path: Path, err: BaseException) -> BaseException:
    """The error to raise for ``err`` while writing ``path``: the file system's become one OutputFileError line;
    anything else (a library that failed to load while computing, an interrupt) stays as it is."""
    if isinstance(err, RuntimeError) and errno_in(err) is not None:  # h5py's way of saying EFBIG/ENOSPC
        err = OSError(errno_in(err), str(err))
    if isinstance(err, OSError) and (err.errno is not None or errno_in(err) is not None):
        return OutputFileError(f"{path}: cannot write: {os_reason(err)}; nothing was written")
    return err


def _create_temporary(path: Path, parent: Path) -> tuple[int, Path]:
    """A new, empty file beside ``path`` with a name no other process or thread uses, and its descriptor.

    Made with mode 0o666 less the umask, as any new file (tempfile.mkstemp makes 0o600, which would need a
    chmod and the umask, read from /proc, per file), exclusively (O_EXCL), under a short prefix so that a
    target name near NAME_MAX does not fail only because of the temporary name.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _attempt in range(100):
        tmp = parent / f".{path.name[:64]}.{os.getpid()}-{os.urandom(4).hex()}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", str(parent))


def remove_left_behind(path: Path, pids: Collection[int]) -> None:
    """Remove the temporary files for the output ``path`` that the processes ``pids`` made and left (killed, or
    interrupted where they could not clean up): no one will finish them.  Other processes' are left alone."""
    if not pids:
        return
    parent = path.parent if str(path.parent) else Path(".")
    # the names _create_temporary makes: .<name>.<pid>-<8 hex digits>.tmp
    made = re.compile(re.escape(f".{path.name[:64]}.") + f"(?:{'|'.join(str(int(p)) for p in pids)})" +
                      r"-[0-9a-f]{8}\.tmp")
    with contextlib.suppress(OSError), os.scandir(parent) as entries:  # one pass over the directory
        for entry in entries:
            if made.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def remove_temporaries_of(directory: str | os.PathLike, pid: int) -> None:
    """Remove every temporary output file the process ``pid`` made in ``directory`` (it is ending, and no one will
    finish them: a local worker whose parent died)."""
    made = re.compile(r"\..*\." + str(int(pid)) + r"-[0-9a-f]{8}\.tmp", re.DOTALL)
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if made.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _create_failure(path: Path, parent: Path, err: OSError) -> str:
    if err.errno == errno.ENOENT:
        return f"{path}: output directory {parent} does not exist"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"{path}: permission denied: cannot create a file in {parent}"
    if err.errno == errno.EROFS:
        return f"{path}: {parent} is on a read-only file system"
    if err.errno == errno.ENOTDIR:
        return f"{path}: {parent} is not a directory"
    return f"{path}: cannot create a file in {parent}: {os_reason(err)}"


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: not every filesystem lets a directory be fsynced)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def exists_error(path: Path) -> OutputExistsError:
    """The refusal of an output that already exists, naming the ``force`` parameter that allows replacing it."""
    return OutputExistsError(Message.format("{}: already exists; use {} to overwrite", path, Param("force", True)))


def _publish(tmp: Path, path: Path, force: bool) -> None:
    if force:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if the target appeared meanwhile: never clobber without force
    except FileExistsError:
        raise exists_error(path) from None
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        if path.exists():
            raise exists_error(path) from None
        os.replace(tmp, path)  # filesystems without hard links
        return
    tmp.unlink()


_HDF5_ERRNO = re.compile(r"errno\s*=\s*(\d+)")


def errno_in(err: BaseException) -> int | None:
    """The C errno an h5py error carries only in its message (``errno = 28``), if any."""
    match = _HDF5_ERRNO.search(str(err))
    return int(match.group(1)) if match else None


def os_reason(err: OSError) -> str:
    code = err.errno
    if code is None:  # h5py's OSErrors carry the C errno only in their message
        code = errno_in(err)
    if code == errno.ENOSPC:
        return "no space left on device"
    if code == errno.EDQUOT:
        return "disk quota exceeded"
    if code == errno.EFBIG:
        return "file too large (file size limit reached)"
    if code == errno.EROFS:
        return "read-only file system"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if code is not None and err.errno is None:
        return os.strerror(code)
    return err.strerror or reason(err)

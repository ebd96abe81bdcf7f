"""HDF5 sequence inputs are streamed: read a chunk of time steps at a time, x_grad written chunk by chunk."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest
from conftest import consistent_inputs, load_case, no_thread_can_start, write_h5, write_npz
from hypothesis import given, settings
from hypothesis import strategies as st

from lstmgrad_cli.analysis.summary import summarise
from lstmgrad_cli.cli import main
from lstmgrad_cli.operations.grad import GradOptions, run_grad_file


@pytest.fixture(autouse=True)
def small_datasets_stream(monkeypatch):
    """These tests' HDF5 datasets are small, and streamed all the same: a small one is read whole otherwise
    (``lazy.worth_leaving``; test_small_hdf5_datasets_are_read_whole_and_large_ones_left_in_the_file)."""
    from lstmgrad_cli.io import hdf5

    monkeypatch.setattr(hdf5, "worth_leaving", lambda shape, dtype: True)


def long_problem(T=40, B=3, I=5, C=4, seed=0):  # noqa: E741
    return consistent_inputs(T, B, I, C, seed=seed)


def read_h5(path):
    with h5py.File(path, "r") as fh:
        return {k: fh[k][()] for k in fh}, json.loads(fh.attrs["__lstmgrad__"])


@pytest.mark.parametrize("chunk_steps", [1, 7, 40])
def test_streamed_hdf5_equals_the_in_memory_run(tmp_path, chunk_steps):
    tensors = long_problem()
    scalars = {"seq_len_max": np.int64(33), "use_peephole": True}
    h5_in = write_h5(tmp_path / "in.h5", tensors, attrs=scalars)
    npz_in = write_npz(tmp_path / "in.npz", {**tensors, **scalars})
    options = GradOptions("seq", chunk_steps=chunk_steps)
    streamed = run_grad_file(h5_in, tmp_path / "streamed.h5", options)
    in_memory = run_grad_file(npz_in, tmp_path / "memory.npz", options)
    got, attrs = read_h5(tmp_path / "streamed.h5")
    with np.load(tmp_path / "memory.npz") as want:
        assert list(got) == ["x_grad", "cs_prev_grad", "h_prev_grad", "w_grad", "wci_grad", "wcf_grad", "wco_grad",
                             "b_grad"]
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)  # same chunks, same arithmetic
    assert not got["x_grad"][33:].any() and got["x_grad"][:33].any()
    assert attrs["tool"] == "lstmgrad" and attrs["seq_len_max"] == 33
    assert [t.l2_norm for t in streamed.tensors] == pytest.approx([t.l2_norm for t in in_memory.tensors])


@pytest.mark.parametrize("chunk_steps", [None, 3])
def test_streamed_x_grad_is_summarised_as_written_not_read_back(tmp_path, monkeypatch, chunk_steps):
    """Reading back an x_grad larger than memory for its summary cost a second pass over it."""
    tensors = long_problem(T=40, B=4, I=6, C=5, seed=2)
    tensors["ci"][5, 1, 2] = np.nan  # counted in the summary too
    h5_in = write_h5(tmp_path / "in.h5", tensors, attrs={"seq_len_max": np.int64(37)})
    read = []
    dataset_getitem = h5py.Dataset.__getitem__

    def spy(self, key):
        read.append(self.name)
        return dataset_getitem(self, key)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", spy)
    result = run_grad_file(h5_in, tmp_path / "g.h5", GradOptions("seq", chunk_steps=chunk_steps))
    monkeypatch.undo()
    assert "/x_grad" not in read
    assert result.tensors[0].name == "x_grad"
    got, _ = read_h5(tmp_path / "g.h5")
    want = summarise("x_grad", got["x_grad"])
    summary = result.tensors[0]
    assert (summary.finite, summary.nonfinite, summary.max_abs) == (want.finite, want.nonfinite, want.max_abs)
    assert summary.l2_norm == (None if want.l2_norm is None else pytest.approx(want.l2_norm, rel=1e-12))
    assert summary.nonfinite > 0  # the NaN reached x_grad


def test_streaming_needs_memory_for_a_chunk_not_for_the_file(runner, tmp_path, monkeypatch):
    tensors = long_problem(T=200)
    total = sum(v.nbytes for v in tensors.values())
    h5_in = write_h5(tmp_path / "in.h5", tensors)
    npz_in = write_npz(tmp_path / "in.npz", tensors)
    limit = total // 4  # far less than the file's tensors, far more than a chunk of steps
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", str(limit))
    streamed = runner.invoke(main, ["seq", str(h5_in), "-o", str(tmp_path / "g.h5"), "--chunk-steps", "10", "-q"])
    assert streamed.exit_code == 0, streamed.stderr
    eager = runner.invoke(main, ["seq", str(npz_in), "-o", str(tmp_path / "g.npz")])
    assert eager.exit_code == 1 and "more than the" in eager.stderr and "limit" in eager.stderr
    monkeypatch.delenv("LSTMGRAD_MAX_TENSOR_BYTES")
    reference = runner.invoke(main, ["seq", str(npz_in), "-o", str(tmp_path / "ref.npz"), "--chunk-steps", "10", "-q"])
    assert reference.exit_code == 0
    got, _ = read_h5(tmp_path / "g.h5")
    with np.load(tmp_path / "ref.npz") as want:
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_streamed_input_to_npz_output_and_per_step(runner, tmp_path):
    inputs, expected, _ = load_case("seq_v2_larger")
    src = write_h5(tmp_path / "run.h5", inputs)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--per-step", "--chunk-steps", "5",
                                  "--json"])
    assert result.exit_code == 0, result.stderr
    with np.load(tmp_path / "g.npz") as got:
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_a_step_too_large_for_memory_is_refused_before_reading(runner, tmp_path, monkeypatch):
    tensors = long_problem(T=4, B=50, I=40, C=8)
    src = write_h5(tmp_path / "in.h5", tensors)
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "1000")  # one step of x is 50*40*4 = 8000 bytes
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.h5")])
    assert result.exit_code == 1 and "one time step of it" in result.stderr
    assert not (tmp_path / "g.h5").exists()


def test_nan_in_a_streamed_input_is_counted_and_strict_writes_nothing(runner, tmp_path):
    tensors = long_problem()
    tensors["h_grad"][5, 1, 2] = np.nan
    src = write_h5(tmp_path / "in.h5", tensors)
    result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.h5"), "--strict", "--chunk-steps", "4"])
    assert result.exit_code == 1 and "NaN/Inf in inputs: h_grad (1)" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.h5"]


def test_the_overlapped_schedule_streams_too_and_equals_the_in_memory_run(tmp_path, monkeypatch):
    """Large shapes run the chunk products on a second thread; a streamed run (lazy inputs, x_grad written into
    the HDF5 output from either thread) takes that schedule too and gives the in-memory result bit for bit."""
    import threading

    from lstmgrad_cli.backends import _xp, cpu_blas

    monkeypatch.setattr(_xp, "OVERLAP_MIN_FLOPS", 0)  # this small shape takes the large shapes' chunks
    monkeypatch.setenv("LSTMGRAD_OVERLAP", "on")  # and runs them overlapped, whatever this machine measured
    # Per run, whether a w_grad product (every chunk has two) ran on a thread other than this one.  Either thread
    # of the overlapped schedule may take any of them, so this thread's first one waits for the other's (in the
    # sequential schedule there is no other thread: it waits once, in vain).
    other_thread, waited = [], []
    real_matmul_into = cpu_blas.matmul_into

    def matmul_into(a, b, out, accumulate):
        if threading.get_ident() != threading.main_thread().ident:
            other_thread[-1].set()
        elif len(waited) < len(other_thread):
            waited.append(other_thread[-1].wait(10))
        return real_matmul_into(a, b, out, accumulate)

    monkeypatch.setattr(cpu_blas, "matmul_into", matmul_into)
    tensors = long_problem(T=40, B=4, I=6, C=5, seed=3)
    h5_in = write_h5(tmp_path / "in.h5", tensors, attrs={"seq_len_max": np.int64(37)})
    npz_in = write_npz(tmp_path / "in.npz", {**tensors, "seq_len_max": np.int64(37)})
    other_thread.append(threading.Event())
    streamed = run_grad_file(h5_in, tmp_path / "streamed.h5", GradOptions("seq"))
    other_thread.append(threading.Event())
    in_memory = run_grad_file(npz_in, tmp_path / "memory.npz", GradOptions("seq"))
    assert all(ran.is_set() for ran in other_thread)  # both runs took the overlapped schedule
    got, _ = read_h5(tmp_path / "streamed.h5")
    with np.load(tmp_path / "memory.npz") as want:
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert streamed.nonfinite_inputs == in_memory.nonfinite_inputs == {}


@pytest.mark.parametrize("chunk_steps", [3, 40])
def test_nonfinite_inputs_of_a_streamed_run_are_counted_once_each_without_a_second_pass(tmp_path, monkeypatch,
                                                                                         chunk_steps):
    """NaN/Inf are counted as the pass reads the rows (cs is read one row past each chunk, detection reads a few
    rows first), each once, and rows the pass never reads (beyond seq_len_max) are read for the count alone."""
    from lstmgrad_cli.io import hdf5

    tensors = long_problem(T=40, B=3, I=5, C=4, seed=5)
    tensors["cs"][[0, 19, 20, 21, 38]] = np.nan  # chunk edges, detection's rows, a row beyond seq_len_max
    tensors["x"][1, 0, 0] = np.inf
    tensors["h_grad"][39, 2, 3] = -np.inf  # only beyond seq_len_max
    tensors["cs_prev"][0, 0] = np.nan  # in memory, counted as before
    scalars = {"seq_len_max": np.int64(36)}
    h5_in = write_h5(tmp_path / "in.h5", tensors, attrs=scalars)
    npz_in = write_npz(tmp_path / "in.npz", {**tensors, **scalars})
    reads = []
    real = hdf5.LazyDataset.__getitem__
    monkeypatch.setattr(hdf5.LazyDataset, "__getitem__", lambda self, index: reads.append((self._key, index)) or
                        real(self, index))
    options = GradOptions("seq", chunk_steps=chunk_steps)
    streamed = run_grad_file(h5_in, tmp_path / "streamed.h5", options)
    in_memory = run_grad_file(npz_in, tmp_path / "memory.npz", options)
    expected = {"cs": 5 * 3 * 4, "x": 1, "h_grad": 1, "cs_prev": 1}
    assert in_memory.nonfinite_inputs == expected
    assert streamed.nonfinite_inputs == expected
    rows_read = {}
    for key, index in reads:
        rows = range(40)[index] if isinstance(index, slice) else [index]
        for row in rows:
            rows_read[key, row] = rows_read.get((key, row), 0) + 1
    assert rows_read["h_grad", 39] == 1  # read once, for the count: the pass stops at seq_len_max
    assert max(n for (key, _), n in rows_read.items() if key == "x") <= 2  # no second pass over the file


class _Rows:
    """A stand-in for an h5py dataset: numpy slicing on a [T, ...] array."""

    def __init__(self, value):
        self.value, self.shape, self.dtype = value, value.shape, value.dtype

    def __getitem__(self, index):
        return self.value[index]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.integers(-3, 12), st.integers(-3, 12)), st.integers(-12, 11)), max_size=12),
       st.sets(st.integers(0, 11 * 2 - 1)))
def test_a_lazy_dataset_counts_each_nonfinite_entry_once_however_it_is_read(reads, bad):
    from lstmgrad_cli.io.hdf5 import LazyDataset

    value = np.arange(24, dtype=np.float32).reshape(12, 2)
    value.ravel()[sorted(bad)] = np.nan
    lazy = LazyDataset(_Rows(value), "t", None)
    for read in reads:
        index = slice(*read) if isinstance(read, tuple) else read
        np.testing.assert_array_equal(lazy[index], value[index])
    assert lazy.nonfinite(block_bytes=8) == len(bad)
    assert lazy.nonfinite() == len(bad)  # asked again: nothing counted twice


# -- reading ahead: contiguous datasets with pread, the next chunk on a thread --------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "userblock-512", "userblock-4096", "chunked", "gzip"])
def test_read_into_gives_what_hdf5_gives_with_pread_only_for_plain_contiguous_data(tmp_path, layout):
    from lstmgrad_cli.io.hdf5 import LazyDataset

    value = np.random.default_rng(0).standard_normal((9, 3, 5)).astype(np.float32)
    value[4, 1, 2] = np.nan
    path = tmp_path / "t.h5"
    userblock = int(layout.split("-")[1]) if layout.startswith("userblock") else 0
    with h5py.File(path, "w", userblock_size=userblock) as fh:
        if layout == "chunked":
            fh.create_dataset("t", data=value, chunks=(2, 3, 5))
        elif layout == "gzip":
            fh.create_dataset("t", data=value, compression="gzip")
        else:
            fh.create_dataset("t", data=value)
    with h5py.File(path, "r") as fh:
        lazy = LazyDataset(fh["t"], "t", path)
        assert (lazy._raw is not None) == (layout not in ("chunked", "gzip"))
        out = np.full((4, 3, 5), -1.0, np.float32)
        np.testing.assert_array_equal(lazy.read_into(3, 7, out), value[3:7])
        into = np.zeros((4, 3, 8), np.float32)  # a strided place, as the w_grad product's [x, h_prev, 1] buffer
        lazy.read_into(5, 9, into, np.s_[:, :, 2:7])
        np.testing.assert_array_equal(into[:, :, 2:7], value[5:9])
        assert not into[:, :, :2].any() and not into[:, :, 7:].any()
        assert lazy.nonfinite() == 1


def test_a_contiguous_dataset_past_the_files_end_is_not_read_with_pread(tmp_path):
    """A block that would reach past the end (a truncated or hostile file) is left to HDF5, which refuses it;
    a file that shrinks after opening is an InputFileError, never a short buffer."""
    from lstmgrad_cli.errors import InputFileError
    from lstmgrad_cli.io.hdf5 import LazyDataset

    path = write_h5(tmp_path / "t.h5", {"t": np.ones((50, 4, 4), np.float32)})
    with h5py.File(path, "r") as fh:
        offset = fh["t"].id.get_offset()
    with open(path, "r+b") as fh:
        fh.truncate(offset + 100)
    try:
        fh = h5py.File(path, "r")
    except OSError:
        pass  # this HDF5 refuses the file outright: nothing to read
    else:
        with fh:
            lazy = LazyDataset(fh["t"], "t", path)
            assert lazy._raw is None
            with pytest.raises(InputFileError, match="cannot be read"):
                lazy.read_into(40, 50, np.empty((10, 4, 4), np.float32))
    path = write_h5(tmp_path / "u.h5", {"t": np.ones((50, 4, 4), np.float32)})
    with h5py.File(path, "r") as fh:
        lazy = LazyDataset(fh["t"], "t", path)
        assert lazy._raw is not None
        os.truncate(path, fh["t"].id.get_offset() + 100)
        with pytest.raises(InputFileError, match=r"u\.h5: t cannot be read \(.*truncated") as caught:
            lazy.read_into(40, 50, np.empty((10, 4, 4), np.float32))
        assert str(caught.value).count("cannot be read") == 1


def test_the_next_chunk_is_read_on_a_thread_and_a_failed_read_is_one_line(runner, tmp_path, monkeypatch):
    """Plain contiguous datasets are read with preadv on the file's descriptor; the disk fails one such read (EIO)."""
    import errno
    import threading

    tensors = long_problem(T=40, B=3, I=5, C=4, seed=7)
    src = write_h5(tmp_path / "in.h5", tensors)
    threads, calls = [], []
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        threads.append(threading.current_thread().name)
        calls.append(offset)
        if fail_at and len(calls) >= fail_at and threads[-1].startswith("lstmgrad-read"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    fail_at = None
    before = threading.active_count()
    ok = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.h5"), "--chunk-steps", "4", "-q"])
    assert ok.exit_code == 0, ok.stderr
    assert any(name.startswith("lstmgrad-read") for name in threads)  # chunks after the first, ahead
    assert threading.active_count() == before  # the reading thread ended with the pass
    reference = runner.invoke(main, ["seq", str(write_npz(tmp_path / "in.npz", tensors)), "-o",
                                     str(tmp_path / "ref.npz"), "--chunk-steps", "4", "-q"])
    assert reference.exit_code == 0
    got, _ = read_h5(tmp_path / "g.h5")
    with np.load(tmp_path / "ref.npz") as want:
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)

    calls.clear()
    fail_at = 30  # a read of a later chunk, on the reading thread
    failed = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "h.h5"), "--chunk-steps", "4"])
    assert failed.exit_code == 1 and "Traceback" not in failed.stderr
    assert failed.stderr.startswith("Error: ") and "cannot be read (Input/output error)" in failed.stderr
    assert not (tmp_path / "h.h5").exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))\
        == []
    assert threading.active_count() == before


def test_a_lazy_dataset_used_after_its_file_closed_is_an_error_not_another_files_bytes(tmp_path):
    """pread goes through HDF5's descriptor, which the system may give to the next file opened: a read after
    the file is closed is refused, as h5py refuses it."""
    from lstmgrad_cli.errors import InputFileError
    from lstmgrad_cli.io.hdf5 import LazyDataset

    path = write_h5(tmp_path / "t.h5", {"t": np.ones((6, 2, 2), np.float32)})
    with h5py.File(path, "r") as fh:
        lazy = LazyDataset(fh["t"], "t", path)
        assert lazy._raw is not None
    other = open(tmp_path / "other.bin", "wb+")  # noqa: SIM115 - may take the closed file's descriptor number
    try:
        other.write(b"\x7f" * 4096)
        other.flush()
        with pytest.raises(InputFileError, match="cannot be read"):
            lazy.read_into(0, 6, np.empty((6, 2, 2), np.float32))
    finally:
        other.close()


def test_a_streamed_pass_reads_in_line_when_no_thread_can_start(runner, tmp_path):
    """Under a tight ulimit -v no thread may start: the pass reads every chunk itself, same result."""
    tensors = long_problem(T=40, B=3, I=5, C=4, seed=8)
    src = write_h5(tmp_path / "in.h5", tensors)
    reference = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "ref.h5"), "--chunk-steps", "4", "-q"])
    assert reference.exit_code == 0, reference.stderr
    with no_thread_can_start():
        result = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.h5"), "--chunk-steps", "4", "-q"])
    assert result.exit_code == 0, result.stderr
    got, _ = read_h5(tmp_path / "g.h5")
    want, _ = read_h5(tmp_path / "ref.h5")
    for key in got:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# -- a large streamed output is flushed to disk as it is written (io.atomic.synced_behind) --------------------------

@pytest.mark.parametrize("large", [True, False])
def test_a_large_streamed_output_is_flushed_as_the_pass_writes_it(tmp_path, monkeypatch, large):
    """So that the fsync publishing it finds little left to write; a small one is left to that fsync alone."""
    import threading

    from lstmgrad_cli.io import output
    from lstmgrad_cli.operations import grad as jobs

    events = []
    real_fsync, real_link = os.fsync, os.link
    real_datasync = getattr(os, "fdatasync", os.fsync)

    def datasync(fd):
        events.append(("datasync", os.path.realpath(f"/proc/self/fd/{fd}"), threading.current_thread().name))
        real_datasync(fd)

    monkeypatch.setattr(os, "fdatasync", datasync, raising=False)
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(
        ("fsync", os.path.realpath(f"/proc/self/fd/{fd}"), "")) or real_fsync(fd))
    # an output is put in place by a hard link to its temporary file (without force)
    monkeypatch.setattr(os, "link", lambda tmp, path, **kw: events.append(("publish", str(tmp), "")) or
                        real_link(tmp, path, **kw))
    monkeypatch.setattr(output, "SYNC_EVERY_SECONDS", 0.0005)
    if large:  # (this T, B, I is ~10 kB: large when the threshold is 0)
        monkeypatch.setattr(jobs, "LARGE_OUTPUT_BYTES", 0)
    tensors = long_problem(T=300, B=4, I=6, C=5, seed=4)
    h5_in = write_h5(tmp_path / "in.h5", tensors)
    run_grad_file(h5_in, tmp_path / "g.h5", GradOptions("seq", chunk_steps=1))
    (published,) = [name for kind, name, _ in events if kind == "publish"]
    datasyncs = [(name, thread) for kind, name, thread in events if kind == "datasync"]
    if large:
        assert datasyncs and all(d == (published, "lstmgrad-sync-behind") for d in datasyncs)
        assert events.index(("publish", published, "")) > max(
            i for i, e in enumerate(events) if e[0] == "datasync")  # all before the output is in place
    else:
        assert datasyncs == []
    assert ("fsync", published, "") in events[:events.index(("publish", published, ""))]  # still fsynced whole
    assert not any(t.name == "lstmgrad-sync-behind" for t in threading.enumerate())
    got, _ = read_h5(tmp_path / "g.h5")
    in_memory = run_grad_file(write_npz(tmp_path / "in.npz", tensors), tmp_path / "m.npz",
                              GradOptions("seq", chunk_steps=1))
    assert in_memory.status == "ok"
    with np.load(tmp_path / "m.npz") as want:
        for key in got:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_flushing_behind_stops_quietly_on_an_error_and_needs_no_thread(tmp_path, monkeypatch):
    """The fsync before the rename is what makes an output durable: a failed flush behind it, or no thread to
    flush on (a tight ulimit -v), changes nothing else."""
    import threading

    from lstmgrad_cli.io import atomic

    calls, tried = [], threading.Event()
    real_datasync = getattr(os, "fdatasync", os.fsync)

    def datasync(fd):  # the real call, recorded with the thread that made it
        calls.append((fd, threading.current_thread()))
        try:
            real_datasync(fd)
        finally:
            tried.set()

    monkeypatch.setattr(os, "fdatasync", datasync, raising=False)
    read_end, write_end = os.pipe()  # a descriptor the system cannot flush to a disk: fdatasync fails (EINVAL)
    try:
        with atomic.synced_behind(write_end, 0.001):
            assert tried.wait(timeout=60)
            flusher = calls[0][1]
            flusher.join(timeout=60)  # the block goes on: only an error ends the thread before the block does
            assert not flusher.is_alive() and flusher.name == "lstmgrad-sync-behind"
            assert [fd for fd, _ in calls] == [write_end]  # tried once, then stopped
    finally:
        os.close(read_end)
        os.close(write_end)

    with open(tmp_path / "f", "wb") as fh:
        ran = []
        with no_thread_can_start(), atomic.synced_behind(fh.fileno(), 0.001):
            ran.append(threading.active_count())
        assert ran == [threading.active_count()]  # no thread flushed meanwhile


# -- NPZ members left in the file ------------------------------------------------------------------------------------

def big_npz(path, T=64, B=32, I=8, C=256, seq_len_max=None, seed=5):  # noqa: E741
    """An NPZ input (np.savez: stored members) whose time-major members are 2 MiB each."""
    tensors = consistent_inputs(T, B, I, C, seed=seed)
    scalars = {} if seq_len_max is None else {"seq_len_max": np.int64(seq_len_max)}
    return write_npz(path, {**tensors, **scalars}), tensors


def test_small_hdf5_datasets_are_read_whole_and_large_ones_left_in_the_file(tmp_path, monkeypatch):
    """What is asked for lazily stays in the file from 4 MiB, or a sixteenth of LSTMGRAD_MAX_TENSOR_BYTES where
    that is less (as NPZ members do); a small one is read whole, as a batch's small files are (cheaper)."""
    from lstmgrad_cli import io

    monkeypatch.undo()  # the rule itself, not this module's fixture
    tensors = long_problem(T=40, B=64, I=5, C=4)  # cs, i: 40 KiB each; x: 50 KiB
    src = write_h5(tmp_path / "in.h5", tensors)
    with io.open_inputs(src, list(tensors), lazy=("x", "i", "cs")) as loaded:
        assert all(isinstance(loaded.tensors[k], np.ndarray) for k in tensors)
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "768K")  # from 48 KiB
    with io.open_inputs(src, list(tensors), lazy=("x", "i", "cs")) as loaded:
        assert isinstance(loaded.tensors["x"], io.LazyRows)
        assert isinstance(loaded.tensors["i"], np.ndarray) and isinstance(loaded.tensors["cs"], np.ndarray)
        assert isinstance(loaded.tensors["f"], np.ndarray)  # not asked for lazily
        np.testing.assert_array_equal(loaded.tensors["x"][3:7], tensors["x"][3:7])


def flip_byte(path, member: str, at: int) -> None:
    """Flip one bit of byte ``at`` of ``member``'s stored bytes (its .npy header included)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    with open(path, "r+b") as fh:
        fh.seek(info.header_offset + 26)
        name_length, extra_length = np.frombuffer(fh.read(4), "<u2")
        fh.seek(info.header_offset + 30 + int(name_length) + int(extra_length) + at)
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("form", ["npz", "npy-dir"])
def test_an_npz_input_over_the_memory_limit_streams_and_equals_the_in_memory_run(runner, tmp_path, monkeypatch,
                                                                                 form):
    """Its large stored members (or a directory's large .npy files) are read a chunk of steps at a time, as an HDF5
    file's are: a limit under the file's tensors, which an eager read refuses, is enough, and the gradients are the
    in-memory run's, bit for bit."""
    from lstmgrad_cli import io
    from lstmgrad_cli.errors import InputFileError

    src, tensors = big_npz(tmp_path / "in.npz", seq_len_max=50)
    if form == "npy-dir":
        (tmp_path / "in").mkdir()
        with np.load(src) as archive:
            for key in archive.files:
                np.save(tmp_path / "in" / f"{key}.npy", archive[key])
        src.unlink()
        src = tmp_path / "in"
    assert sum(v.nbytes for v in tensors.values()) > 16 * 2**20
    eager = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "eager.npz"), "-q"])
    assert eager.exit_code == 0, eager.stderr
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")
    with pytest.raises(InputFileError, match="more than"):
        io.read_inputs(src, list(tensors))
    streamed = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "streamed.npz"), "-q"])
    assert streamed.exit_code == 0, streamed.stderr
    with np.load(tmp_path / "eager.npz") as want, np.load(tmp_path / "streamed.npz") as got:
        assert sorted(got.files) == sorted(want.files)
        for key in want.files:
            if want[key].dtype.kind == "f":
                np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    with io.open_inputs(src, list(tensors), lazy=("x", "i", "cs")) as loaded:
        assert isinstance(loaded.tensors["i"], io.LazyRows) and isinstance(loaded.tensors["cs"], io.LazyRows)
        assert isinstance(loaded.tensors["x"], np.ndarray)  # 64 KiB: read whole
        assert isinstance(loaded.tensors["f"], np.ndarray)  # not asked for lazily


@pytest.mark.parametrize("step", [10, 60])  # a step the pass reads, and one past seq_len_max that it never reads
def test_a_corrupt_byte_in_an_npz_member_left_in_the_file_is_the_eager_reads_error_and_nothing_is_written(
        runner, tmp_path, monkeypatch, step):
    src, tensors = big_npz(tmp_path / "in.npz", seq_len_max=50)
    header = 128  # np.savez's .npy header, 128 bytes here
    flip_byte(src, "ci.npy", header + step * tensors["ci"][0].nbytes + 77)
    eager = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz")])
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")
    streamed = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz")])
    assert eager.exit_code == streamed.exit_code == 1
    assert "ci is corrupt or truncated (Bad CRC-32 for file 'ci.npy')" in streamed.stderr
    assert streamed.stderr == eager.stderr and "Traceback" not in streamed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.integers(-70, 70), st.integers(-70, 70)), st.integers(-64, 63),
                          st.just(())), max_size=10),
       st.booleans())
def test_an_npz_member_left_in_the_file_reads_rows_in_any_order_and_checks_its_crc_once_all_were_read(
        tmp_path_factory, reads, corrupt):
    from lstmgrad_cli import io
    from lstmgrad_cli.errors import InputFileError

    folder = tmp_path_factory.mktemp("lazy")
    want = np.random.default_rng(4).standard_normal((64, 32, 256)).astype(np.float32)  # 2 MiB
    want[7, 3, 5] = np.inf
    src = write_npz(folder / "in.npz", {"h_grad": want})
    if corrupt:
        flip_byte(src, "h_grad.npy", 128 + want[0].nbytes * 40 + 3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")  # members from 1 MiB left in the file
        try:
            with io.open_inputs(src, ["h_grad"], lazy=["h_grad"]) as loaded:
                lazy = loaded.tensors["h_grad"]
                assert isinstance(lazy, io.LazyRows) and lazy.shape == want.shape and lazy.dtype == want.dtype
                for read in reads:
                    index = slice(*read) if isinstance(read, tuple) and read else read
                    got = lazy[index]
                    assert got.shape == want[index].shape
                    assert np.count_nonzero(got != want[index]) <= corrupt  # (the flipped byte's entry differs)
                    buffer = np.empty_like(want[:5])
                    lazy.read_into(59, 64, buffer)
                    np.testing.assert_array_equal(buffer, want[59:])
                assert lazy.nonfinite(block_bytes=want[0].nbytes * 3) == 1  # every row read: the CRC-32 checked
        except InputFileError as err:
            assert corrupt and "h_grad is corrupt or truncated (Bad CRC-32 for file 'h_grad.npy')" in str(err)
        else:
            assert not corrupt


@pytest.mark.parametrize("form", ["npz", "npy-dir"])
def test_an_npz_member_left_in_the_file_is_an_error_once_its_block_ended(tmp_path, monkeypatch, form):
    from lstmgrad_cli import io
    from lstmgrad_cli.errors import InputFileError

    src, tensors = big_npz(tmp_path / "in.npz")
    if form == "npy-dir":
        src = tmp_path / "in"
        src.mkdir()
        np.save(src / "cs.npy", tensors["cs"])
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")
    with io.open_inputs(src, ["cs"], lazy=["cs"]) as loaded:
        lazy = loaded.tensors["cs"]
        assert isinstance(lazy, io.LazyRows)
        lazy[:3]
    with pytest.raises(InputFileError, match="cs cannot be read"):
        lazy[3:5]


def test_the_crc32_of_pieces_joins_into_the_crc32_of_the_whole():
    import zlib

    from lstmgrad_cli.io import crc32

    assert crc32._x_to_2_to_the(32) == crc32._x_to_2_to_the(0)  # what lets lengths past 2^29 bytes reuse the table
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()
    for cut in (0, 1, 7, 2500, 4999, 5000):
        first, second = data[:cut], data[cut:]
        assert crc32.combine(zlib.crc32(first), zlib.crc32(second), len(second)) == zlib.crc32(data)


def test_an_npz_member_no_one_read_has_its_crc_checked_when_its_block_ends(tmp_path, monkeypatch):
    from lstmgrad_cli import io
    from lstmgrad_cli.errors import InputFileError

    src, tensors = big_npz(tmp_path / "in.npz")
    flip_byte(src, "o.npy", 128 + tensors["o"].nbytes - 1)  # the last byte
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")
    with pytest.raises(InputFileError, match=r"o is corrupt or truncated \(Bad CRC-32 for file 'o.npy'\)"):
        with io.open_inputs(src, ["o"], lazy=["o"]) as loaded:
            assert isinstance(loaded.tensors["o"], io.LazyRows)


def test_an_npz_members_crc_error_is_raised_again_when_asked_again_and_a_selection_reads_only_its_rows(tmp_path,
                                                                                                     monkeypatch):
    """A caller that swallowed the first CRC-32 error (a read ahead not waited for) meets it again at ``nonfinite``
    and at the block's end; a selection of rows (``[3:9, 0]``, an empty range) reads those rows only, so a flipped
    byte elsewhere is not read by it."""
    from lstmgrad_cli import io
    from lstmgrad_cli.errors import InputFileError

    want = np.random.default_rng(9).standard_normal((64, 32, 256)).astype(np.float32)
    src = write_npz(tmp_path / "in.npz", {"h_grad": want})
    flip_byte(src, "h_grad.npy", 128 + want[0].nbytes * 40 + 3)
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")
    crc_error = r"h_grad is corrupt or truncated \(Bad CRC-32 for file 'h_grad.npy'\)"
    selected = []
    with pytest.raises(InputFileError, match=crc_error):  # at the block's end
        with io.open_inputs(src, ["h_grad"], lazy=["h_grad"]) as loaded:
            lazy = loaded.tensors["h_grad"]
            for index in [(slice(3, 9), 0), (slice(3, 9), slice(None), 5), slice(5, 5), slice(9, 3), (-2, 4),
                          (slice(2, 4), Ellipsis, 3)]:
                np.testing.assert_array_equal(lazy[index], want[index], err_msg=str(index))
                selected.append(index)
            with pytest.raises(InputFileError, match=crc_error):
                lazy[:]
            with pytest.raises(InputFileError, match=crc_error):
                lazy.nonfinite()
    assert len(selected) == 6  # none of them read the flipped row


def test_a_crc_error_found_while_the_activations_are_fitted_names_the_file_once(runner, tmp_path, monkeypatch):
    """With few steps the layout's fit reads every row of an activation: its CRC-32 error then comes from there, in
    the eager read's words."""
    src, tensors = big_npz(tmp_path / "in.npz", T=4, B=1024, I=8, C=128)
    flip_byte(src, "ci.npy", 128 + tensors["ci"][0].nbytes * 2 + 5)
    eager = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz")])
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")
    streamed = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz")])
    assert streamed.exit_code == eager.exit_code == 1
    assert streamed.stderr == eager.stderr == f"Error: {src}: ci is corrupt or truncated (Bad CRC-32 for file " \
                                              "'ci.npy')\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz"]


def test_strict_on_a_corrupt_member_whose_bad_value_the_fit_sampled_says_corrupt_not_misfit(runner, tmp_path,
                                                                                           monkeypatch):
    """A flipped bit in a value the layout's fit samples makes the activations fit nothing; with --strict that
    refuses the file before the pass reads the rest.  The member's CRC-32 is checked first: the error is the eager
    read's, which says what is wrong, not a misfit."""
    src, tensors = big_npz(tmp_path / "in.npz")
    T = tensors["ci"].shape[0]
    flip_byte(src, "ci.npy", 128 + (T // 2) * tensors["ci"][0].nbytes + 3)  # row 0, unit 0 of a sampled step
    eager = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--strict"])
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")
    streamed = runner.invoke(main, ["seq", str(src), "-o", str(tmp_path / "g.npz"), "--strict"])
    assert streamed.exit_code == eager.exit_code == 1
    assert streamed.stderr == eager.stderr == f"Error: {src}: ci is corrupt or truncated (Bad CRC-32 for file " \
                                              "'ci.npy')\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz"]


@pytest.mark.parametrize("form", ["npz", "npy-dir"])
def test_an_input_left_in_its_file_and_truncated_meanwhile_is_a_one_line_error(tmp_path, monkeypatch, form):
    """The file shrinks while the pass reads it (another process rewrites it): the rows past its new end are a
    clear error naming file and tensor, never zeros or another file's bytes."""
    from lstmgrad_cli import io
    from lstmgrad_cli.errors import InputFileError

    src, tensors = big_npz(tmp_path / "in.npz")
    target = src
    if form == "npy-dir":
        src = tmp_path / "in"
        src.mkdir()
        target = src / "cs.npy"
        np.save(target, tensors["cs"])
    monkeypatch.setenv("LSTMGRAD_MAX_TENSOR_BYTES", "16M")
    with pytest.raises(InputFileError) as err:
        with io.open_inputs(src, ["cs"], lazy=["cs"]) as loaded:
            lazy = loaded.tensors["cs"]
            np.testing.assert_array_equal(lazy[60:], tensors["cs"][60:])
            os.truncate(target, 4096)
            lazy[60:]
    message = str(err.value)
    assert message.startswith(f"{src}: cs") and "\n" not in message
    assert "cannot be read" in message or "corrupt or truncated" in message

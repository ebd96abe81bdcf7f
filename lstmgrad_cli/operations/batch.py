"""Running gradient jobs over many files: serially, in local worker processes, or on a Dask cluster.

Parallel runs use one code path, a ``concurrent.futures`` executor: a process pool for ``workers > 1`` (how its
processes start and stop: local_workers.py) or a ``distributed`` client's executor for a Dask scheduler address;
a serial run calls the same task function in this process.  Every file is a call of ``run_task`` and gives a
``GradResult`` (errors in a file are results, not exceptions), so results flow back the same way from anywhere;
a local worker is handed small files several at a time (``bundle_small``), a Dask worker one file a task.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from .. import backends, io
from ..backends import cpu_blas
from ..errors import ExitCode, LstmGradError, OutputExistsError, OutputFileError
from ..execution import interrupts, local_workers
from ..execution.allocator import keep_heap_top
from ..execution.dask_executor import NotStarted, SchedulerLost, dask_executor
from ..io import npydir, tfdbg
from ..io.provenance import output_difference
from ..messages import Message, Param, one_line
from ..problem.reading import forget_weights
from .grad import GradOptions, GradResult, existing_output, run_grad_file


@dataclass(frozen=True)
class Task:
    input: Path
    output: Path  # resolved before the run, so skipping and reporting know it up front
    group: str | None = None  # one execution of a TensorFlow debug dump (its --group)
    error: str | None = None  # why the input cannot be run, found while planning (a corrupt dump)
    input_format: str | None = None  # what io.sniff_format said of the input while planning (None: not known)


@dataclass(frozen=True)
class DumpSelection:
    """Which gradient-op executions of TensorFlow debug dumps to run (an input that is a dump is many problems)."""

    kind: str | None = None
    group: str | None = None
    op: str | None = None
    execution: int | None = None


def plan_tasks(inputs: Sequence[Path], output: Path | None, out_dir: Path | None,
               dumps: DumpSelection = DumpSelection(), subdirs: Mapping[Path, Path] | None = None) -> list[Task]:
    """The output of each input: ``-o`` for a single input, else ``<stem>.grads.<ext>`` (in ``out_dir``, in the
    input's subdirectory ``subdirs[input]`` there where one is given: a tree of inputs mirrored).

    A TensorFlow debug dump gives one task per selected gradient-op execution, written to
    ``<dump>.<execution>.grads.npz``.  An input named twice is run once; two inputs that would write the
    same output are refused (OutputFileError) before anything runs, so no output silently replaces or
    "skips" another.
    """
    tasks: list[Task] = []
    seen_inputs: set[Path] = set()
    targets: dict[Path, Path] = {}
    resolve = _resolver()
    for path in inputs:
        key = resolve(path)
        if key in seen_inputs:
            continue
        seen_inputs.add(key)
        for group, target, error, fmt in _targets(path, output, dumps):
            if out_dir is not None and output is None:
                target = out_dir / (subdirs or {}).get(path, Path()) / target.name
            other = targets.setdefault(resolve(target), path)
            if other is not path:
                raise OutputFileError(Message.format("{} and {} would both write {}; give them separate {} runs",
                                                     other, path, target, Param("out_dir")))
            tasks.append(Task(path, target, group, error, fmt))
    if output is not None and len(tasks) > 1:
        members = [t.group or "" for t in tasks]  # (whole: they are what --group takes)
        raise OutputFileError(Message.format(
            "{} names one output, but {} holds {} executions to run ({}); use {}, or choose one with {}, {} or {}",
            Param("output"), inputs[0], len(tasks), io.describe_keys(members, limit=5, width=max(map(len, members))),
            Param("out_dir"), Param("group"), Param("op"), Param("execution")))
    return tasks


def _resolver() -> Callable[[Path], Path]:
    """``Path.resolve`` for many files in a few directories: each directory is resolved once, and a file itself
    only where it is a symbolic link (a batch's plan resolved every component of every input and output: ~0.1 ms
    a file)."""
    directories: dict[Path, Path] = {}

    def resolve(path: Path) -> Path:
        try:
            link = path.name in ("", ".", "..") or path.is_symlink()
        except OSError:  # a directory that cannot be searched: as Path.resolve would have it
            link = True
        if link:
            return path.resolve()
        parent = directories.get(path.parent)
        if parent is None:
            parent = directories[path.parent] = path.parent.resolve()
        return parent / path.name

    return resolve


def _targets(path: Path, output: Path | None,
             dumps: DumpSelection) -> list[tuple[str | None, Path, str | None, str | None]]:
    """(group, output, error, input format) of each task of one input (a directory of .npy files may be one
    through its ``--group`` subdirectory alone: npydir.sniff_group)."""
    try:
        fmt = npydir.input_format(path, dumps.group)
    except LstmGradError:  # the run says what is wrong
        return [(dumps.group, output or path.with_name(path.name + ".grads.npz"), None, None)]
    if fmt != "tfdbg2":
        return [(dumps.group, output or io.default_output(path, fmt), None, fmt)]
    try:
        index = tfdbg.index_dump(path)
        chosen = tfdbg.select_executions(index, dumps.kind, dumps.group, dumps.op, dumps.execution)
    except LstmGradError as err:  # the dump's own failure, reported when its turn comes
        return [(None, output or path.with_name(path.name + ".grads.npz"), one_line(err), fmt)]
    slugs = tfdbg.member_slugs(e.member for e in chosen)  # distinct: no two executions share an output
    return [(e.member, output or path.with_name(f"{path.name}.{slugs[e.member]}.grads.npz"), None, fmt)
            for e in chosen]


def run_task(task: Task, options: GradOptions, blas_threads: int | None = None) -> GradResult:
    """One file, never raising for a bad file: the error becomes a failed result."""
    if task.error is not None:
        return failed(task, options, task.error)
    limits = _blas_limits(blas_threads)
    if task.group is not None:
        options = replace(options, group=task.group)
    names = (task.input, task.output, options.weights)  # (their newlines and tabs escaped, not made spaces)
    try:
        with limits:
            return run_grad_file(task.input, task.output, options, input_format=task.input_format)
    except LstmGradError as err:
        return failed(task, options, one_line(err, names))
    except MemoryError:
        return failed(task, options, one_line(f"{task.input}: out of memory", names))
    except OSError as err:  # an I/O failure nothing above foresaw: still this file's failure, not a traceback
        reason = err.strerror or " ".join(str(err).split()) or type(err).__name__
        return failed(task, options, one_line(f"{task.input}: {reason}", names))
    except Exception as err:  # noqa: BLE001 - a bug met on one file is that file's failure; the batch goes on
        reason = " ".join(str(err).split())[:300]
        said = f"{task.input}: unexpected {type(err).__name__}{f': {reason}' if reason else ''}"
        return failed(task, options, one_line(f"{said} (a bug in lstmgrad: please report it)", names))


@dataclass(frozen=True)
class Unpublished:
    """A local worker's result whose output is written but not yet in place: the process it reports to
    fsyncs and renames it (``io.publish_handed``), so the worker goes on at once with its next file."""

    result: GradResult
    output: io.Handoff


def run_task_unpublished(task: Task, options: GradOptions) -> GradResult | Unpublished:
    """``run_task`` in a local worker process: an output written is returned ``Unpublished``, for the parent to
    fsync and rename (``_outcomes``).  Interrupted (local_workers._stop_signal), it raises KeyboardInterrupt and
    leaves nothing."""
    local_workers.note_output(task.output, io.remove_temporaries_of)
    with io.handed_to_parent() as handoffs:
        try:
            with local_workers.interruptible_task():
                result = run_task(task, options)
        except BaseException as err:
            _remove_handed(handoffs)  # an output written, then interrupted: no one will publish it
            if isinstance(err, KeyboardInterrupt):
                local_workers.interrupt_taken()
            raise
    if handoffs and result.status == "ok":
        return Unpublished(result, handoffs[0])
    _remove_handed(handoffs)  # (never happens: the output is a run's last step) nothing half-done stays behind
    return result


def run_tasks_unpublished(bundle: Sequence[Task], options: GradOptions,
                          keep_going: bool) -> list[GradResult | Unpublished | KeyboardInterrupt | None]:
    """Several small files in a local worker process, one after another (one pool task: ``bundle_small``): each
    one's ``run_task_unpublished``.  An interrupted file (KeyboardInterrupt, which the parent reports as a task
    that raised it: ``_failure``) ends the task; so does a failed one unless ``keep_going``, and the batch
    stopping (``local_workers.queued_stopped``: another file failed, an interrupt).  The files after it are not
    run (None)."""
    values: list[GradResult | Unpublished | KeyboardInterrupt | None] = [None] * len(bundle)
    for position, task in enumerate(bundle):
        if local_workers.queued_stopped():
            break
        try:
            value = run_task_unpublished(task, options)
        except KeyboardInterrupt:  # the ones before it are kept, for the parent
            values[position] = KeyboardInterrupt()
            break
        values[position] = value
        result = value.result if isinstance(value, Unpublished) else value
        if result.status == "failed" and not keep_going:
            break
    return values


def _remove_handed(handoffs: list[io.Handoff]) -> None:
    for handoff in handoffs:
        with contextlib.suppress(OSError):
            handoff.tmp.unlink()


def failed(task: Task, options: GradOptions, error: str) -> GradResult:
    """The result of a task that failed with ``error`` (one line)."""
    return GradResult(str(task.input), None, options.op, member=task.group, status="failed", error=error)


def _outcomes(future: cf.Future, bundle: Sequence[int], tasks: Sequence[Task], options: GradOptions,
              results: Sequence[GradResult | None], worker_pids: frozenset[int] = frozenset()
              ) -> Iterator[tuple[int, GradResult]]:
    """(index, result) of each task of a finished future (``bundle``: their indexes) that was started and has no
    result in ``results`` yet.  A local worker's output is fsynced and renamed as its result is taken.

    A worker that died (killed, out of memory) is the failure of each file it was handed, a lost Dask scheduler
    their "lost", neither a crash.  A local task that failed so (died, or interrupted) has whatever temporary file
    one of the ``worker_pids`` left for each output removed."""
    if future.cancelled():
        return
    err = future.exception()  # the future is done: this does not wait
    if err is None:
        value = future.result()
        items = value if isinstance(value, list) else [value]  # a list: run_tasks_unpublished
        for position, (index, item) in enumerate(zip(bundle, items, strict=True)):
            if item is None or results[index] is not None:
                continue
            if isinstance(item, KeyboardInterrupt):  # run_tasks_unpublished: as if the task had raised it
                items[position] = result = _failure(item, tasks[index], options, worker_pids)
                yield index, result
                continue
            try:
                items[position] = result = _taken(item, tasks[index], options)  # taken again: as it was taken
            except io.InterruptedInPlace:  # once its output was in place: it stays, and taken again, is the result
                items[position] = item.result
                raise
            except KeyboardInterrupt:  # while publishing: its output is discarded, and taken again, it says so
                if isinstance(item, Unpublished):
                    with contextlib.suppress(OSError):
                        item.output.tmp.unlink()
                items[position] = failed(tasks[index], options, f"{tasks[index].input}: interrupted")
                raise
            yield index, result
        return
    if isinstance(err, NotStarted):
        return
    for index in bundle:
        if results[index] is None:
            yield index, _failure(err, tasks[index], options, worker_pids)


def _taken(value: GradResult | Unpublished, task: Task, options: GradOptions) -> GradResult:
    """The result a task returned; a local worker's output is published first (fsynced and renamed here)."""
    if isinstance(value, Unpublished):
        return _as_published(io.publish_handed(value.output), task, options, value.result)
    return value


def _failure(err: BaseException, task: Task, options: GradOptions, worker_pids: frozenset[int]) -> GradResult:
    """The result of a task whose future ended with ``err`` (see ``_outcomes``)."""
    if isinstance(err, SchedulerLost):
        return _lost(task, options, str(err))
    io.remove_left_behind(task.output, worker_pids)
    if isinstance(err, KeyboardInterrupt):  # the worker got the terminal's Ctrl-C too
        return failed(task, options, f"{task.input}: interrupted")
    reason = " ".join(str(err).split()) or type(err).__name__
    return failed(task, options, f"{task.input}: the worker process failed ({type(err).__name__}: {reason})")


def _lost(task: Task, options: GradOptions, error: str) -> GradResult:
    """A task whose result never came back: kept when its output is there and complete, else "lost"."""
    request = (replace(options, group=task.group) if task.group else options).key(task.input)
    if task.output.exists() and output_difference(task.output, task.input, request) is None:
        return GradResult(str(task.input), str(task.output), options.op, member=task.group, status="skipped",
                          notes=["finished, but its result was lost on the way back; the output is complete"])
    return GradResult(str(task.input), None, options.op, member=task.group, status="lost",
                      error=f"{task.input}: {error}")


# Small files go to local workers several at a time, as one pool task: each task costs this process ~1 ms of CPU,
# taken from the cores the workers compute on (benchmarks/RESULTS.md).
BUNDLE_INPUT_BYTES = 4 * 2**20  # at most this much input in one task; a larger file goes alone
BUNDLE_MOST_FILES = 8
BUNDLES_PER_WORKER = 8  # at least this many tasks a worker, so that the end of a batch is shared out evenly


def bundle_small(tasks: Sequence[Task], pending: Sequence[int], options: GradOptions, workers: int) -> list[list[int]]:
    """The pending tasks (their indexes, in order) as local workers are handed them: consecutive small files
    together, up to ``BUNDLE_INPUT_BYTES`` of input and ``BUNDLE_MOST_FILES`` files, fewer where the batch is short
    (at least ``BUNDLES_PER_WORKER`` bundles a worker).  A larger file, an execution of a TensorFlow dump, an input
    the plan could not read, and every file of a ``--per-step`` run (many backward passes each) go alone."""
    most = min(BUNDLE_MOST_FILES, len(pending) // (workers * BUNDLES_PER_WORKER))
    bundles: list[list[int]] = []
    room = -1  # input bytes the last bundle can still take (-1: it takes no more)
    for index in pending:
        size = _small_input_bytes(tasks[index], options) if most > 1 else None
        if size is not None and size <= room and len(bundles[-1]) < most:  # room >= 0: a bundle is open
            bundles[-1].append(index)
            room -= size
        else:
            bundles.append([index])
            room = -1 if size is None else BUNDLE_INPUT_BYTES - size
    return bundles


def _small_input_bytes(task: Task, options: GradOptions) -> int | None:
    """The size of a task's input where it may share a pool task with others (``bundle_small``), else None."""
    if options.per_step or task.error is not None or task.input_format in (None, "tfdbg2"):
        return None
    try:
        size = task.input.stat().st_size
    except OSError:  # the run says what is wrong
        return None
    return size if size < BUNDLE_INPUT_BYTES else None


def _submit(executor: cf.Executor, bundle: list[Task], options: GradOptions, threads: int | None, local: bool,
            keep_going: bool) -> cf.Future:
    """``executor.submit(run_task, ...)`` (``run_tasks_unpublished`` to a ``local`` pool, which runs every task of
    ``bundle``; a Dask task is one file), or a future holding the error when handing out fails.

    A worker killed while tasks are still being handed out breaks the pool: later submits raise
    BrokenProcessPool, and one that is starting a worker at that moment can raise whatever starting it
    does (ValueError from a pipe the pool just closed).  Either is the failure of the files handed (``_outcomes``).
    """
    try:
        if local:
            return executor.submit(run_tasks_unpublished, bundle, options, keep_going)
        (task,) = bundle
        return executor.submit(run_task, task, options, threads)
    except Exception as err:  # noqa: BLE001 - BrokenProcessPool, RuntimeError after shutdown, a failed spawn
        failed: cf.Future = cf.Future()
        failed.set_exception(err)
        return failed


_worker_syncs = []  # a local worker process's deferred directory syncs (its parent does them: run_batch)


def _worker_started() -> None:
    """In each local worker process: SIGINT and SIGTERM stop it as local_workers._stop_signal says (unless
    ignored); keep the heap's top for the next file (execution/allocator.py); leave fsyncing output directories to the
    parent, once per directory."""
    local_workers.catch_stop_signals()
    keep_heap_top()
    deferred = io.directories_synced_at_end()
    deferred.__enter__()  # never left: the parent syncs the directories of the outputs the workers report
    _worker_syncs.append(deferred)


def _blas_limits(threads: int | None):
    if not threads:
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415 - optional (dask and dev extras)
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads)


@contextlib.contextmanager
def make_executor(workers: int = 1, dask_address: str | None = None,
                  initializer: Callable[[], None] | None = None,
                  devices: Sequence[str] = ()) -> Iterator[tuple[cf.Executor | None, int | None]]:
    """(executor, BLAS threads per task) for the chosen way of running; no executor for a serial run.
    ``initializer`` runs first in each local worker process; ``devices``: the CUDA devices local workers are
    spread over, one each in turn (``gpu_devices``)."""
    if dask_address:
        with dask_executor(dask_address) as executor:
            # A Dask worker runs one task per thread at once: one BLAS thread per task keeps it at its cores.
            yield executor, 1
        return
    if workers > 1:
        with local_workers.pool(workers, initializer, devices) as (pool, threads):
            yield pool, threads
        return
    yield None, None  # serial: tasks run in this process, one after another


def gpu_devices(backend: str | None) -> list[str]:
    """The CUDA devices a batch's local workers are spread over, one each in turn, when ``backend`` (a name, None
    for the default) computes on a GPU (cupy, a plugin with ``gpu_arrays``): ``backends.visible_devices``; [] for
    a host backend."""
    name = backends.resolve_name(backend)
    # A built-in is known by name (no plugin takes one): the plugins' entry points, whose reading imports ~40 ms
    # of modules, are read only for another name.
    if name in backends.BUILTIN_BY_NAME:
        return backends.visible_devices() if name == "cupy" else []
    if name in backends.registry():  # a plugin, loaded to ask
        if backends.takes_gpu_arrays(backends.get_backend(name)):
            return backends.visible_devices()
    return []


@dataclass
class BatchReport:
    """What a batch came to: its results in task order (None where a file was not run), the stop signals it got,
    and from them its counts, its summary and its exit code (as black's ``Report`` owns a run's)."""

    results: Sequence[GradResult | None]
    signals: Sequence[int] = field(default_factory=list)  # the stop signals that ended it (interrupts.received)

    @cached_property
    def counts(self) -> dict[str, int]:
        """ok, failed, skipped and lost files, and those not run (stopped first)."""
        ran = [r for r in self.results if r is not None]
        counts = {status: sum(r.status == status for r in ran) for status in ("ok", "failed", "skipped", "lost")}
        return {**counts, "not_run": len(self.results) - len(ran)}

    @property
    def done(self) -> int:
        """Files whose output is there and complete: computed now, or kept from before."""
        return self.counts["ok"] + self.counts["skipped"]

    @property
    def interrupted(self) -> str | None:
        """The name of the stop signal that ended the batch (SIGINT, SIGTERM), or None."""
        import signal  # noqa: PLC0415

        return signal.Signals(self.signals[0]).name if self.signals else None

    def summary(self) -> dict[str, int]:
        """The counts as the --json document gives them."""
        c = self.counts
        return {"done": c["ok"], "failed": c["failed"], "skipped": c["skipped"], "lost": c["lost"],
                "not_run": c["not_run"]}

    @property
    def exit_code(self) -> int:
        """128 + the signal that stopped it; ``ERROR`` when a file failed or was lost; else ``SUCCESS``."""
        if self.signals:
            return ExitCode.signalled(self.signals[0])
        return ExitCode.ERROR if self.counts["failed"] or self.counts["lost"] else ExitCode.SUCCESS


def run_batch(tasks: Sequence[Task], options: GradOptions, *, workers: int = 1, dask_address: str | None = None,
              keep_going: bool = False, skip_existing: bool = False,
              on_result: Callable[[Task, GradResult], None] | None = None,
              stop: Callable[[], bool] = lambda: False) -> list[GradResult | None]:
    """Run every task; results in task order (None for tasks not run after a failure without keep_going,
    or after ``stop()`` turned true, e.g. on an interrupt)."""
    try:
        return _run_batch(tasks, options, workers, dask_address, keep_going, skip_existing, on_result, stop)
    finally:
        forget_weights()  # (kept while the batch read them for each file)


def _run_batch(tasks, options, workers, dask_address, keep_going, skip_existing, on_result, stop):
    results: list[GradResult | None] = [None] * len(tasks)

    def finish(index: int, result: GradResult) -> None:
        results[index] = result
        if on_result is not None:
            on_result(tasks[index], result)

    with interrupts.interruptible():  # (what it finds is reported as it goes: an interrupt loses nothing)
        pending = _not_done(tasks, options, skip_existing, keep_going, finish)
    if not pending:  # (None: a file found there stopped the batch)
        return results
    if dask_address:  # workers elsewhere: each makes its outputs durable itself
        # Their working directory is not this one: they get absolute paths, and the results say the paths as given.
        sent = [replace(t, input=t.input.absolute(), output=t.output.absolute()) for t in tasks]
        if options.weights is not None:
            options = replace(options, weights=str(Path(options.weights).absolute()))

        def finish_as_given(index: int, result: GradResult) -> None:
            finish(index, _as_given(result, tasks[index]))

        return _run_pending(sent, pending, options, results, finish_as_given, workers, dask_address, keep_going, stop)
    # This process and its local workers write into a few directories: each is fsynced once, at the end.
    with io.directories_synced_at_end() as directories:
        try:
            return _run_pending(tasks, pending, options, results, finish, workers, dask_address, keep_going, stop)
        finally:
            directories.update(Path(r.output).parent for r in results if r is not None and r.status == "ok")


def _not_done(tasks: Sequence[Task], options: GradOptions, skip_existing: bool, keep_going: bool,
              finish: Callable[[int, GradResult], None]) -> list[int] | None:
    """The indexes of the tasks to run: with ``skip_existing``, not those whose output is complete (reported
    skipped) nor those whose output differs (failed, unless ``--force``); None when one of those stops the batch."""
    pending = []
    for index, task in enumerate(tasks):
        if skip_existing and task.output.exists():
            request = (replace(options, group=task.group) if task.group else options).key(task.input)
            difference = output_difference(task.output, task.input, request)
            if difference is None:
                finish(index, GradResult(str(task.input), str(task.output), options.op, member=task.group,
                                         status="skipped"))
                continue
            if not options.force:
                finish(index, failed(task, options, Message.format("{}: exists but {}; use {} to replace it",
                                                                   task.output, difference, Param("force", True))))
                if not keep_going:
                    return None
                continue
        pending.append(index)
    return pending


def _as_given(result: GradResult, task: Task) -> GradResult:
    """A result of a task sent with absolute paths, naming its input and output as ``task`` does."""
    return replace(result, input=str(task.input), output=None if result.output is None else str(task.output))


def _run_pending(tasks, pending, options, results, finish, workers, dask_address, keep_going, stop):
    """run_batch's tasks ``pending`` (their indexes), serially or through an executor."""
    futures: dict[cf.Future, list[int]] = {}  # each task handed out, and the indexes of its files
    local = not dask_address
    bundles = bundle_small(tasks, pending, options, workers) if local and workers > 1 else [[i] for i in pending]
    # No more worker processes than tasks: all of them start before the first (local_workers._start_all_workers).
    try:
        with contextlib.ExitStack() as running:
            try:
                with interrupts.interruptible():  # (starting the pool, connecting to Dask: a signal interrupts them)
                    count = min(workers, len(bundles))
                    devices = gpu_devices(options.backend) if local and count > 1 else []
                    executor, threads = running.enter_context(make_executor(count, dask_address, _worker_started,
                                                                            devices))
            except (OSError, RuntimeError, cf.BrokenExecutor) as err:
                # Local workers that could not start (one killed as it started, or multiprocessing's resource
                # tracker: a broken pipe to it): each file's failure, not the batch's (nor its stdout's).
                if dask_address:
                    raise
                for index in pending:
                    finish(index, failed(tasks[index], options, f"{tasks[index].input}: the worker processes could "
                                                                 f"not start ({type(err).__name__}: {err})"))
                return results
            if executor is None:
                return _run_serially(tasks, pending, options, results, finish, keep_going, stop)
            # Local workers were started with their BLAS thread counts set (local_workers._thread_env), and leave
            # their outputs' fsync and rename to this process (run_task_unpublished); Dask workers, which run one
            # task per thread, limit each task's threads (threadpoolctl: ~0.5 ms a task) and publish their own
            # outputs.
            pids = frozenset(getattr(executor, "_processes", None) or ()) if local else frozenset()
            try:
                with interrupts.deferred():  # a stop signal interrupts the waits only (execution/interrupts.py)
                    for bundle in bundles:  # one at a time: interrupted meanwhile, those handed out are waited for
                        futures[_submit(executor, [tasks[i] for i in bundle], options, threads, local,
                                        keep_going)] = bundle
                    completed = cf.as_completed(futures)
                    while (future := _next_interruptibly(completed)) is not None:
                        failed_now = False
                        for index, result in _outcomes(future, futures[future], tasks, options, results, pids):
                            finish(index, result)
                            failed_now = failed_now or result.status == "failed"
                        if stop() or (failed_now and not keep_going):
                            break
            finally:
                if hasattr(executor, "stop_queued"):  # local workers: the bundles they hold go no further
                    executor.stop_queued()
                if interrupts.received() and hasattr(executor, "interrupt_workers"):
                    # stopped by a signal this process got (a terminal's Ctrl-C reaches the workers too; kill, a
                    # parent process or a scheduler may signal this one alone): the files in hand are interrupted
                    executor.interrupt_workers()
                interrupts.take()  # (what stopped the batch: a signal now interrupts the wait for those started)
                _finish_started(futures, tasks, options, results, finish, local, pids)
    finally:
        _discard_unpublished(futures)
    return results


def _next_interruptibly(completed: Iterator[cf.Future]) -> cf.Future | None:
    """The next future ``cf.as_completed`` gives (None at the end), waited for where a stop signal interrupts."""
    with interrupts.interruptible():
        return next(completed, None)


def _discard_unpublished(futures) -> None:
    """Remove the temporary files of local workers' outputs whose results were never taken (the run was
    interrupted while waiting for them): no one will publish them.  Published ones are gone already."""
    for future in futures:
        if future.done() and not future.cancelled() and future.exception() is None:
            value = future.result()
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, Unpublished):
                    with contextlib.suppress(OSError):
                        item.output.tmp.unlink()


SETTLE_AT_ONCE_SECONDS = 0.25  # a file that took longer is reported before the next starts (_run_serially)


def _run_serially(tasks, pending, options, results, finish, keep_going, stop):
    """The pending tasks one after another in this process.  Each output's fsync and rename run on a thread
    while the next file is read and computed (io.published_behind); a result is reported once its output is
    in place, or as failed when publishing it failed (nothing written).  A file that took more than
    ``SETTLE_AT_ONCE_SECONDS`` is reported before the next starts (its fsync is nothing beside its computation,
    and progress should not lag a long file).  After a stop every output already handed over is finished and
    reported, so none appears that the results do not list."""
    held: tuple[int, GradResult] | None = None  # a task whose output is being published, and its result

    def settle(item: tuple[int, GradResult] | None) -> bool:
        """Report a held task once its output is in place; whether it failed."""
        if item is None:
            return False
        index, result = item
        result = _published(publisher, tasks[index], options, result)
        finish(index, result)
        return result.status == "failed"

    # One file: nothing to overlap its publishing with.  BLAS thread counts change only when a file needs
    # other counts than the last (cpu_blas.counts_held).
    with (io.published_behind() if len(pending) > 1 else contextlib.nullcontext()) as publisher, \
            cpu_blas.counts_held(), interrupts.deferred():  # a stop signal interrupts a file's run only
        try:
            for index in pending:
                if stop():
                    break
                with interrupts.interruptible():  # (not once its output is handed over: interrupts.commit)
                    result = run_task(tasks[index], options)
                previous, held = held, (index, result)  # held first: an interrupt in settle() still reports it
                failed_now = settle(previous)
                if result.seconds is None or result.seconds >= SETTLE_AT_ONCE_SECONDS:
                    current, held = held, None
                    failed_now = settle(current) or failed_now
                if not keep_going and (failed_now or result.status == "failed"):
                    break
        finally:
            last, held = held, None
            settle(last)
    return results


def _published(publisher, task: Task, options: GradOptions, result: GradResult) -> GradResult:
    """``result`` once its output is in place; what happened instead when publishing it failed."""
    if publisher is None or result.status != "ok" or result.output is None:
        return result
    return _as_published(publisher.outcome(result.output), task, options, result)


def _as_published(error: BaseException | None, task: Task, options: GradOptions, result: GradResult) -> GradResult:
    """``result`` of a run whose output publishing ended with ``error`` (None: it is in place)."""
    if error is None:
        return result
    if isinstance(error, OutputExistsError):  # another run published it while this one computed
        options = replace(options, group=task.group) if task.group else options
        try:
            return existing_output(result, Path(result.output), options.key(task.input))
        except LstmGradError as err:
            return failed(task, options, one_line(err))
    if isinstance(error, LstmGradError):
        return failed(task, options, one_line(error))
    if isinstance(error, Exception):  # an fsync or rename failing as nothing foresaw: still only this file's
        return failed(task, options, f"{task.output}: cannot write ({type(error).__name__}: {error}); nothing was "
                                     "written")
    raise error


def _finish_started(futures: dict, tasks: Sequence[Task], options: GradOptions, results: list,
                    finish: Callable[[int, GradResult], None], local: bool = False,
                    worker_pids: frozenset[int] = frozenset()) -> None:
    """After a stop (a failure, an interrupt): cancel every task not started, then wait for those that have (no
    executor can stop them) and report them, so no output appears that the results do not list.

    Interrupted again while waiting, the tasks still running are reported "lost": a Dask worker's output may yet
    appear; a ``local`` worker's never will (its parent publishes it, and now will not: _discard_unpublished).
    """
    started = [future for future in futures
               if not future.cancel() and any(results[index] is None for index in futures[future])]
    try:
        with interrupts.deferred():  # a stop signal interrupts the wait only
            completed = cf.as_completed(started)
            while (future := _next_interruptibly(completed)) is not None:
                for index, result in _outcomes(future, futures[future], tasks, options, results, worker_pids):
                    finish(index, result)
    except KeyboardInterrupt:
        fate = "nothing of it is kept" if local else "its output may still be written"
        for future in started:
            for index in _run_or_running(future, futures[future]):
                if results[index] is None:
                    finish(index, _lost(tasks[index], options,
                                        f"still running when the batch was interrupted; {fate}"))
        raise


def _run_or_running(future: cf.Future, bundle: list[int]) -> list[int]:
    """The files of a task handed out (their indexes ``bundle``) that ran or may be running: none of a cancelled
    task, and of a finished local one only those its worker ran (run_tasks_unpublished)."""
    if future.cancelled():
        return []
    value = future.result() if future.done() and future.exception() is None else None
    if isinstance(value, list):
        return [index for index, item in zip(bundle, value, strict=True) if item is not None]
    return bundle


def run_each(function: Callable, items: Sequence, *, workers: int = 1,
             on_result: Callable[[int, object], None] | None = None,
             stop: Callable[[], bool] = lambda: False) -> list:
    """``function(item)`` for every item, in this process or in ``workers`` local processes (``function`` must
    be importable by name); results in item order.  ``function`` reports its own failures in its result; a
    worker that dies gives that item a ``WorkerFailure``."""
    results: list = [None] * len(items)

    def finish(index: int, result) -> None:
        results[index] = result
        if on_result is not None:
            on_result(index, result)

    with make_executor(min(workers, max(len(items), 1))) as (executor, _threads):
        if executor is None:
            for index, item in enumerate(items):
                if stop():
                    break
                finish(index, function(item))
            return results
        futures = {}
        for index, item in enumerate(items):
            try:
                futures[executor.submit(function, item)] = index
            except Exception as err:  # noqa: BLE001 - a broken pool: that item's failure (see _submit)
                finish(index, WorkerFailure(f"the worker process failed ({type(err).__name__}: {err})"))
        try:
            for future in cf.as_completed(futures):
                try:
                    result = future.result()
                except cf.CancelledError:
                    raise
                except Exception as err:  # noqa: BLE001 - BrokenProcessPool, ...
                    result = WorkerFailure(f"the worker process failed ({type(err).__name__}: {err})")
                finish(futures[future], result)
                if stop():
                    break
        finally:
            for future in futures:
                future.cancel()
    return results


@dataclass(frozen=True)
class WorkerFailure:
    """What ``run_each`` gives an item whose worker process died."""

    error: str

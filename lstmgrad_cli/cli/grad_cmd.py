"""``lstmgrad seq`` and ``lstmgrad cell``: gradients of files, a summary table (or JSON) for each."""

from __future__ import annotations

import contextlib
import glob
import signal
import sys
from pathlib import Path

import click

from .. import __version__, io
from ..backends import get_backend, resolve_name
from ..batch import DumpSelection, plan_tasks, run_batch
from ..dask_executor import check_options as check_dask_options
from ..errors import InvalidOptionError, LstmGradError
from ..frameworks import FrameworkOptions
from ..io import npydir
from ..jobs import GradOptions, GradResult
from ..messages import prefixed
from ..perstep import check_plot_path, save_plot
from . import _options as opt
from . import render
from ._common import (
    check_output_extension,
    handle_errors,
    is_terminal,
    one_line,
    print_json,
    progress_bar,
    say,
    silence_closed_stdout,
    stdout_console,
)
from ._words import words

INPUT_SUFFIXES = (".h5", ".hdf5", ".npz")


def _shared_options(kind: str):
    return opt.options(
        click.argument("inputs", nargs=-1, required=True, metavar="INPUT..."),
        click.option("-o", "--output", type=click.Path(path_type=Path),
                     help="Output file (.npz, .h5, .hdf5, .safetensors); only with a single INPUT. "
                          "Default: <input stem>.grads.<input format> beside the input."),
        click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
                     help="Write each output here as <input stem>.grads.<ext> (made, with its parents, when missing)."),
        opt.backend_option(),
        opt.peephole_option(),
        opt.group_option("run"),
        opt.weights_options("an INPUT lacks", ", e.g. weights from a model file, or a tf.function argument a debug "
                                              "dump has no value for"),
        opt.recompute_attribute_options(kind),
        opt.dump_selection_options("run"),
        click.option("--compute-dtype", type=opt.COMPUTE_DTYPES,
                     help="Arithmetic precision. float16 inputs default to float32 (rounded once); "
                          "float16 reproduces TF CPU's per-step half rounding."),
        opt.json_option(),
        opt.quiet_option(),
        opt.force_option(),
        click.option("--keep-going", is_flag=True,
                     help="Report a bad file and go on with the rest (exit 1 at the end)."),
        click.option("--skip-existing", is_flag=True,
                     help="Skip inputs whose output is already complete (resumes an interrupted batch)."),
        click.option("--strict", is_flag=True, help="Treat NaN or Inf in inputs or gradients, and activations that "
                                                    "contradict what was asked or fit nothing, as a failure (exit 1)."),
        click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Process files in N local processes (BLAS threads are divided among them)."),
        click.option("--dask", "dask_address", metavar="ADDRESS",
                     help="Send files to a Dask distributed scheduler (tcp://host:8786); needs lstmgrad[dask]."),
    )


@click.command("seq")
@_shared_options("seq")
@opt.layout_option()
@opt.seq_len_max_option()
@click.option("--chunk-steps", type=click.IntRange(min=1),
              help="Time steps per batched matrix product (default: from a 64 MiB budget).")
@opt.framework_options()
@click.option("--per-step", is_flag=True,
              help="Add the gradient norms of every time step, a chart and the fastest growth/decay in words.")
@click.option("--plot", type=click.Path(path_type=Path),
              help="Save the per-step norms as a figure (PNG, PDF, SVG; needs lstmgrad[plot]); implies --per-step.")
@handle_errors
def seq_command(backend, use_peephole, group, compute_dtype, force, layout, seq_len_max, chunk_steps, per_step, plot,
                weights, weights_group, forget_bias, cell_clip, framework, time_major, batch_first, torch_layer,
                reverse, go_backwards, inference, **flags):
    """BlockLSTMGradV2 or BlockLSTMGrad of each INPUT: the gradient of the op that made its activations;
    or of a Keras LSTM or PyTorch nn.LSTM layer, in that framework's names.

    Each INPUT (HDF5, NPZ, or a directory of .npy files) holds the op's tensors under TF's names:
    x [T,B,I], cs_prev, h_prev [B,C], w [I+C,4C], wci, wcf, wco [C], b [4C], i, cs, f, o, ci, co, h,
    cs_grad, h_grad [T,B,C], and optionally seq_len_max and use_peephole (scalars or HDF5 attributes).

    The gate layout (IFCO: BlockLSTMV2, gradient BlockLSTMGradV2; ICFO: BlockLSTM, gradient BlockLSTMGrad)
    and use_peephole, when not given, are found by recomputing a few gate values from x, h and the
    weights.  A given value the activations contradict is computed as asked, with a warning
    (--strict: an error).  seq_len_max, when not given, is T, or the step from which cs and h are zero
    where the activations show TF stopped there.  Without i, cs, f, o, ci, co, h the forward op is run first.

    Keras: x [B,T,I], kernel, recurrent_kernel, bias, h0, c0, h_grad ([B,T,C] or the last output's
    [B,C]), hn_grad, cn_grad; gives x_grad, kernel_grad, recurrent_kernel_grad, bias_grad, h0_grad,
    c0_grad.  PyTorch: x [T,B,I], weight_ih_lK, weight_hh_lK, bias_ih_lK, bias_hh_lK (_reverse), h0,
    c0, h_grad, hn_grad, cn_grad; gives the same names with _grad.  Weights often come with --weights
    (a Keras .weights.h5 with --weights-group layers/lstm, a state_dict in safetensors with the module
    prefix as --weights-group).
    """
    options = GradOptions("seq", layout, backend, use_peephole, seq_len_max, group, compute_dtype, chunk_steps, force,
                          per_step=per_step or plot is not None, strict=flags.pop("strict"),
                          weights=None if weights is None else str(weights), weights_group=weights_group,
                          forget_bias=forget_bias, cell_clip=cell_clip,
                          framework=FrameworkOptions(framework, time_major, batch_first, torch_layer, reverse,
                                                     go_backwards, inference))
    _run("seq", options, plot=plot, **flags)


@click.command("cell")
@_shared_options("cell")
@handle_errors
def cell_command(backend, use_peephole, group, compute_dtype, force, weights, weights_group, forget_bias, cell_clip,
                 **flags):
    """LSTMBlockCellGrad of each INPUT, plus x_grad, h_prev_grad, w_grad and b_grad.

    Each INPUT (HDF5, NPZ, or a directory of .npy files) holds one step: x [B,I], cs_prev, h_prev [B,C],
    w [I+C,4C], wci, wcf, wco [C], b [4C], i, cs, f, o, ci, co, cs_grad, h_grad [B,C], and optionally
    use_peephole (when absent: what the stored activations fit).  dicfo is in ICFO order.
    """
    options = GradOptions("cell", "icfo", backend, use_peephole, None, group, compute_dtype, None, force,
                          strict=flags.pop("strict"), weights=None if weights is None else str(weights),
                          weights_group=weights_group, forget_bias=forget_bias, cell_clip=cell_clip)
    _run("cell", options, plot=None, **flags)


def expand_inputs(patterns, group: str | None = None) -> list[Path]:
    """Paths as given; quoted glob patterns expanded.  A directory that is itself one input (a directory of .npy
    files, or one whose --group subdirectory is: npydir.sniff_group) stays one; any other directory gives its
    .h5/.hdf5/.npz files and its subdirectories that are inputs."""
    paths: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir() and io.input_directory_format(path) is None and not npydir.sniff_group(path, group):
            paths.extend(sorted(p for p in path.iterdir() if ".grads." not in p.name and (
                (p.suffix.lower() in INPUT_SUFFIXES and p.is_file())
                or (p.is_dir() and io.input_directory_format(p) is not None))))
        elif not path.exists() and glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise click.BadParameter(f"no files match {pattern!r}", param_hint="INPUT")
            paths.extend(Path(m) for m in matches if ".grads." not in Path(m).name)  # not earlier outputs
        else:
            paths.append(path)
    return paths


def _run(command, options: GradOptions, *, inputs, output, out_dir, as_json, quiet, keep_going, skip_existing,
         workers, dask_address, plot, dump_op, dump_execution) -> None:
    if plot is not None and len(inputs) != 1:
        raise click.UsageError("--plot takes a single INPUT")
    paths = expand_inputs(inputs, options.group)
    if output is not None and (len(paths) != 1 or out_dir is not None):
        raise click.UsageError("-o/--output takes a single INPUT and no --out-dir; use --out-dir for several")
    if workers > 1 and dask_address:
        raise click.UsageError("--workers and --dask exclude each other")
    if not paths:
        raise click.UsageError("no input files found")
    check_output_extension(output)
    try:
        get_backend(resolve_name(options.backend))  # an unknown or missing backend fails once, up front
        if dask_address:
            check_dask_options(dask_address)  # a malformed address or timeout, before connecting
    except InvalidOptionError as err:
        raise click.UsageError(one_line(err)) from None
    except LstmGradError as err:
        raise click.ClickException(one_line(err)) from None

    dumps = DumpSelection(command, options.group, dump_op, dump_execution)
    try:
        tasks = plan_tasks(paths, output, out_dir, dumps)
    except LstmGradError as err:
        raise click.UsageError(one_line(err)) from None
    if (dump_op is not None or dump_execution is not None) and not any(
            io.input_directory_format(p) == "tfdbg2" for p in paths):
        raise click.UsageError("--op and --execution choose executions of TensorFlow debug dumps; no INPUT is one")
    if plot is not None:
        _check_plot(plot, tasks, inputs[0], options, output)
    if out_dir is not None:  # made when missing, as batch tools do; only once the options are known to be usable
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise click.ClickException(one_line(f"{out_dir}: cannot create the output directory: "
                                                f"{err.strerror or err}")) from None

    console = None if (quiet or as_json) else stdout_console()  # (nothing is shown on it otherwise)
    show_progress = len(tasks) > 1 and not (quiet or as_json) and is_terminal(sys.stderr)

    stdout_closed: list[bool] = []  # stdout's reader exited (| head): the batch stops, as the pipe's writer would
    with progress_bar(show_progress, len(tasks)) as advance:
        def on_result(task, result: GradResult) -> None:
            source = f"{result.input} [{result.member}]" if result.member else result.input
            for warning in result.warnings:
                click.echo(f"Warning: {one_line(prefixed(source, warning))}", err=True)
            if result.status == "failed":
                click.echo(f"Error: {one_line(result.error)}", err=True)
            with _closed_stdout_noted(stdout_closed):
                if result.status == "ok" and not (as_json or quiet):
                    render.grad_result(console, result)
                elif result.status == "skipped" and result.notes and not (as_json or quiet):  # found complete
                    say(console, f"{source} -> {result.output}: {words(result.notes[0])}")
            if result.status == "ok" and plot is not None and result.per_step is not None:
                try:
                    save_plot(result.per_step, plot, f"{result.op}: {Path(result.input).name}", force=options.force)
                except LstmGradError as err:
                    result.status, result.error = "failed", one_line(err)
                    click.echo(f"Error: {one_line(result.error)}", err=True)
                else:
                    if not (as_json or quiet):
                        with _closed_stdout_noted(stdout_closed):
                            say(console, f"per-step plot: {plot}")
            advance()

        with _interruptible() as received:
            try:
                results = run_batch(tasks, options, workers=workers, dask_address=dask_address,
                                    keep_going=keep_going, skip_existing=skip_existing, on_result=on_result,
                                    stop=lambda: bool(received or stdout_closed))
            except LstmGradError as err:
                raise click.ClickException(one_line(err)) from None
            except KeyboardInterrupt:
                received.append(signal.SIGINT)
        if received:  # 130 for Ctrl-C, 143 for SIGTERM, as shells report them
            click.echo("Aborted!", err=True)
            raise SystemExit(128 + received[0])

    ran = [r for r in results if r is not None]
    counts = {status: sum(r.status == status for r in ran) for status in ("ok", "failed", "skipped", "lost")}
    not_run = len(results) - len(ran)
    done = counts["ok"] + counts["skipped"]
    if stdout_closed and not_run:  # the closed stdout stopped the batch: files are left to do
        click.echo(f"Error: stdout was closed (its reader exited), so the batch stopped: {done} of {len(tasks)} files "
                   f"done, {not_run} not run, every output written is complete; rerun with --skip-existing to finish",
                   err=True)
        raise SystemExit(1)
    with _closed_stdout_noted(stdout_closed):
        if as_json:
            print_json({
                "lstmgrad": __version__, "command": command, "results": [r.to_json() for r in ran],
                "summary": {"done": counts["ok"], "failed": counts["failed"], "skipped": counts["skipped"],
                            "lost": counts["lost"], "not_run": not_run},
            })
        elif len(tasks) > 1 and not quiet:
            render.batch_summary(console, len(tasks), counts, not_run)
    if stdout_closed and not counts["lost"]:  # every file had its turn: nothing stopped, a finished output stays one
        click.echo(f"Warning: stdout was closed (its reader exited) before everything was printed; the run was not "
                   f"stopped: {done} of {len(tasks)} files done, {counts['failed']} failed, every output written is "
                   "complete", err=True)
    if counts["lost"]:
        click.echo(f"Error: {one_line(_lost_message(dask_address, counts, not_run))}", err=True)
    if counts["failed"] or counts["lost"]:
        raise SystemExit(1)


def _check_plot(plot: Path, tasks, first_input: str, options: GradOptions, output: Path | None) -> None:
    """Refuse, before any work, a --plot that cannot be one figure of one file's run, or that would replace a
    file: an existing one without --force, an input, the output."""
    if len(tasks) > 1:
        if all(t.input_format == "tfdbg2" for t in tasks):
            raise click.UsageError(f"--plot draws the figure of a single run, but {first_input} holds {len(tasks)} "
                                   "executions to run; choose one with --group, --op or --execution")
        raise click.UsageError(f"--plot draws the figure of a single run, but {first_input} gives {len(tasks)} files; "
                               "name one file, or use --per-step for a batch (no figure)")
    protected = [t.input for t in tasks] + [t.output for t in tasks]
    if output is not None:
        protected.append(output)
    if options.weights is not None:
        protected.append(Path(options.weights))
    try:
        check_plot_path(plot, options.force, protected)
    except InvalidOptionError as err:
        raise click.BadParameter(one_line(err), param_hint="'--plot'") from None
    except LstmGradError as err:
        raise click.ClickException(one_line(err)) from None


@contextlib.contextmanager
def _closed_stdout_noted(closed: list):
    """What is printed inside it may find stdout closed (``| head``): remembered in ``closed``, and what is still to
    be printed goes nowhere."""
    try:
        yield
    except BrokenPipeError:
        silence_closed_stdout()
        closed.append(True)


def _lost_message(dask_address: str | None, counts: dict, not_run: int) -> str:
    return (f"the Dask cluster at {dask_address} went away before every result came back (the scheduler or a "
            f"connection to it was lost): {counts['ok'] + counts['skipped']} files done, {counts['failed']} failed, "
            f"{counts['lost']} lost (their workers may still write them), {not_run} not run; rerun with "
            "--skip-existing to finish")


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C and SIGTERM unwind as KeyboardInterrupt (temporary files are removed, no partial output
    stays) and are remembered, so a batch stops even if the interrupt lands where Python drops it."""
    received: list[int] = []

    def handler(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread (e.g. embedded): leave signals alone
        yield received
        return
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)



"""``lstmgrad seq`` and ``lstmgrad cell``: gradients of files, a summary table (or JSON) for each."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click

from .. import __version__, io
from ..analysis.perstep import check_plot_path, save_plot
from ..backends import get_backend, resolve_name
from ..errors import ExitCode, InvalidOptionError, LstmGradError
from ..execution import interrupts
from ..execution.dask_executor import check_options as check_dask_options
from ..frameworks import FrameworkOptions
from ..io import tfdbg
from ..io.discovery import Inputs, expand_inputs
from ..messages import prefixed
from ..operations.batch import BatchReport, DumpSelection, Task, plan_tasks, run_batch
from ..operations.grad import GradOptions, GradResult
from ..spec import CELL_LAYOUT
from . import _options as opt
from . import render
from ._common import (
    StdoutError,
    check_output_extension,
    handle_errors,
    is_terminal,
    one_line,
    print_json,
    printable,
    progress_bar,
    say,
    silence_closed_stdout,
    stdout_console,
)
from ._words import words


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
        click.option("-r", "--recursive", is_flag=True,
                     help="Look for inputs in the subfolders of a folder INPUT too (--out-dir mirrors them)."),
        click.option("--strict", is_flag=True, help="Treat NaN or Inf in inputs or gradients, and activations that "
                                                    "contradict what was asked or fit nothing, as a failure (exit 1)."),
        click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Process files in N local processes (BLAS threads are divided among them; with a GPU "
                          "backend each takes one visible CUDA device, in turn)."),
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
    c0_grad.  PyTorch: x [T,B,I] (or unbatched [T,I]), weight_ih_lK, weight_hh_lK, bias_ih_lK,
    bias_hh_lK, weight_hr_lK with proj_size (_reverse), h0, c0, h_grad, hn_grad, cn_grad; gives the
    same names with _grad.  Weights often come with --weights
    (a Keras .weights.h5 with --weights-group layers/lstm, a state_dict in safetensors with the module
    prefix as --weights-group).
    """
    options = GradOptions("seq", layout, backend, use_peephole, seq_len_max, group, compute_dtype, chunk_steps,
                          force=force, per_step=per_step or plot is not None, strict=flags.pop("strict"),
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
    """LSTMBlockCellGrad of each INPUT, plus x_grad, h_prev_grad, w_grad and b_grad; or of one step
    of a PyTorch nn.LSTMCell or Keras LSTMCell, in that framework's names.

    Each INPUT (HDF5, NPZ, or a directory of .npy files) holds one step: x [B,I], cs_prev, h_prev [B,C],
    w [I+C,4C], wci, wcf, wco [C], b [4C], i, cs, f, o, ci, co, cs_grad, h_grad [B,C], and optionally
    use_peephole (when absent: what the stored activations fit).  dicfo is in ICFO order.

    A cell's step, h1, c1 = cell(x, (h0, c0)): x [B,I] (PyTorch also [I]), h0, c0 [B,C] (zeros when
    absent), h1_grad and/or c1_grad (the gradients at h1 and c1), and the cell's weights (PyTorch:
    weight_ih, weight_hh, bias_ih, bias_hh, a state_dict with its prefix as --weights-group; Keras:
    kernel, recurrent_kernel, bias, a weights file with the cell's group); gives x_grad, the weights'
    names with _grad, h0_grad, c0_grad.
    """
    options = GradOptions("cell", CELL_LAYOUT, backend, use_peephole, None, group, compute_dtype, None, force=force,
                          strict=flags.pop("strict"), weights=None if weights is None else str(weights),
                          weights_group=weights_group, forget_bias=forget_bias, cell_clip=cell_clip)
    _run("cell", options, plot=None, **flags)


def _no_inputs_message(inputs: Inputs, recursive: bool) -> str:
    if inputs.only_subfolders and not recursive:
        folders = ", ".join(printable(p) for p in inputs.only_subfolders[:3])
        return f"no input files found: {folders} holds only subfolders; --recursive looks for inputs in them"
    return "no input files found"


def _run(command, options: GradOptions, *, inputs, output, out_dir, as_json, quiet, keep_going, skip_existing,
         recursive, workers, dask_address, plot, dump_op, dump_execution) -> None:
    if plot is not None and len(inputs) != 1:
        raise click.UsageError("--plot takes a single INPUT")
    try:
        found = expand_inputs(inputs, options.group, recursive, exclude=(options.weights, out_dir))
    except InvalidOptionError as err:
        raise click.BadParameter(one_line(err), param_hint="INPUT") from None
    paths = found.paths
    if output is not None and (len(paths) != 1 or out_dir is not None):
        raise click.UsageError("-o/--output takes a single INPUT and no --out-dir; use --out-dir for several")
    if workers > 1 and dask_address is not None:
        raise click.UsageError("--workers and --dask exclude each other")
    if not paths:
        raise click.UsageError(_no_inputs_message(found, recursive))
    check_output_extension(output)
    try:
        get_backend(resolve_name(options.backend))  # an unknown or missing backend fails once, up front
        if dask_address is not None:  # a malformed address or timeout, before connecting (host:port is tcp://)
            dask_address, _timeout = check_dask_options(dask_address)
    except InvalidOptionError as err:
        raise click.UsageError(one_line(err)) from None
    except LstmGradError as err:
        raise click.ClickException(one_line(err)) from None

    dumps = DumpSelection(command, options.group, dump_op, dump_execution)
    try:
        tasks = plan_tasks(paths, output, out_dir, dumps, found.subdirs)
    except LstmGradError as err:
        raise click.UsageError(one_line(err, paths)) from None
    if (dump_op is not None or dump_execution is not None) and not any(
            io.input_directory_format(p) == "tfdbg2" for p in paths):
        raise click.UsageError("--op and --execution choose executions of TensorFlow debug dumps; no INPUT is one")
    if plot is not None:
        _check_plot(plot, tasks, inputs[0], options, output)
    warnings = _dump_warnings(tasks)
    for warning in warnings:
        click.echo(f"Warning: {one_line(warning, paths)}", err=True)
    if out_dir is not None:  # made when missing, as batch tools do; only once the options are known to be usable
        for folder in dict.fromkeys(t.output.parent for t in tasks):  # (--recursive: the tree of the inputs)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise click.ClickException(one_line(f"{folder}: cannot create the output directory: "
                                                    f"{err.strerror or err}", [folder])) from None

    console = None if (quiet or as_json) else stdout_console()  # (nothing is shown on it otherwise)
    show_progress = len(tasks) > 1 and not (quiet or as_json) and is_terminal(sys.stderr)
    # stdout's reader exited (| head), or stdout cannot be written (a full disk): the batch stops, as the pipe's
    # writer would; what went wrong (BrokenPipeError, StdoutError)
    stdout_failed: list[OSError] = []
    reported: dict[Task, GradResult] = {}

    def on_result(task, result: GradResult) -> None:
        reported[task] = result  # (first: an interrupt while it is printed still reports it)
        with interrupts.interruptible():  # a stop signal interrupts printing to a stdout nobody reads
            _show_result(result, task, options, console, as_json, quiet, plot, stdout_failed)
            advance()

    # A stop signal interrupts the run where that is safe (execution/interrupts.py); the batch then stops, and what ran
    # is reported: every output written, in the closing table and the --json document.
    with interrupts.deferred():
        with progress_bar(show_progress, len(tasks)) as advance:
            try:
                run_batch(tasks, options, workers=workers, dask_address=dask_address, keep_going=keep_going,
                          skip_existing=skip_existing, on_result=on_result,
                          stop=lambda: interrupts.requested() or bool(stdout_failed))
            except LstmGradError as err:
                raise click.ClickException(one_line(err, paths)) from None
            except KeyboardInterrupt:
                pass
        # Printed whatever comes now: a second signal interrupts it (a stdout nobody reads).
        with interrupts.interruptible(new_only=True):
            _report(command, tasks, [reported.get(t) for t in tasks], interrupts.received(), console, as_json, quiet,
                    dask_address, stdout_failed, warnings)


def _show_result(result: GradResult, task, options: GradOptions, console, as_json: bool, quiet: bool, plot,
                 stdout_failed: list) -> None:
    """One file's result as it comes: its warnings and error on stderr, its table on stdout; its --plot."""
    source = f"{result.input} [{result.member}]" if result.member else result.input
    names = (result.input, result.output, task.output, options.weights)
    for warning in result.warnings:
        click.echo(f"Warning: {one_line(prefixed(source, warning), names)}", err=True)
    if result.status == "failed":
        click.echo(f"Error: {one_line(result.error, names)}", err=True)
    with _stdout_failure_noted(stdout_failed):
        if result.status == "ok" and not (as_json or quiet):
            render.grad_result(console, result)
        elif result.status == "skipped" and result.notes and not (as_json or quiet):  # found complete
            say(console, f"{source} -> {result.output}: {words(result.notes[0])}")
    if result.status == "ok" and plot is not None and result.per_step is not None:
        try:
            save_plot(result.per_step, plot, f"{result.op}: {Path(result.input).name}", force=options.force)
        except LstmGradError as err:
            result.status, result.error = "failed", one_line(err, (*names, plot))
            click.echo(f"Error: {result.error}", err=True)
        else:
            if not (as_json or quiet):
                with _stdout_failure_noted(stdout_failed):
                    say(console, f"per-step plot: {plot}")


def _dump_warnings(tasks) -> list[str]:
    """What the TensorFlow debug dumps among the inputs say of themselves (a circular buffer that dropped
    records: tfdbg.DumpIndex.dropped), once per dump."""
    said = []
    for path in dict.fromkeys(t.input for t in tasks if t.input_format == "tfdbg2"):
        try:
            dropped = tfdbg.index_dump(path).dropped  # (indexed already while planning: cached)
        except LstmGradError:  # its own failure, reported when its turn comes
            continue
        if dropped:
            said.append(f"{path}: {dropped}")
    return said


def _report(command: str, tasks, results: list, signals: list[int], console, as_json: bool, quiet: bool,
            dask_address, stdout_failed: list, warnings: list[str]) -> None:
    """The end of a batch: the closing table (or the --json document), what stopped it on stderr; its exit."""
    report = BatchReport(results, signals)
    counts, done, total = report.counts, report.done, len(tasks)
    if stdout_failed and counts["not_run"] and not report.interrupted:  # the stdout that failed stopped the batch
        cause = _stdout_cause(stdout_failed[0])
        click.echo(f"Error: {cause}, so the batch stopped: {done} of {total} files done, {counts['not_run']} not run, "
                   "every output written is complete; rerun with --skip-existing to finish", err=True)
        raise SystemExit(ExitCode.ERROR)
    with _stdout_failure_noted(stdout_failed):
        if as_json:
            print_json({"lstmgrad": __version__, "command": command,
                        "results": [r.to_json() for r in results if r is not None], "summary": report.summary(),
                        "interrupted": report.interrupted, "warnings": warnings})
        elif total > 1 and not quiet:
            render.batch_summary(console, total, counts, counts["not_run"])
    if quiet and total > 1 and report.exit_code != ExitCode.SUCCESS:
        # -q prints nothing on success; counts that say something went wrong still reach stderr
        lost = f", {counts['lost']} lost" if counts["lost"] else ""
        click.echo(f"batch: {total} files, {counts['ok']} done, {counts['failed']} failed, "
                   f"{counts['skipped']} skipped{lost}, {counts['not_run']} not run", err=True)
    if report.interrupted:
        click.echo(f"Interrupted ({report.interrupted}): {done} of {total} files done, {counts['failed']} failed, "
                   f"{counts['not_run']} not run; every output written is complete and reported; rerun with "
                   "--skip-existing to finish", err=True)
        raise SystemExit(report.exit_code)
    closed = bool(stdout_failed) and isinstance(stdout_failed[0], BrokenPipeError)
    if closed and not counts["lost"]:  # every file had its turn: nothing stopped, a finished output stays one
        click.echo(f"Warning: stdout was closed (its reader exited) before everything was printed; the run was not "
                   f"stopped: {done} of {total} files done, {counts['failed']} failed, every output written is "
                   "complete", err=True)
    elif stdout_failed and not counts["lost"]:
        click.echo(f"Error: {_stdout_cause(stdout_failed[0])}; the run was not stopped: {done} of {total} files "
                   f"done, {counts['failed']} failed, every output written is complete", err=True)
    if counts["lost"]:
        click.echo(f"Error: {one_line(_lost_message(dask_address, counts, counts['not_run']))}", err=True)
    if report.exit_code != ExitCode.SUCCESS or (stdout_failed and not closed):
        raise SystemExit(max(report.exit_code, ExitCode.ERROR))


def _stdout_cause(err: OSError) -> str:
    if isinstance(err, BrokenPipeError):
        return "stdout was closed (its reader exited)"
    return str(err)


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
def _stdout_failure_noted(failed: list):
    """What is printed inside it may find stdout closed (``| head``) or unwritable (a full disk): the error is
    remembered in ``failed``, and what is still to be printed goes nowhere."""
    try:
        yield
    except (BrokenPipeError, StdoutError) as err:
        silence_closed_stdout()
        failed.append(err)


def _lost_message(dask_address: str | None, counts: dict, not_run: int) -> str:
    return (f"the Dask cluster at {dask_address} went away before every result came back (the scheduler, the "
            f"connection to it or every worker was lost): {counts['ok'] + counts['skipped']} files done, "
            f"{counts['failed']} failed, "
            f"{counts['lost']} lost (their workers may still write them), {not_run} not run; rerun with "
            "--skip-existing to finish")

"""``lstmgrad seq`` and ``lstmgrad cell``: gradients of files, a summary table (or JSON) for each."""

from __future__ import annotations

import contextlib
import glob
import math
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
from ..perstep import ASCII_SPARK, SPARK, check_plot_path, save_plot, sparkline
from ._common import (
    check_output_extension,
    handle_errors,
    is_terminal,
    new_table,
    one_line,
    plain,
    print_json,
    print_table,
    progress_bar,
    say,
    separator,
    silence_closed_stdout,
    stdout_console,
    unicode_console,
)
from ._words import words

INPUT_SUFFIXES = (".h5", ".hdf5", ".npz")
# How the summary says where a parameter came from.
FRAMEWORK_WORDS = {"keras": "Keras LSTM layer", "torch": "PyTorch nn.LSTM layer"}
SOURCE_WORDS = {"activations": "found from the activations", "flag": "as asked", "default": "default",
                "dump": "the forward op recorded in the dump"}


# The forward op's defaults of --forget-bias and --cell-clip, as each command's help says them.
FORWARD_DEFAULT_WORDS = {
    "seq": ("the file's, else the op's: BlockLSTM 1, BlockLSTMV2 none",
            "the file's, else the op's: 3 for BlockLSTM, 0 for BlockLSTMV2"),
    "cell": ("the file's, else LSTMBlockCell's 1", "the file's, else LSTMBlockCell's 3"),
}


def _shared_options(kind: str):
    forget_bias_default, cell_clip_default = FORWARD_DEFAULT_WORDS[kind]
    options = [
        click.argument("inputs", nargs=-1, required=True, metavar="INPUT..."),
        click.option("-o", "--output", type=click.Path(path_type=Path),
                     help="Output file (.npz, .h5, .hdf5, .safetensors); only with a single INPUT. "
                          "Default: <input stem>.grads.<input format> beside the input."),
        click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path),
                     help="Write each output here as <input stem>.grads.<ext> (made, with its parents, when missing)."),
        click.option("--backend", metavar="NAME", help="Compute backend (env LSTMGRAD_BACKEND; default numpy; "
                                                       "'auto' picks the fastest usable). See `lstmgrad backends`."),
        click.option("--peephole/--no-peephole", "use_peephole", default=None,
                     help="Override use_peephole (default: from the file, else what the stored activations "
                          "fit, else off)."),
        click.option("--group", metavar="PATH", help="HDF5 group (NPZ key prefix, subdirectory) holding the tensors; "
                                                     "in a TensorFlow debug dump, the execution to run."),
        click.option("--weights", type=click.Path(path_type=Path), metavar="FILE",
                     help="Read the tensors an INPUT lacks from FILE (any input format), e.g. weights from a model "
                          "file, or a tf.function argument a debug dump has no value for. INPUT's win."),
        click.option("--weights-group", metavar="PATH", help="Group (key prefix, subdirectory) of --weights."),
        click.option("--forget-bias", type=float,
                     help="When INPUT has no forward outputs (i, cs, f, ... are recomputed): the forward op's "
                          f"forget_bias (default: {forget_bias_default})."),
        click.option("--cell-clip", type=float,
                     help="When the forward outputs are recomputed: the forward op's cell_clip, <= 0 for none "
                          f"(default: {cell_clip_default})."),
        click.option("--op", "dump_op", metavar="NAME",
                     help="TensorFlow debug dumps: run the executions of this op (name or type) only."),
        click.option("--execution", "dump_execution", type=int, metavar="K",
                     help="TensorFlow debug dumps: run the K-th execution of each op only (0 first, -1 last)."),
        click.option("--compute-dtype", type=click.Choice(["float16", "float32", "float64"]),
                     help="Arithmetic precision. float16 inputs default to float32 (rounded once); "
                          "float16 reproduces TF CPU's per-step half rounding."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables."),
        click.option("-q", "--quiet", is_flag=True, help="Print nothing on success."),
        click.option("--force", is_flag=True, help="Overwrite existing output files."),
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
    ]

    def decorate(func):
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


@click.command("seq")
@_shared_options("seq")
@click.option("--layout", type=click.Choice(["ifco", "icfo"]),
              help="Gate layout: ifco = BlockLSTMGradV2, icfo = BlockLSTMGrad (V1).  Default: the layout the "
                   "stored activations fit, else ifco.")
@click.option("--seq-len-max", type=click.IntRange(min=0),
              help="Override seq_len_max (default: from the file, else T).")
@click.option("--chunk-steps", type=click.IntRange(min=1),
              help="Time steps per batched matrix product (default: from a 64 MiB budget).")
@click.option("--framework", type=click.Choice(["keras", "torch", "tf"]),
              help="Whose names INPUT uses: a Keras LSTM layer's (x, kernel, recurrent_kernel, bias, ...), a PyTorch "
                   "nn.LSTM's (weight_ih_l0, ...), or the TF op's (default: told from the names).")
@click.option("--time-major", is_flag=True, help="Keras: x and h_grad are [T, B, ...] (time_major=True).")
@click.option("--batch-first", is_flag=True, help="PyTorch: x and h_grad are [B, T, ...] (batch_first=True).")
@click.option("--layer", "torch_layer", type=click.IntRange(min=0), default=0, show_default=True,
              help="PyTorch: the layer K whose weights (weight_ih_lK, ...) to use.")
@click.option("--reverse", is_flag=True, help="The backward direction of a bidirectional LSTM, h_grad in x's time "
                                              "order (PyTorch: the weights with _reverse; Keras: a Bidirectional's "
                                              "backward_layer).")
@click.option("--go-backwards", is_flag=True, help="Keras: a layer made with go_backwards=True (h_grad as it returns "
                                                   "its outputs, from x's last step).")
@click.option("--per-step", is_flag=True,
              help="Add the gradient norms of every time step, a chart and the fastest growth/decay in words.")
@click.option("--plot", type=click.Path(path_type=Path),
              help="Save the per-step norms as a figure (PNG, PDF, SVG; needs lstmgrad[plot]); implies --per-step.")
@handle_errors
def seq_command(backend, use_peephole, group, compute_dtype, force, layout, seq_len_max, chunk_steps, per_step, plot,
                weights, weights_group, forget_bias, cell_clip, framework, time_major, batch_first, torch_layer,
                reverse, go_backwards, **flags):
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
                                                     go_backwards))
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
                    render(console, result)
                elif result.status == "skipped" and result.notes and not (as_json or quiet):  # found complete
                    say(console, f"{source} -> {result.output}: {words(result.notes[0])}")
            if result.status == "ok" and plot is not None and result.per_step is not None:
                try:
                    save_plot(result.per_step, plot, f"{result.op}: {Path(result.input).name}")
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
            columns = {"files": len(tasks), "done": counts["ok"], "failed": counts["failed"],
                       "skipped": counts["skipped"], "lost": counts["lost"], "not run": not_run}
            if not counts["lost"]:  # only a lost Dask scheduler loses files
                del columns["lost"]
            table = new_table()
            for col in columns:
                table.add_column(col, justify="right")
            table.add_row(*map(str, columns.values()))
            print_table(console, table, "batch")
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


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def render(console, result: GradResult) -> None:
    """The rich summary of one run: a header line of what was computed, a row per output tensor."""
    table = new_table()
    for name, justify in (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("L2 norm", "right"),
                          ("max |value|", "right"), ("finite", "center")):
        table.add_column(name, justify=justify)
    source = f"{result.input} [{result.member}]" if result.member else result.input
    for t in result.tensors:
        finite = "yes" if t.finite else f"[bold red]no ({t.nonfinite})[/]"
        table.add_row(plain(t.name), "[" + ", ".join(map(str, t.shape)) + "]", t.dtype, _fmt(t.l2_norm),
                      _fmt(t.max_abs), finite)
    dims = result.dims or {}
    shape = ", ".join(f"{k}={v}" for k, v in dims.items() if not (k == "T" and result.seq_len_max is None))
    layout = f"layout {result.layout}"
    if result.sources.get("layout") in SOURCE_WORDS:
        layout += f", {SOURCE_WORDS[result.sources['layout']]}"
    what = [f"{result.op} ({layout})", f"backend {result.backend} {result.backend_version or ''}".strip(),
            f"{result.dtype} (computed in {result.compute_dtype})", f"{result.seconds:.3f} s"]
    peephole = result.sources.get("use_peephole")
    how = [shape, f"use_peephole={str(result.use_peephole).lower()} ({SOURCE_WORDS.get(peephole, peephole)})"]
    if result.seq_len_max is not None:
        origin = result.sources.get("seq_len_max")
        how.append(f"seq_len_max={result.seq_len_max} ({SOURCE_WORDS.get(origin, origin)})")
    if result.framework:  # a Keras or PyTorch layer: the op is how it is computed, not what the user gave
        what[0] = f"{FRAMEWORK_WORDS[result.framework]}, computed as {result.op} of the recomputed BlockLSTMV2"
        how = [shape]
    print_table(console, table, f"{source} -> {result.output}")
    say(console, separator(console).join(what))
    say(console, separator(console).join(how))
    for note in result.notes:
        say(console, f"note: {words(note)}")
    for note in result.defaults:
        say(console, f"default used: {words(note)}", style="dim")
    if result.per_step is not None:
        render_per_step(console, result.per_step)


def render_per_step(console, report: dict) -> None:
    """Per-step norms as sparklines (log scale, step 0 on the left) and the growth/decay in words."""
    names = {"x_grad": "|x_grad[t]|", "h_prev_grad": "|dh carried|", "cs_prev_grad": "|dcs carried|",
             "last_step": "|last-step grad at t|"}
    width = max(10, min(80, console.width - 40))
    table = new_table(show_header=True)
    for col, justify in (("norm", "left"), ("chart", "left"), ("min", "right"), ("max", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for key, values in report["norms"].items():
        finite = [v for v in values if math.isfinite(v)]
        table.add_row(plain(names[key]), sparkline(values, width, SPARK if unicode_console(console) else ASCII_SPARK),
                      _fmt(min(finite) if finite else None),
                      _fmt(max(finite) if finite else None))
    print_table(console, table, f"gradients through time ({report['steps']} steps, log scale, step 0 on the left)")
    for line in report["summary"]:
        say(console, line)

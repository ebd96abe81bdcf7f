"""The ``lstmgrad`` command line: a thin click layer over the library.

Each command lives in its own module, imported only when that command runs (so ``lstmgrad seq``
does not pay for the debugging commands' imports).  Library errors become ``Error: ...`` and exit 1
in one place (``_common.handle_errors``); usage errors exit 2.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import signal
import sys
import warnings

import click

from .. import __version__
from ..errors import ExitCode
from ..execution import interrupts
from ..execution.allocator import keep_heap_top
from ._common import (
    StdoutError,
    documents,
    error_document,
    one_line,
    print_json,
    silence_closed_stdout,
    tolerate_unencodable_output,
)

# command name -> "module:attribute", in the order `lstmgrad --help` lists them
COMMANDS = {
    "seq": "grad_cmd:seq_command",
    "cell": "grad_cmd:cell_command",
    "forward": "forward_cmd:forward_command",
    "check": "check_cmd:check_command",
    "inspect": "inspect_cmd:inspect_command",
    "backends": "backends_cmd:backends_command",
    "bench": "bench_cmd:bench_command",
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use, and whose invocation ends as ``run_command`` says."""

    own_process = False  # invoked as the command line's own process (not by another program: CliRunner)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        self.own_process = args is None
        if self.own_process:
            gc.disable()  # until the command's modules are imported (get_command): ~70 collections, ~10 ms
        # The command line's own process keeps its handlers to the end (a signal as it exits is no traceback);
        # an invocation inside another program (CliRunner) gives them back.
        with interrupts.caught(restore=args is not None), interrupts.interruptible():
            code = run_command(lambda: super(LazyGroup, self).main(argv, prog_name, complete_var,
                                                                    standalone_mode=False, **extra), argv)
        sys.exit(code)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        command = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        if self.own_process:
            # What is imported stays to the end of the process: the collector need not walk it again, nor at exit,
            # where that walk took 25-34 ms of a one-file run's 0.2 s.  Only in the command line's own process: in
            # another program (CliRunner) it would keep that program's garbage too.
            gc.freeze()
            gc.enable()
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="lstmgrad")
def main() -> None:
    """TensorFlow's block-LSTM gradients from saved forward-pass tensors, without TensorFlow.

    \b
    lstmgrad seq run.h5 -o grads.h5     the gradient of the op that made the activations
                                        (BlockLSTMGradV2 or BlockLSTMGrad; Keras, PyTorch layers)
    lstmgrad cell step.npz              LSTMBlockCellGrad (+ x, h_prev, w and b gradients)
    lstmgrad inspect dump.h5            what a file or TF debug dump holds, what is wrong with it
    lstmgrad check dump.h5 -r ref.npz   compare with reference gradients, explain differences
    lstmgrad check tfdbg_dump/          recompute every gradient TF recorded in a debug dump
    lstmgrad backends                   compute backends and whether they are usable
    """
    warnings.showwarning = _warning_on_one_line
    tolerate_unencodable_output()
    keep_heap_top()  # lstmgrad's own process: files one after another reuse the same heap (execution/allocator.py)


def _warning_on_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Library warnings (a broken backend plugin, an unknown LSTMGRAD_BLAS) as ``Warning: ...`` lines."""
    click.echo(f"Warning: {one_line(message)}", err=True)


def run_command(invoke, argv: list[str]) -> int:
    """Run a command line (``invoke``: click's main, not standalone) and say how it ended: its exit status, after
    one line on stderr for an error, and with ``--json`` one JSON document on stdout whatever happened (the
    command's own, or one holding the error).

    Ctrl-C and SIGTERM (execution/interrupts.py: they interrupt the command where that is safe) end it with 130 or
    143, as shells report them.  A stdout that cannot be written (a full disk; ``--help > /dev/full``) is one line and
    exit 1, never a traceback; one whose reader exited is told by the command (exit 1 here)."""
    documents.printed = False
    error: str | None = None
    try:
        code = invoke()
        code = code if isinstance(code, int) else 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (ExitCode.SUCCESS if stop.code is None else ExitCode.ERROR)
    except click.ClickException as err:
        code, error = err.exit_code, err.format_message()
        _json_error(argv, one_line(error), code)
        with contextlib.suppress(OSError):
            err.show()
    except (click.Abort, KeyboardInterrupt):
        signum = (interrupts.received() or [signal.SIGINT])[0]
        code, what = ExitCode.signalled(signum), signal.Signals(signum).name
        _json_error(argv, f"interrupted ({what})", code)
        _say_on_stderr("Aborted!")
    except BrokenPipeError:
        silence_closed_stdout()
        code = ExitCode.ERROR
    except OSError as err:  # what click printed itself (--help, --version) could not be written
        code = ExitCode.ERROR
        _stdout_failed(StdoutError(err.errno, err.strerror))
    try:
        sys.stdout.flush()  # (what is left of it, here rather than as the interpreter exits)
    except BrokenPipeError:
        silence_closed_stdout()
    except OSError as err:
        code = code or ExitCode.ERROR
        _stdout_failed(StdoutError(err.errno, err.strerror))
    return code


def _stdout_failed(err: StdoutError) -> None:
    silence_closed_stdout()
    _say_on_stderr(f"Error: {err}")


def _say_on_stderr(text: str) -> None:
    with contextlib.suppress(OSError):
        click.echo(text, err=True)


def _json_error(argv: list[str], error: str, code: int) -> None:
    """With ``--json``, the error document, unless the command printed its own."""
    options = argv[:argv.index("--")] if "--" in argv else argv
    if "--json" not in options or documents.printed:
        return
    command = next((arg for arg in options if arg in COMMANDS), None)
    with contextlib.suppress(OSError):
        print_json(error_document(command, error, code))

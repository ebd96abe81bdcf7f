"""The ``lstmgrad`` command line: a thin click layer over the library.

Each command lives in its own module, imported only when that command runs (so ``lstmgrad seq``
does not pay for the debugging commands' imports).  Library errors become ``Error: ...`` and exit 1
in one place (``_common.handle_errors``); usage errors exit 2.
"""

from __future__ import annotations

import importlib
import warnings

import click

from .. import __version__
from ..allocator import keep_heap_top
from ._common import one_line, tolerate_unencodable_output

# command name -> "module:attribute", in the order `lstmgrad --help` lists them
COMMANDS = {
    "seq": "grad_cmd:seq_command",
    "cell": "grad_cmd:cell_command",
    "forward": "debug_cmd:forward_command",
    "check": "debug_cmd:check_command",
    "inspect": "debug_cmd:inspect_command",
    "backends": "backends_cmd:backends_command",
    "bench": "bench_cmd:bench_command",
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


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
    keep_heap_top()  # this process is lstmgrad's own: files one after another reuse the same heap (allocator.py)


def _warning_on_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    """Library warnings (a broken backend plugin, an unknown LSTMGRAD_BLAS) as ``Warning: ...`` lines."""
    click.echo(f"Warning: {one_line(message)}", err=True)

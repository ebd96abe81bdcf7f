"""The ``lstmgrad`` command line: a thin click layer over the library.

Each command lives in its own module; this one builds the group.  Library errors become
``Error: ...`` and exit 1 in one place (``_common.handle_errors``); usage errors exit 2.
"""

from __future__ import annotations

import click

from .. import __version__
from .backends_cmd import backends_command
from .bench_cmd import bench_command
from .debug_cmd import check_command, forward_command, inspect_command
from .grad_cmd import cell_command, seq_command


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="lstmgrad")
def main() -> None:
    """TensorFlow's block-LSTM gradients from saved forward-pass tensors, without TensorFlow.

    \b
    lstmgrad seq run.h5 -o grads.h5     BlockLSTMGradV2 (IFCO; --layout icfo: BlockLSTMGrad)
    lstmgrad cell step.npz              LSTMBlockCellGrad (+ x, h_prev, w and b gradients)
    lstmgrad backends                   compute backends and whether they are usable
    """


main.add_command(seq_command)
main.add_command(cell_command)
main.add_command(forward_command)
main.add_command(check_command)
main.add_command(inspect_command)
main.add_command(backends_command)
main.add_command(bench_command)

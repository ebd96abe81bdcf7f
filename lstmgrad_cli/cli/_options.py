"""Options more than one command takes, defined once (as pip's cmdoptions and sqlite-utils' shared decorators do).

Each function returns a decorator; ``options(...)`` stacks several in the order ``--help`` lists them.  Where
commands take an option for different purposes, the function takes the words that differ.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..spec import FORWARD_DEFAULTS, LAYOUTS, forward_op_name

COMPUTE_DTYPES = click.Choice(["float16", "float32", "float64"])
LAYOUT_CHOICE = click.Choice(list(LAYOUTS))
# The gradient ops each --layout value computes, and the forward ops.
GRADIENT_LAYOUTS = "ifco = BlockLSTMGradV2, icfo = BlockLSTMGrad (V1)"
FORWARD_LAYOUTS = "ifco = BlockLSTMV2, icfo = BlockLSTM (V1)"


def options(*decorators):
    """One decorator applying ``decorators`` so that ``--help`` lists them in the order given."""
    def decorate(func):
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return decorate


def backend_option():
    return click.option("--backend", metavar="NAME", help="Compute backend (env LSTMGRAD_BACKEND; default numpy; "
                                                          "'auto' picks the fastest usable). See `lstmgrad backends`.")


def recompute_attribute_options(kind: str):
    """--forget-bias and --cell-clip of the gradient commands: the forward op's attributes, for an input whose
    forward outputs are recomputed (the file's, else the op's)."""
    forget_bias, cell_clip = forward_default_words(kind, from_file=True)
    return options(
        click.option("--forget-bias", type=float,
                     help="When INPUT has no forward outputs (i, cs, f, ... are recomputed): the forward op's "
                          f"forget_bias (default: {forget_bias})."),
        click.option("--cell-clip", type=float,
                     help="When the forward outputs are recomputed: the forward op's cell_clip, <= 0 for none "
                          f"(default: {cell_clip})."),
    )


def json_option(shown: str = "tables"):
    return click.option("--json", "as_json", is_flag=True, help=f"Print one JSON document instead of {shown}.")


def quiet_option():
    return click.option("-q", "--quiet", is_flag=True, help="Print nothing on success.")


def force_option(what: str = "existing output files"):
    return click.option("--force", is_flag=True, help=f"Overwrite {what}.")


def peephole_option(help: str = "Override use_peephole (default: from the file, else what the stored activations "
                                "fit, else off)."):
    return click.option("--peephole/--no-peephole", "use_peephole", default=None, help=help)


def layout_option(what: str = "Gate layout"):
    return click.option("--layout", type=LAYOUT_CHOICE,
                        help=f"{what}: {GRADIENT_LAYOUTS}.  Default: the layout the stored activations fit, else "
                             "ifco.")


def seq_len_max_option():
    return click.option("--seq-len-max", type=click.IntRange(min=0),
                        help="Override seq_len_max (default: from the file, else where the stored cs and h show "
                             "TF stopped, else T).")


def group_option(dump_use: str | None = "run", extra: str = ""):
    """The group of the input; in a TensorFlow debug dump, the execution the command ``dump_use``s."""
    dump = f"; in a TensorFlow debug dump, the execution to {dump_use}" if dump_use else ""
    return click.option("--group", metavar="PATH",
                        help=f"HDF5 group (NPZ key prefix, subdirectory) holding the tensors{dump}{extra}.")


def weights_options(lacks: str = "an INPUT lacks", examples: str = ""):
    return options(
        click.option("--weights", type=click.Path(path_type=Path), metavar="FILE",
                     help=f"Read the tensors {lacks} from FILE (any input format){examples}. INPUT's win."),
        click.option("--weights-group", metavar="PATH", help="Group (key prefix, subdirectory) of --weights."),
    )


def dump_selection_options(verb: str = "run"):
    """--op and --execution: which executions of a TensorFlow debug dump the command ``verb``s."""
    return options(
        click.option("--op", "dump_op", metavar="NAME",
                     help=f"TensorFlow debug dumps: {verb} the executions of this op (name or type) only."),
        click.option("--execution", "dump_execution", type=int, metavar="K",
                     help=f"TensorFlow debug dumps: {verb} the K-th execution of each op only (0 first, -1 last)."),
    )


def framework_options(whose: str = "INPUT uses"):
    """Whose names the tensors are in (Keras', PyTorch's, TF's) and how that framework laid them out."""
    return options(
        click.option("--framework", type=click.Choice(["keras", "torch", "tf"]),
                     help=f"Whose names {whose}: a Keras LSTM layer's (x, kernel, recurrent_kernel, bias, ...), a "
                          "PyTorch nn.LSTM's (weight_ih_l0, ...), or the TF op's (default: told from the names)."),
        click.option("--time-major", is_flag=True, help="Keras: x and h_grad are [T, B, ...] (time_major=True)."),
        click.option("--batch-first", is_flag=True, help="PyTorch: x and h_grad are [B, T, ...] (batch_first=True)."),
        click.option("--layer", "torch_layer", type=click.IntRange(min=0),
                     help="PyTorch: only the layer K (weight_ih_lK, ...), its own input as x and its output's "
                          "gradient as h_grad (default: the whole module, every layer and direction)."),
        click.option("--reverse", is_flag=True, help="The backward direction of a bidirectional LSTM, h_grad in x's "
                                                     "time order (PyTorch: the weights with _reverse; Keras: a "
                                                     "Bidirectional's backward_layer)."),
        click.option("--go-backwards", is_flag=True, help="Keras: a layer made with go_backwards=True (h_grad as it "
                                                          "returns its outputs, from x's last step)."),
        click.option("--inference", is_flag=True, help="Keras: the gradient was taken with training=False, where a "
                                                       "layer's dropout does nothing (a layer with dropout is refused "
                                                       "otherwise)."),
    )


def forward_default_words(kind: str, from_file: bool) -> tuple[str, str]:
    """What --forget-bias and --cell-clip default to, in words, from the forward ops' defaults (spec.py);
    ``from_file``: a value the input holds comes first."""
    first = "the file's, else " if from_file else ""
    if kind == "cell":
        forget_bias, cell_clip = FORWARD_DEFAULTS[forward_op_name("cell", None)]
        return f"{first}LSTMBlockCell's {forget_bias:g}", f"{first}LSTMBlockCell's {cell_clip:g}"
    v2_clip, (v1_fb, v1_clip) = FORWARD_DEFAULTS["BlockLSTMV2"][1], FORWARD_DEFAULTS["BlockLSTM"]
    return (f"{first}the op's: {v1_fb:g} for BlockLSTM (--layout icfo); BlockLSTMV2 has none",
            f"{first}the op's: {v1_clip:g} for BlockLSTM (--layout icfo), {v2_clip:g} for BlockLSTMV2")

"""What an input's names say: whose tensors they are (the TF op's own, a Keras layer's, a PyTorch nn.LSTM's, a
framework cell step's), and every name each may keep a tensor under.

Names only: no tensor is looked at and nothing is computed, so that reading the TF op's own tensors needs none of
the frameworks' other modules (``frameworks/__init__.py`` loads them on first use: with the layer engine they were
~13 ms of every command's start).  keras.py, pytorch.py and cells.py give these under their own names too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidArgumentError
from ..messages import Message, Param

FRAMEWORKS = ("keras", "torch")


@dataclass(frozen=True)
class FrameworkOptions:
    framework: str | None = None  # "keras" | "torch" | "tf" (the op's own names) | None: from the names
    time_major: bool = False  # Keras: x and h_grad are [T, B, ...]
    batch_first: bool = False  # PyTorch: x and h_grad are [B, T, ...]
    layer: int | None = None  # PyTorch: one layer's weights (the K of weight_ih_l{K}); None: the whole module
    reverse: bool = False  # the backward direction of a bidirectional LSTM (h_grad in x's time order)
    go_backwards: bool = False  # Keras: a layer made with go_backwards=True (h_grad in the order it ran)
    inference: bool = False  # Keras: the gradient was taken with training=False (a layer's dropout inactive)


# Options that say how one framework's tensors are laid out, and whose they are.  Given for another's, they would
# be ignored and the gradient silently wrong, so they are refused (``check_applicable``).
_OPTIONS = {"time_major": ("keras",), "go_backwards": ("keras",), "batch_first": ("torch",), "layer": ("torch",),
            "reverse": ("keras", "torch"), "inference": ("keras",)}
_WHOSE = {"keras": "a Keras LSTM layer's", "torch": "a PyTorch nn.LSTM's", "tf": "the TF op's own"}


def check_applicable(framework: str, options: FrameworkOptions) -> None:
    """Refuse options given for another framework's tensors than ``framework``'s ("keras", "torch", "tf")."""
    wrong = [(name, owners) for name, owners in _OPTIONS.items()
             if getattr(options, name) != getattr(FrameworkOptions, name) and framework not in owners]
    if wrong:
        said = Message.join("; ", (Message.format("{} is for {} tensors", Param(name),
                                                  " and ".join(_WHOSE[o] for o in owners)) for name, owners in wrong))
        raise InvalidArgumentError(Message.format("{}, and this input holds {} ({} says whose they are where the "
                                                  "names do not tell)", said, _WHOSE[framework], Param("framework")))
    if options.reverse and options.go_backwards:
        raise InvalidArgumentError(Message.format(
            "{} and {} do not go together: the first is a Bidirectional's backward layer (h_grad in x's time order), "
            "the second a layer made with go_backwards=True (h_grad in the order it ran)", Param("reverse"),
            Param("go_backwards")))


# --- Keras (keras.py) ---

KERAS_PARAMETERS = ("kernel", "recurrent_kernel", "bias")
# Keras name -> where files keep it (plain, Keras 3 weights file, older tf.keras HDF5)
KERAS_ALIASES = {
    "kernel": ("kernel", "cell/vars/0", "lstm_cell/kernel", "lstm_cell/kernel:0"),
    "recurrent_kernel": ("recurrent_kernel", "cell/vars/1", "lstm_cell/recurrent_kernel",
                         "lstm_cell/recurrent_kernel:0"),
    "bias": ("bias", "cell/vars/2", "lstm_cell/bias", "lstm_cell/bias:0"),
}
# A whole Bidirectional's two layers: Keras 3 keeps them at forward_layer/ and backward_layer/, full-model files
# under the layers' own names, forward_ and backward_ then the wrapped layer's name (forward_lstm_1/, ...).
KERAS_WRAPPED = {"forward": ("forward_layer", "forward_lstm"), "backward": ("backward_layer", "backward_lstm")}
KERAS_STATE_NAMES = ("x", "h0", "c0", "h_grad", "hn_grad", "cn_grad", "mask")


def keras_direction_of(group: str) -> str | None:
    """"forward" or "backward" for a Bidirectional's layer group name (forward_layer, backward_lstm_1, ...)."""
    return next((d for d in KERAS_WRAPPED if group.startswith(f"{d}_")), None)


def keras_wrapped_names(keys) -> list[str]:
    """The weights' names under a Bidirectional's two layer groups among ``keys`` (a group's entries), whatever the
    layers were called: read once the entries say which there are."""
    plain = [alias for aliases in KERAS_ALIASES.values() for alias in aliases if "/" in alias]
    return [f"{key}/{alias}" for key in keys if keras_direction_of(key) and key not in KERAS_WRAPPED["forward"]
            + KERAS_WRAPPED["backward"] for alias in plain]


def keras_file_names() -> list[str]:
    """Every name a Keras input or weights file may keep a layer's (or a Bidirectional's) tensors under."""
    plain = [alias for aliases in KERAS_ALIASES.values() for alias in aliases]
    wrapped = [f"{group}/{alias}" for groups in KERAS_WRAPPED.values() for group in groups for alias in plain[1:]
               if "/" in alias]
    return [*KERAS_STATE_NAMES, *plain, *wrapped, *(f"{d}_{p}" for d in KERAS_WRAPPED for p in KERAS_PARAMETERS)]


# --- PyTorch (pytorch.py) ---

TORCH_WEIGHT = re.compile(r"\Aweight_ih_l(0|[1-9][0-9]*)(_reverse)?\Z")  # ASCII digits, as nn.LSTM numbers its layers
TORCH_PARAMETERS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
TORCH_STATE_NAMES = ("x", "h0", "c0", "h_grad", "hn_grad", "cn_grad", "lengths")
TORCH_CELL_KEYS = ("weight_ih", "weight_hh")


def torch_suffix(layer: int, reverse: bool) -> str:
    return f"_l{layer}" + ("_reverse" if reverse else "")


def torch_names(layer: int, reverse: bool) -> dict[str, str]:
    """weight_ih, weight_hh, bias_ih, bias_hh -> their state_dict names for the layer and direction."""
    sfx = torch_suffix(layer, reverse)
    return {n: f"{n}{sfx}" for n in TORCH_PARAMETERS}


# --- A framework cell's step (cells.py) ---

CELL_STATE_NAMES = ("x", "h0", "c0", "h1_grad", "c1_grad")
# Keras name -> where files keep a cell's weights: a layer's names (KERAS_ALIASES), and a cell's own group (a
# subclassed model's attribute: <attribute>/vars/0, 1, 2)
CELL_KERAS_ALIASES = {name: (*aliases, f"vars/{k}") for k, (name, aliases) in enumerate(KERAS_ALIASES.items())}
# The TF op's own names: their file is the op's (LSTMBlockCell), not a framework cell's.
TF_NAMES = {"w", "i", "cs", "cs_prev", "h_prev"}


def cell_file_names() -> list[str]:
    """Every name a cell step's input (or its weights file, below the cell's group) may keep a tensor under."""
    keras_names = [alias for aliases in CELL_KERAS_ALIASES.values() for alias in aliases]
    return list(dict.fromkeys([*CELL_STATE_NAMES, *TORCH_PARAMETERS, *keras_names]))


def framework_of(keys, kind: str | None, x_rank: int | None) -> str | None:
    """"torch" or "keras" where an input (``keys``: every name it and its weights file hold) is a framework cell's
    step for ``lstmgrad cell`` (``kind`` "cell") or for a caller that does not say (``kind`` None: a Keras cell's
    names with x of one step, [B, I]); None for the TF op's own tensors, or a whole layer's."""
    keys = set(keys)
    if kind == "seq" or keys & TF_NAMES:
        return None
    if {"weight_ih", "weight_hh"} & keys or (kind == "cell" and any(TORCH_WEIGHT.match(k) for k in keys)):
        return "torch"
    # (a cell's own vars/0, 1, 2 are read below its group, for lstmgrad cell only: other layers have them too)
    names = {alias for aliases in CELL_KERAS_ALIASES.values() for alias in aliases
             if kind == "cell" or not alias.startswith("vars/")}
    if keys & names and (kind == "cell" or x_rank == 2):
        return "keras"
    return None


def without_weights(keys) -> bool:
    """Whether an input holds a framework cell step's own names (h0, c0, h1_grad, c1_grad) and no weights, its own or
    the TF op's."""
    keys = set(keys)
    return bool(keys & {"h0", "c0", "h1_grad", "c1_grad"}) and not keys & TF_NAMES and framework_of(
        keys, "cell", None) is None


# --- Whose tensors, and what to read (the package's own) ---

def file_names(options: FrameworkOptions) -> list[str]:
    """Every name a Keras or PyTorch input may hold, for reading before the framework is known (PyTorch's other
    layers are read once the names present are known: ``pytorch.parameter_names``); a cell step's too, but for its
    weights under a cell's own group (``cell_file_names``, read for ``lstmgrad cell``)."""
    layer = options.layer or 0
    torch = [*torch_names(layer, options.reverse).values(), f"weight_hr{torch_suffix(layer, options.reverse)}"]
    step = [n for n in cell_file_names() if not n.startswith("vars/")]
    return list(dict.fromkeys([*keras_file_names(), *TORCH_STATE_NAMES, *torch, *TORCH_CELL_KEYS, *step]))


def detect(keys, options: FrameworkOptions) -> str:
    """"keras", "torch" or "tf" (the op's own tensors), from ``options.framework`` or the names present."""
    if options.framework:
        return options.framework
    keys = set(keys)
    if {"w", "i", "cs", "cs_prev", "h_prev"} & keys:
        return "tf"
    if ("recurrent_kernel" in keys or "cell" in keys or "lstm_cell" in keys or {"kernel", "x"} <= keys
            or any(keras_direction_of(k) for k in keys if "/" not in k and not k.endswith("_grad"))):
        return "keras"
    if any(TORCH_WEIGHT.match(k) for k in keys) or set(TORCH_CELL_KEYS) <= keys:
        return "torch"
    return "tf"

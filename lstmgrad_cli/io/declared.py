"""What a file declares, checked before any of its data is read.

Every reader first *declares* the tensors asked for (shape and dtype from a ``.npy`` header, an HDF5
dataspace, a safetensors header or a TensorProto; nothing else is read), then ``checked`` refuses

* a shape no array can have, and a tensor larger than the memory budget (``Budget``: the budget counts the
  file's tensors together);
* a tensor whose data the file does not hold as declared (``Declared.verify``: a ``.npy`` member longer or
  shorter than its header says, a TensorProto with more values than its shape);
* a tensor over ``LARGE`` bytes whose rank no op can use: ``spec.RANKS`` for the op's own names (when the
  kind of op is not known yet, a rank that fits neither kind), and the ranks of Keras' and PyTorch's names;
* a tensor over ``LARGE`` bytes that the file's other tensors contradict: its declared shape holds more
  than the op can use given the dimensions (time steps, batch, input and cell sizes) the others agree on.

The last two are what stop a compression bomb that is a well-formed array (1.5 GB of zeros deflated to
1.5 MB) before it is inflated.  A tensor of at most ``LARGE`` bytes is read whatever its rank and shape,
so that validation says what is wrong with it in TensorFlow's words, knowing every tensor.

Only then does the reader read the tensors that passed.  Names the caller does not know (``lstmgrad
inspect`` reads every key) are bounded by the budget alone.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ..errors import InputFileError
from ..spec import ACTIVATIONS, OUTPUT_GRADIENTS, PEEPHOLES, RANKS
from ._common import Budget, LoadedFile, collecting, dtype_text, human, shape_text

LARGE = 1 << 20  # bytes: a tensor this small is read even with a wrong rank or shape (validation says what is wrong)


@dataclass
class Declared:
    """One tensor as its file declares it, and how to read it once the declaration passed."""

    name: str  # the name asked for (TF's, a framework's, or a key)
    key: str  # the name in the file, for messages
    shape: tuple
    dtype: np.dtype
    read: Callable[[], object]
    origin: str = "tensor"  # "tensor" or "attribute" (an HDF5 attribute holding a scalar parameter)
    lazy: bool = False  # left on disk and read a time step at a time: one step must fit the budget
    verify: Callable[[], None] | None = None  # checks the data's extent fits the shape (once it is within budget)

    def __post_init__(self):
        self.shape = tuple(int(n) for n in self.shape)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize


def checked(loaded: LoadedFile, budget: Budget, names: Iterable[str], scalars: Iterable[str],
            declare: Callable[[str], Declared | None]) -> dict[str, Declared | InputFileError]:
    """Every one of ``names`` and ``scalars`` the file has (``declare(name)``: None when it has no such tensor),
    declared and checked as above before any is read: name -> its declaration, or the error that refuses it.
    ``read_checked`` then reads them in order, so that the first refusal in the order of the names is the one
    said (a tensor that passed is read before a later one's refusal is raised)."""
    out: dict[str, Declared | InputFileError] = {}
    for name in [*names, *scalars, *loaded.header_only]:
        try:
            declared = declare(name)
            if declared is None:
                continue
            if name in loaded.header_only:  # declared, never read: its shape must still be one an array can have
                budget.check_shape(declared.key, declared.shape, declared.dtype.itemsize)
                loaded.headers[name] = (declared.shape, declared.dtype)
                continue
            if declared.lazy:
                budget.check_slice(declared.key, declared.shape, declared.dtype)
            else:
                budget.take(declared.key, declared.shape, declared.dtype)
            if declared.verify is not None:
                declared.verify()
            if declared.nbytes > LARGE:
                check_rank(budget.path, declared, budget.kind)
        except InputFileError as err:
            out[name] = err
            continue
        out[name] = declared
    passed = {n: d for n, d in out.items() if isinstance(d, Declared)}
    out.update(contradicted(passed, budget.kind, budget.path))
    return out


def read_checked(loaded: LoadedFile, declared: dict[str, Declared | InputFileError], scalars, collect: bool = False,
                 collect_scalars: bool = True) -> None:
    """Read what ``checked`` passed into ``loaded``, in order; a refusal or a read error is raised, or with
    ``collect`` recorded in ``loaded.errors`` (scalars too unless ``collect_scalars`` is false)."""
    for name, entry in declared.items():
        with collecting(loaded, name, collect and (collect_scalars or name not in scalars)):
            if isinstance(entry, InputFileError):
                raise entry
            store(loaded, entry, entry.read(), scalars)


def store(loaded: LoadedFile, declared: Declared, value, scalars) -> None:
    if declared.name in scalars:
        loaded.scalars[declared.name] = (value, declared.origin)
    else:
        loaded.tensors[declared.name] = value


# -- ranks ----------------------------------------------------------------------------------------------

# Keras' and PyTorch's names (frameworks.py reads them): the ranks their layers can use.
_FRAMEWORK_RANKS = {"h0": (2, 3), "c0": (2, 3), "hn_grad": (2, 3), "cn_grad": (2, 3),  # [B, C] or [L*D, B, C]
                    "lengths": (1,), "mask": (2,)}
_KERAS_NAME = re.compile(r"^(?:.*/)?(?P<what>kernel|recurrent_kernel|bias)(?::0)?$|^(?:.*/)?cell/vars/(?P<n>[012])$")
_TORCH_NAME = re.compile(r"\A(?P<what>weight_ih|weight_hh|weight_hr|bias_ih|bias_hh)_l(?P<layer>0|[1-9][0-9]*)"
                         r"(?P<rev>_reverse)?\Z")


def _keras_role(name: str) -> str | None:
    match = _KERAS_NAME.match(name)
    if match is None:
        return None
    return match.group("what") or ("kernel", "recurrent_kernel", "bias")[int(match.group("n"))]


def allowed_ranks(name: str, kind: str | None) -> tuple[int, ...] | None:
    """The ranks a tensor called ``name`` may have (None: any; the caller does not know the name)."""
    if name in RANKS["seq"]:
        return tuple(sorted({RANKS[k][name] for k in RANKS}))  # a rank of the other kind: validation explains
    if name in _FRAMEWORK_RANKS:
        return _FRAMEWORK_RANKS[name]
    role = _keras_role(name)
    if role is not None:
        return (1,) if role == "bias" else (2,)
    match = _TORCH_NAME.match(name)
    if match is not None:
        return (1,) if match.group("what").startswith("bias") else (2,)
    return None


def check_rank(path, declared: Declared, kind: str | None) -> None:
    ranks = allowed_ranks(declared.name, kind)
    rank = len(declared.shape)
    if ranks is None or rank in ranks:
        return
    name, shape = declared.name, shape_text(declared.shape)
    if name == "seq_len_max":  # TensorFlow's wording
        raise InputFileError(f"{path}: `seq_len_max_tensor` must be rank 0 but is rank {rank} (shape {shape}); "
                             "refused before reading")
    if name in RANKS["seq"] and len(ranks) > 1:
        first = RANKS[kind][name] if kind in RANKS else RANKS["seq"][name]
        other = RANKS["cell" if first == RANKS["seq"][name] else "seq"][name]
        raise InputFileError(f"{path}: {name} must be rank {first} but is rank {rank} (shape {shape}), or rank "
                             f"{other} for {'a single cell step' if other == 2 else 'a sequence'}; refused before "
                             "reading")
    expected = " or ".join(str(r) for r in ranks)
    raise InputFileError(f"{path}: {name} must be rank {expected} but is rank {rank} (shape {shape}); refused "
                         "before reading")


# -- shapes against one another ---------------------------------------------------------------------------

# Each dimension is (symbol, factor): the dimension is factor * the symbol's value.  Symbols: T time steps,
# B batch, I input size, C cell size, IC the rows of w (I + C).
_TF = {"cs_prev": (("B", 1), ("C", 1)), "h_prev": (("B", 1), ("C", 1)), "w": (("IC", 1), ("C", 4)),
       "b": (("C", 4),), **{n: (("C", 1),) for n in PEEPHOLES}}
_TF_SHAPES = {
    "seq": {**_TF, "x": (("T", 1), ("B", 1), ("I", 1)),
            **{n: (("T", 1), ("B", 1), ("C", 1)) for n in (*ACTIVATIONS, *OUTPUT_GRADIENTS)}},
    "cell": {**_TF, "x": (("B", 1), ("I", 1)),
             **{n: (("B", 1), ("C", 1)) for n in (*ACTIVATIONS, *OUTPUT_GRADIENTS)}},
}
_KERAS_SHAPES = {"kernel": (("keras I", 1), ("keras C", 4)), "recurrent_kernel": (("keras C", 1), ("keras C", 4)),
                 "bias": (("keras C", 4),)}


def _torch_shape(match) -> tuple:
    layer = f"torch l{match.group('layer')}{match.group('rev') or ''} "
    return {"weight_ih": ((layer + "C", 4), (layer + "I", 1)), "weight_hh": ((layer + "C", 4), (layer + "P", 1)),
            "weight_hr": ((layer + "P", 1), (layer + "C", 1)), "bias_ih": ((layer + "C", 4),),
            "bias_hh": ((layer + "C", 4),)}[match.group("what")]


def _op_kind(found: dict[str, Declared], kind: str | None) -> str | None:
    """The kind of op the TF names describe: given, else x's rank, else most time-major tensors' rank."""
    if kind in _TF_SHAPES:
        return kind
    by_rank = {3: "seq", 2: "cell"}
    if "x" in found:
        return by_rank.get(len(found["x"].shape))
    ranks = Counter(len(found[n].shape) for n in (*ACTIVATIONS, *OUTPUT_GRADIENTS) if n in found)
    return by_rank.get(ranks.most_common(1)[0][0]) if ranks else None


def _symbols(found: dict[str, Declared], kind: str | None) -> dict[str, tuple]:
    """name -> its dimensions as (symbol, factor) pairs, for the tensors whose shape rule is known and whose rank
    fits it (a tensor of another rank is validation's to refuse)."""
    op_kind = _op_kind(found, kind)
    out = {}
    for name, declared in found.items():
        rule = _TF_SHAPES[op_kind].get(name) if op_kind and name in _TF_SHAPES[op_kind] else None
        if rule is None and name not in RANKS["seq"]:
            role = _keras_role(name)
            match = _TORCH_NAME.match(name)
            rule = _KERAS_SHAPES[role] if role else (_torch_shape(match) if match else None)
        if rule is not None and len(rule) == len(declared.shape):
            out[name] = rule
    return out


def contradicted(found: dict[str, Declared], kind: str | None, path) -> dict[str, InputFileError]:
    """The tensors over ``LARGE`` bytes (and not left on disk) that declare more than the op can use given the
    dimensions the file's other tensors agree on, each with the error that refuses it."""
    if not any(d.nbytes > LARGE and not d.lazy for d in found.values()):
        return {}
    rules = _symbols(found, kind)
    big = [n for n in rules if found[n].nbytes > LARGE and not found[n].lazy]
    witnesses: dict[str, list[tuple[str, int]]] = {}  # symbol -> (name, value) of every tensor that gives it
    for name, rule in rules.items():
        for (symbol, factor), dim in zip(rule, found[name].shape, strict=True):
            if int(dim) % factor == 0:
                witnesses.setdefault(symbol, []).append((name, int(dim) // factor))
    errors = {}
    for name in big:
        declared = found[name]
        expected = []
        for (symbol, factor), dim in zip(rules[name], declared.shape, strict=True):
            others = Counter(value for who, value in witnesses.get(symbol, ()) if who != name)
            if others:  # the value most of the others give (the larger one on a tie)
                top = max(others.values())
                expected.append(factor * max(v for v, n in others.items() if n == top))
            else:
                expected.append(int(dim))
        need = math.prod(expected) * declared.dtype.itemsize
        if need < declared.nbytes:
            errors[name] = InputFileError(
                f"{path}: {declared.key} declares shape {shape_text(declared.shape)} of {dtype_text(declared.dtype)} "
                f"= {human(declared.nbytes)}, but the file's other tensors make it {shape_text(expected)} "
                f"({human(need)}); refused before reading")
    return errors

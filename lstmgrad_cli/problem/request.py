"""What is asked of one input, besides its path: one ``Request``, which every command and ``lg.load`` build and
pass whole to ``open_problem``.  A command's own options extend it (``GradOptions``: force, per_step, strict;
``CheckOptions``: the reference and tolerances; ``ForwardOptions``: the output gradients).

``key(input)`` is what an output depends on besides the code (as black's ``Mode`` is its cache key): the input's
identity and every field that changes the numbers.  ``backend`` and ``chunk_steps`` change how, not what.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..frameworks import FrameworkOptions
from ..io.provenance import file_identity
from ..spec import LAYOUTS, OPS, op_name

# The fields that change how a gradient is computed, not what it is: never part of the key.
HOW = ("backend", "chunk_steps")


@dataclass(frozen=True)
class Request:
    """None means "from the input, else what its activations fit, else the op's default"."""

    kind: str | None = None  # "seq" or "cell"; None: from the rank of x
    layout: str | None = None  # a key of spec.LAYOUTS (sequence ops; the cell op has its own: spec.layout_for)
    backend: str | None = None  # a name from lstmgrad backends; None: LSTMGRAD_BACKEND, else numpy
    use_peephole: bool | None = None
    seq_len_max: int | None = None
    group: str | None = None  # an HDF5 group, a directory's subdirectory, a debug dump's execution
    compute_dtype: str | None = None
    chunk_steps: int | None = None  # time steps per chunk of the backward pass (memory), None: from a budget
    weights: str | None = None  # another input holding the tensors this one lacks (a dump's arguments, a model)
    weights_group: str | None = None
    forget_bias: float | None = None  # for recomputing absent activations (None: the input's, else the op's)
    cell_clip: float | None = None
    framework: FrameworkOptions = FrameworkOptions()  # Keras/PyTorch inputs: which, and their layouts

    @property
    def op(self) -> str:
        """The gradient op asked for; before an input is read, a sequence op of no given layout is either."""
        if self.kind != "cell" and self.layout is None:
            return " or ".join(OPS[("seq", layout)] for layout in LAYOUTS)
        return op_name(self.kind or "seq", self.layout)

    def key(self, input_path: str | os.PathLike) -> dict:
        """What an output of ``input_path`` under this request depends on besides the code: the input (its
        identity) and every field but ``HOW``, with a weights file's path and identity; as it reads back from a
        file (JSON), its keys sorted."""
        weights = None if self.weights is None else Path(self.weights)
        fields = {**self._fields_key, "framework": dict(self._fields_key["framework"]),
                  "input_identity": file_identity(input_path),
                  "weights": None if weights is None else str(weights.resolve()),
                  "weights_identity": None if weights is None else file_identity(weights)}
        return dict(sorted(fields.items()))

    @functools.cached_property
    def _fields_key(self) -> dict:
        """The part of ``key`` that is the request's own fields, made once (a batch asks it of every file)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Request) if f.name not in HOW}
        fields.update(framework=dataclasses.asdict(self.framework))
        del fields["weights"]  # (its path resolved, by ``key``)
        return json.loads(json.dumps(fields, sort_keys=True, default=str))


FRAMEWORK_FIELDS = tuple(f.name for f in dataclasses.fields(FrameworkOptions))


def request_from(**fields) -> Request:
    """A ``Request`` from keyword arguments: its own fields, and ``FrameworkOptions``' (``batch_first=True``,
    ``framework="torch"``) gathered into its ``framework``; TypeError naming an unknown one."""
    own = {f.name for f in dataclasses.fields(Request)}
    framework = fields.pop("framework", None)
    layout_fields = {name: fields.pop(name) for name in FRAMEWORK_FIELDS if name in fields and name != "framework"}
    unknown = sorted(set(fields) - own)
    if unknown:
        raise TypeError(f"unknown request field{'s' * (len(unknown) > 1)} {', '.join(unknown)}; a request takes "
                        f"{', '.join(sorted(own | set(FRAMEWORK_FIELDS)))}")
    if isinstance(framework, FrameworkOptions):
        framework = dataclasses.replace(framework, **layout_fields)
    else:  # a framework's name ("keras", "torch", "tf"), or None: from the tensors' names
        framework = FrameworkOptions(framework, **layout_fields)
    return Request(**fields, framework=framework)

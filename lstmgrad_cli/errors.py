"""Exceptions raised by lstmgrad's library code, and the exit codes a command gives.

Every error the library raises on purpose is a ``LstmGradError``, itself a ``ValueError``, so a
caller can catch one class.  The command line maps them to exit codes (``ExitCode``) in one place
(``cli/_common.py``).
An error's message may be a ``messages.Message``: it names the parameters that would help as the Python API
spells them, and the command line shows the same message with its flags.  Errors that carry facts keep them
as attributes (``UnrecordedTensorsError.causes``).
"""

from __future__ import annotations

import copy
from enum import IntEnum

from .messages import Message, Param, message_of


class ExitCode(IntEnum):
    """What a command's exit status says (docs/DESIGN.md): ``SUCCESS``; ``ERROR``, bad input or a file that failed
    (nothing half-written); ``USAGE``, a malformed command line; a stop signal ends a command with
    ``SIGNALLED + its number`` (130 for Ctrl-C, 143 for SIGTERM), as shells report them (``signalled``)."""

    SUCCESS = 0
    ERROR = 1
    USAGE = 2
    SIGNALLED = 128

    @staticmethod
    def signalled(signum: int) -> int:
        return ExitCode.SIGNALLED + int(signum)


class LstmGradError(ValueError):
    """Base class of every error lstmgrad raises on purpose."""

    def prefixed(self, label: str) -> LstmGradError:
        """The same error (its class and facts) with ``label: `` before its message."""
        error = copy.copy(self)
        error.args = (Message.format("{}: {}", label, message_of(self)),)
        return error


class InvalidArgumentError(LstmGradError):
    """Tensors that TensorFlow's op would reject (or crash on): wrong rank, shape, dtype or value."""


class UnrecordedTensorsError(InvalidArgumentError):
    """Tensors a TensorFlow debug dump holds no value for.  ``why``: tensor -> the reason the dump gives;
    ``causes``: each reason once, with the tensors it applies to (in the op's order).  Another file can supply
    them (``weights=`` of ``load`` and ``load_problem``; ``--weights FILE`` on the command line)."""

    def __init__(self, why: dict[str, str]):
        self.why = dict(why)
        self.tensors = list(self.why)
        self.causes: dict[str, list[str]] = {}
        for name, cause in self.why.items():
            self.causes.setdefault(cause, []).append(name)
        several = len(self.why) > 1
        clauses = "; for ".join(f"{', '.join(tensors)} ({cause})" for cause, tensors in self.causes.items())
        super().__init__(Message.format("no recorded value{} for {}; give a file holding {} with {}",
                                        "s" if several else "", clauses, "them" if several else "it",
                                        Param("weights")))

    def __reduce__(self):  # (pickled with its facts: batch workers send it back)
        return _unrecorded, (self.why, self.args)


def _unrecorded(why, args):
    error = UnrecordedTensorsError(why)
    error.args = args
    return error


class InputFileError(LstmGradError):
    """An input file that cannot be read: missing, not HDF5/NPZ, truncated, hostile."""


class OutputFileError(LstmGradError):
    """An output that cannot or must not be written."""


class OutputExistsError(OutputFileError):
    """An output that already exists and may not be replaced (no ``force``)."""


class InvalidOptionError(LstmGradError):
    """An option value that is malformed, found before any work (a usage error on the command line)."""


class UnknownBackendError(InvalidOptionError):
    """A backend name that is not registered (a usage error on the command line)."""


class BackendUnavailableError(LstmGradError):
    """A registered backend whose libraries are missing or unusable here."""

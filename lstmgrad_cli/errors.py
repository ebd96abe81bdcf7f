"""Exceptions raised by lstmgrad's library code.

Every error the library raises on purpose is a ``LstmGradError``, itself a ``ValueError``, so a
caller can catch one class.  The command line maps them to exit codes in one place (``cli/_common.py``).
"""


class LstmGradError(ValueError):
    """Base class of every error lstmgrad raises on purpose."""


class InvalidArgumentError(LstmGradError):
    """Tensors that TensorFlow's op would reject (or crash on): wrong rank, shape, dtype or value."""


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

"""lstmgrad: TensorFlow's block-LSTM gradients (BlockLSTMGradV2, BlockLSTMGrad, LSTMBlockCellGrad)
from saved forward-pass tensors, without TensorFlow.

The names below are imported when first used (PEP 562), so that the command line can take Ctrl-C its own way
before numpy and the rest load (cli.LazyGroup.main: no traceback from a half-done import).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "InvalidArgumentError": "errors", "LstmGradError": "errors", "UnrecordedTensorsError": "errors",
    "KerasLSTMGradOutputs": "frameworks", "TorchLSTMGradOutputs": "frameworks", "keras_lstm_grad": "frameworks",
    "torch_lstm_grad": "frameworks", "KerasCellGradOutputs": "frameworks", "TorchCellGradOutputs": "frameworks",
    "keras_cell_grad": "frameworks", "torch_cell_grad": "frameworks",
    "OpInputs": "problem.inputs", "load": "problem.inputs", "Request": "problem.request",
    "block_lstm": "ops", "block_lstm_grad": "ops", "block_lstm_grad_v2": "ops", "block_lstm_v2": "ops",
    "lstm_block_cell": "ops", "lstm_block_cell_grad": "ops", "lstm_block_cell_grad_full": "ops",
    "BlockLSTMGradOutputs": "results", "BlockLSTMOutputs": "results", "LSTMBlockCellGradFullOutputs": "results",
    "LSTMBlockCellGradOutputs": "results",
}

__all__ = [
    "BlockLSTMGradOutputs", "BlockLSTMOutputs", "InvalidArgumentError", "KerasCellGradOutputs", "KerasLSTMGradOutputs",
    "LSTMBlockCellGradFullOutputs", "LSTMBlockCellGradOutputs", "LstmGradError", "OpInputs", "Request",
    "TorchCellGradOutputs",
    "TorchLSTMGradOutputs", "__version__", "block_lstm", "block_lstm_grad", "block_lstm_grad_v2", "block_lstm_v2",
    "keras_cell_grad", "keras_lstm_grad", "load", "lstm_block_cell", "lstm_block_cell_grad",
    "lstm_block_cell_grad_full", "torch_cell_grad", "torch_lstm_grad", "UnrecordedTensorsError",
]

# Modules that moved (the paths docs/python.md once gave): importing one still works, with a DeprecationWarning.
_MOVED = {"jobs": "operations.grad", "batch": "operations.batch", "diagnose": "operations.check",
          "inspection": "operations.inspect", "dump_report": "operations.inspect_dump", "bench": "operations.bench",
          "forward_job": "operations.forward", "loading": "problem.inputs",
          "provenance": "io.provenance", "interrupts": "execution.interrupts", "allocator": "execution.allocator"}


class _MovedModules:
    """``import lstmgrad_cli.jobs`` (a module that moved): a module that hands out the new one's names.  A meta path
    finder and loader by their methods (importlib.abc would import importlib.resources: 19 ms of every start)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # an empty module, filled below

    def exec_module(self, module):
        moved = f"{__name__}.{_MOVED[module.__name__.rpartition('.')[2]]}"
        warnings.warn(f"{module.__name__} is now {moved}: import it from there", DeprecationWarning, stacklevel=2)
        real = importlib.import_module(moved)
        module.__dict__.update({k: v for k, v in vars(real).items() if not k.startswith("__")})
        module.__getattr__ = lambda attr: getattr(real, attr)


sys.meta_path.append(_MovedModules())


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (lstmgrad_cli.io), as the package gave once it had imported them all
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""lstmgrad: TensorFlow's block-LSTM gradients (BlockLSTMGradV2, BlockLSTMGrad, LSTMBlockCellGrad)
from saved forward-pass tensors, without TensorFlow."""

from .errors import InvalidArgumentError, LstmGradError, UnrecordedTensorsError
from .frameworks import KerasLSTMGradOutputs, TorchLSTMGradOutputs, keras_lstm_grad, torch_lstm_grad
from .loading import OpInputs, load
from .ops import (
    block_lstm,
    block_lstm_grad,
    block_lstm_grad_v2,
    block_lstm_v2,
    lstm_block_cell,
    lstm_block_cell_grad,
    lstm_block_cell_grad_full,
)
from .results import BlockLSTMGradOutputs, BlockLSTMOutputs, LSTMBlockCellGradFullOutputs, LSTMBlockCellGradOutputs

__version__ = "0.1.0"

__all__ = [
    "BlockLSTMGradOutputs", "BlockLSTMOutputs", "InvalidArgumentError", "KerasLSTMGradOutputs",
    "LSTMBlockCellGradFullOutputs", "LSTMBlockCellGradOutputs", "LstmGradError", "OpInputs", "TorchLSTMGradOutputs",
    "__version__", "block_lstm", "block_lstm_grad", "block_lstm_grad_v2", "block_lstm_v2", "keras_lstm_grad", "load",
    "lstm_block_cell", "lstm_block_cell_grad", "lstm_block_cell_grad_full", "torch_lstm_grad",
    "UnrecordedTensorsError",
]

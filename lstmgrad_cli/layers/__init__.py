"""The LSTM layer engine: which steps a direction runs, its recurrence, whole modules."""

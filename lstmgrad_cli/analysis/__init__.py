"""What the tensors say: the op that made them, decisions, gradient checks, per-step norms, summaries."""

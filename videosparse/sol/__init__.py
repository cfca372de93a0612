"""Sol-Attn: training-free tile selection with a Gaussian-calibrated threshold (arXiv 2607.24027)."""

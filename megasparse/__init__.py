"""megasparse: Megatron-style training with token-filtered backward, vocab-parallel CCE and 2:4 FFNs."""

__version__ = "0.1.0"

"""megasparse: Megatron-style training with token-filtered backward, vocab-parallel CCE and 2:4 FFNs."""

__version__ = "0.1.0"

import warnings as _warnings

# megatron-core warns on import when the optional Transformer Engine / Apex are absent; they are optional here.
_warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
_warnings.filterwarnings("ignore", message=".*Transformer Engine is not installed.*")

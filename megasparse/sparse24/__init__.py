"""2:4 fully sparse FFN training: transposable masks, MVUE, sparse linear, gated activation, recipe."""

from megasparse.ops.glu import gated_activation
from megasparse.sparse24.linear import Sparse24Weight, sparse24_backward, sparse24_forward, sparse24_linear
from megasparse.sparse24.masks import transposable_mask
from megasparse.sparse24.mvue import mvue24
from megasparse.sparse24.recipe import SparsityManager

__all__ = [
    "Sparse24Weight",
    "SparsityManager",
    "gated_activation",
    "mvue24",
    "sparse24_backward",
    "sparse24_forward",
    "sparse24_linear",
    "transposable_mask",
]

import os
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """A 300-token byte-level BPE trained on a few words (data and preprocess tests)."""
    from megasparse.data.bpe import train_bpe

    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, size=30)) for _ in range(200)]
    return train_bpe(texts, 300, tmp_path_factory.mktemp("tok") / "tok.json")

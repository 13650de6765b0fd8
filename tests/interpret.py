"""Run a test module's ``_check()`` in a fresh interpreter under TRITON_INTERPRET=1: the Triton kernels on CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def needs_interpreter(test):
    """Skip where the interpreter path is not the one to test: off Linux, or with a GPU (compiled kernels)."""
    test = pytest.mark.skipif(sys.platform != "linux", reason="triton needs Linux")(test)
    return pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernels are tested")(test)


def check_under_interpreter(module: str) -> None:
    """``import module; module._check()`` in a subprocess (the interpreter flag is read at import)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    code = f"import {module} as t; t._check()"
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.path.dirname(__file__), capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-3000:]

"""Hugging Face Llama-family models in and out of megasparse: config and tensor-name maps (``names.py``), reading a
rank's slices from memory-mapped safetensors (``convert.py``, ``checkpoint.init_from``), whole-model import and
export (``checkpoints.py``, ``megasparse hf``), evaluation and generation (``inference.py``)."""

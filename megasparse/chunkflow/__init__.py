"""ChunkFlow: whole variable-length sequences as equal chunks, a long sequence's chunks run in causal
order over the earlier chunks' keys/values under a bound of K chunks of activations (decisions 1220-1222).

``plan.py``: the step's chunks and which DP rank runs them (host-side, the same on every rank); ``state.py``: one
sequence's chunks forward in order and backward in reverse, on one stage or through the pipeline, the keys/values
and their gradients between them; ``schedule.py``: the pipeline's order of every chunk forward and backward per
stage (the state-aware 1F1B) and its simulator; ``step.py``: the trainer's step over this rank's chunks;
``tailwarm.py``: the packed last chunks' FlexAttention variants compiled before the first step (decision 1241);
``filter.py``: ``filter.mode=loss_mask`` over each chunk's real tokens; ``data.py``: where the sequences come from
(with a synthetic long-tail stand-in); ``config.py``: the ``chunkflow`` section.
"""

"""Token filtering's model-independent parts: selection (``selection``), reference losses from a Kneser-Ney
n-gram (``ngram``) or an offline per-token sidecar (``sidecar``), the trainer's entry point to them
(``reference.ReferenceLosses``) and the ``megasparse ref`` command (``cli``).

Kept import-free so loading the config does not pull in torch."""

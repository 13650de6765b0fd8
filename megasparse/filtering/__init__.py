"""Token filtering: selection (``selection``), reference losses from a Kneser-Ney
n-gram (``ngram``) or an offline per-token sidecar (``sidecar``), the entry point to them
(``reference.ReferenceLosses``), the trainer's TokenFilter (``component``) and the ``megasparse ref`` command
(``cli``).

Kept import-free so loading the config does not pull in torch."""

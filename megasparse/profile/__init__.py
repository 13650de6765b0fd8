"""Communication-volume profiling: ``collect`` (record and gather), ``report`` (pure maths/text/plot), ``cli``."""

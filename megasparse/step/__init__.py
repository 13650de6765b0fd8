"""The training step as three parts: what runs for one micro-batch (``microbatch.MicrobatchStep``), in which order
micro-batches run (``schedule.get_schedule``), and how each one executes (``executor``: eager, or the replayed CUDA
graphs of ``cudagraph.CapturedSteps``); ``executor.ForwardBackward`` composes them for the trainer."""

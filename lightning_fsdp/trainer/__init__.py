"""The Lightning Trainer adapter: ``FSDPStrategy`` (``Trainer(strategy="myfsdp")``), its precision plugin and what
only the Trainer needs (checkpoint IO, compiled modules, summaries, sync batchnorm, preemption signals)."""

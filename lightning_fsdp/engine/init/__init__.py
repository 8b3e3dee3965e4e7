"""Deferred init: a model built on the meta device, its build recorded and replayed unit by unit."""

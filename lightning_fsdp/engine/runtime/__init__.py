"""One training step: a parameter's two lives, a unit's state machine, what a root's units share, the hooks."""

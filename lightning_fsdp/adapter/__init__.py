"""What the Trainer adapter (``trainer/``) and the Fabric adapter (``fabric/``) share: the one definition of the
strategy arguments and their checks, the sharded model's set-up, and the registration of the strategy names.
Importing this package does not import Lightning (``registration.py`` waits for it)."""

"""What the engine does beyond the six stages, one file each (the embedding's rows, uneven evaluation, ...)."""

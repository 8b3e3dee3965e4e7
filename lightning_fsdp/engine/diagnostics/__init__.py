"""What watches the engine: where each rank waits, the collectives counted, bytes and time per unit."""

"""What ``fully_shard`` decides before training: which modules are units, which unit owns each parameter, the
process groups, and that every rank built the same model."""

"""State dicts, loading, ``summon_full_params``, ``no_sync``, clipping, and giving back what a run took."""

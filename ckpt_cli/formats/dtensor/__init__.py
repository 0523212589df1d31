"""Per-rank DTensor files (verl, SkyRL): FSDP1 flat and FSDP2 sharded state dicts."""

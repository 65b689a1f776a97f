"""Pure rules of Backfill: no I/O, no frameworks."""

"""Use cases over the ports."""

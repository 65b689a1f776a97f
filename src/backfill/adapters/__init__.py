"""Concrete implementations of the ports."""

"""Shared test helpers (tiny checkpoints, references)."""

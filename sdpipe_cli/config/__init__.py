"""The config schema (the single source of truth for every setting), composition and validation."""

__all__ = ['measurements', 'reference', 'schema']

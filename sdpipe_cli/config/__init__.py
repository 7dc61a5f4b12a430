"""The config schema (the single source of truth for every setting), its validation, and the profile.json document."""

__all__ = ['job_env', 'measurements', 'reference', 'schema', 'sweep']

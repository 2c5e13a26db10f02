"""Profiles: per-layer sensitivity tables measured offline on a model."""

"""Integrations with the libraries users already run (diffusers pipelines)."""

"""Example third-party UniRL plugin (a model adapter)."""

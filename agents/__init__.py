"""The Klique agent: runs in each environment, connects out to the control plane, pulls work and hands it
to that environment's own scheduler. It never imports Django (see agents/ruff.toml)."""

__version__ = "0.1.0"

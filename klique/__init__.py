"""Klique's Python SDK and the `klique` command line. Nothing here imports Django at import time."""

__version__ = "0.1.0"

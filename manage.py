#!/usr/bin/env python
"""Django's command-line utility for administrative tasks (`klique manage ...` runs the same)."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings.local")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)

"""A developer's laptop: `klique up` and `make demo`."""

from __future__ import annotations

from config import env
from config.settings.base import *

DEBUG = env.flag("DEBUG", default=True)
LOG_FORMAT = env.text("KLIQUE_LOG_FORMAT", "text")
LOGGING["handlers"]["console"]["formatter"] = LOG_FORMAT  # type: ignore[index]
# Serve static files straight from the apps so no collectstatic step is needed on a laptop.
WHITENOISE_USE_FINDERS = True
STATIC_ROOT = None  # served from the apps by WhiteNoise; collectstatic is for production

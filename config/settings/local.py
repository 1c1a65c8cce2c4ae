"""A developer's laptop: `klique up` and `make demo`."""

from __future__ import annotations

from config import env
from config.settings.base import *

# Off unless asked for (DEBUG=1): `klique up` serves a demo others may reach, and Django's debug pages
# show settings and source.
DEBUG = env.flag("DEBUG", default=False)
LOG_FORMAT = env.text("KLIQUE_LOG_FORMAT", "text")
LOGGING["handlers"]["console"]["formatter"] = LOG_FORMAT  # type: ignore[index]
# Serve static files straight from the apps so no collectstatic step is needed on a laptop.
WHITENOISE_USE_FINDERS = True
# On a laptop the demo's model server (gateway.echo) listens on loopback; unless told otherwise, the
# gateway may call it there.
KLIQUE_OUTBOUND_ALLOW = env.words("KLIQUE_OUTBOUND_ALLOW", ("127.0.0.0/8", "::1/128"))
STATIC_ROOT = None  # served from the apps by WhiteNoise; collectstatic is for production

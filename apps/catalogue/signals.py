"""The catalogue's answers to other apps' signals: a gateway call that wants a sleeping model starts its app
(gateway.signals.selfhosted_wanted)."""

from __future__ import annotations

from typing import Any

from apps.catalogue import services
from gateway.signals import selfhosted_wanted


def _wanted(sender: Any, *, tenant: Any, app_id: str, **kwargs: Any) -> None:
    services.app_wake(tenant=tenant, app_id=app_id)


selfhosted_wanted.connect(_wanted, dispatch_uid="catalogue-wake-selfhosted")

"""The route's recent admissions, kept in each web process (apps.catalogue.route)."""

from __future__ import annotations

import time
from dataclasses import dataclass

ADMITTED_SECONDS = 2.0  # how long an admission is taken as read
MAX_ADMITTED = 10_000


@dataclass(frozen=True)
class Admission:
    status: int  # 0: admitted
    detail: str = ""
    app_id: str = ""
    channel: str = ""
    schema: str = ""
    tenant_host: str = ""
    set_cookie: str = ""
    location: str = ""


class Admissions:
    """Admissions of the last ADMITTED_SECONDS, by host and credential: a busy app's requests (a notebook
    loads dozens of files at once) skip the database's several round trips. Only admissions are kept,
    never refusals; a tunnel that does not answer is forgotten at once. So a revoked token, a sharing
    withdrawn or a stopped app takes effect within ADMITTED_SECONDS."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, str, str], tuple[float, Admission]] = {}

    def get(self, key: tuple[str, str, str] | None) -> Admission | None:
        found = self.kept.get(key) if key is not None else None
        if found is None or found[0] < time.monotonic():
            return None
        return found[1]

    def keep(self, key: tuple[str, str, str] | None, admission: Admission) -> None:
        if key is None or admission.status:
            return
        if len(self.kept) >= MAX_ADMITTED:
            now = time.monotonic()
            self.kept = {k: v for k, v in self.kept.items() if v[0] >= now}
            if len(self.kept) >= MAX_ADMITTED:
                self.kept.clear()
        self.kept[key] = (time.monotonic() + ADMITTED_SECONDS, admission)

    def forget(self, channel: str) -> None:
        self.kept = {k: v for k, v in self.kept.items() if v[1].channel != channel}


ADMISSIONS = Admissions()  # this process's: the route reads it, a tunnel that closes here clears its own

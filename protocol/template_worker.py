"""Renders one batch template in a process of its own, for protocol.batch.render_isolated:

    python -I -m protocol.template_worker < {"text": ..., "context": {...}}

It limits its own address space before reading anything and stops itself after the time limit, answering
with a sentence either way; the plane kills it if it does not answer soon after.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
from types import FrameType

from protocol.batch import MEMORY_LIMIT_BYTES, TIME_LIMIT_SECONDS, TemplateInvalid, render_in_worker


class TimeLimit(BaseException):
    """Raised in the rendering when its time is up (not an Exception: nothing in a template catches it)."""


def _time_is_up(signum: int, frame: FrameType | None) -> None:
    raise TimeLimit


def main() -> int:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    request = json.loads(sys.stdin.buffer.read())
    signal.signal(signal.SIGALRM, _time_is_up)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_SECONDS)
    try:
        answer = render_in_worker(request)
    except TimeLimit:
        limit = TemplateInvalid(
            f"the template took longer than {TIME_LIMIT_SECONDS} s to render; templates are rendered "
            "within limits (docs/hpc.md)."
        )
        answer = {"invalid": str(limit)}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Templates a user hands the plane are rendered within limits: operators, filters and calls that would
make huge values are refused before they run, and the rendering runs in a process of its own under a time
and memory limit. Each bomb is answered with a 400 naming the limit within a second, while the same web
process goes on serving other requests."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from protocol.batch import TemplateInvalid, Unsafe, render, render_isolated, sample_context
from tests.security.conftest import memory_mb
from tests.world import HOST_A, World

HEAD = "#!/bin/bash\n#SBATCH --nodes={{ nodes }} {{ gpus }}\n{{ run }}\n"
BOMBS = {
    "power": "{{ 7 ** 100000000 }}",
    "power-loop": "{% set ns = namespace(n=3) %}{% for i in range(100) %}"
    "{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "string-repeat": "{{ 'a' * 100000000 }}",
    "list-repeat": "{{ ([1] * 100000000)|length }}",
    "doubling": "{% set ns = namespace(s='a') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "nested-loops": "{% for i in range(10000) %}{% for j in range(10000) %}{{ '' }}{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "center": "{{ 'a'|center(100000000) }}",
    "method": "{{ 'a'.ljust(100000000) }}",
    "format": "{{ '{:>100000000}'.format(1) }}",
    "percent": "{{ '%100000000d' % 1 }}",
    "range": "{{ range(100000000)|list|length }}",
    "join": "{{ range(10000)|join('x' * 100000) }}",
    "replace": "{{ ('a' * 200000)|replace('a', 'aaaaaaaaaa') }}",
    "output": "{% for i in range(9000) %}{{ 'x' * 100 }}{% endfor %}",
}  # fmt: skip
LIMIT_WORDS = ("above", "longer than", "more than", "too deeply")


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_every_bomb_is_refused_with_the_limit_it_broke(name: str) -> None:
    started = time.monotonic()
    with pytest.raises((TemplateInvalid, Unsafe)) as refused:
        render_isolated(HEAD + BOMBS[name], sample_context("slurm"))
    assert time.monotonic() - started < 1.5
    assert any(word in str(refused.value) for word in LIMIT_WORDS), refused.value
    assert "limits (docs/hpc.md)" in str(refused.value)


@pytest.mark.parametrize(
    "name", ["power", "string-repeat", "center", "method", "percent", "range", "replace"]
)
def test_in_process_rendering_refuses_them_before_they_are_computed(name: str) -> None:
    started = time.monotonic()
    with pytest.raises(TemplateInvalid, match=r"above|more than"):
        render(HEAD + BOMBS[name], sample_context("slurm"))
    assert time.monotonic() - started < 0.5


def test_an_ordinary_template_renders_the_same_in_both() -> None:
    text = HEAD + "{% for i in range(3) %}#SBATCH --comment=n{{ i * 2 }}\n{% endfor %}{{ 'x' * 3 }}"
    assert render_isolated(text, sample_context("slurm")) == render(text, sample_context("slurm"))


@pytest.mark.django_db
def test_bombs_through_the_preview_leave_the_web_process_serving(
    world: World, served: tuple[str, int]
) -> None:
    base, pid = served
    headers = {"Host": HOST_A, "Authorization": f"Bearer {world.tokens['bob']}"}
    other = {"Host": HOST_A, "Authorization": f"Bearer {world.tokens['dave']}"}
    preview = f"{base}/api/v1/compute-resources/{world.compute_resource_a}/batch-preview/"
    with httpx.Client(headers=headers, timeout=30) as client:  # warm the process up
        assert client.get(f"{base}/api/v1/me/").status_code == 200
        ordinary = client.post(preview, json={"scheduler": "slurm", "template": HEAD})
        assert ordinary.status_code == 200, ordinary.text
    before = memory_mb(pid, "VmRSS")
    latencies: list[float] = []
    stop = threading.Event()

    def meanwhile() -> None:
        with httpx.Client(headers=other, timeout=30) as client:
            while not stop.is_set():
                started = time.monotonic()
                assert client.get(f"{base}/api/v1/me/").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.02)

    thread = threading.Thread(target=meanwhile, daemon=True)
    thread.start()
    answers: dict[str, tuple[int, float, str]] = {}
    try:
        with httpx.Client(headers=headers, timeout=30) as client:
            for name, bomb in BOMBS.items():
                started = time.monotonic()
                answer = client.post(preview, json={"scheduler": "slurm", "template": HEAD + bomb})
                answers[name] = (answer.status_code, time.monotonic() - started, answer.json()["detail"])
    finally:
        stop.set()
        thread.join(timeout=10)
    for name, (status, seconds, detail) in answers.items():
        assert status == 400, (name, detail)
        # Cut at the 0.5 s render limit in its own process; the rest is that process's start and the
        # answer, which a machine busy with other work stretches: the bound is that it ends, not a speed.
        assert seconds < 2.5, (name, seconds)
        assert "limits (docs/hpc.md)" in detail, (name, detail)
    assert len(latencies) > 20
    assert max(latencies) < 1.0, max(latencies)  # served all along, never held behind a rendering
    assert memory_mb(pid, "VmRSS") - before < 100  # no bomb grew the web process


@pytest.mark.django_db
def test_a_bomb_in_the_draft_is_refused_when_saved(api: Any, world: World) -> None:
    from tests.scheduling.config import acme_document

    document = acme_document()
    document["policies"][0]["compute_resources"][0]["batch"] = {"slurm": {"template": HEAD + BOMBS["power"]}}
    started = time.monotonic()
    answer = api("alice").put("/api/v1/configuration/draft/", {"document": document}, format="json")
    assert time.monotonic() - started < 1.5
    assert answer.status_code == 400, answer.content
    assert "above 256 bits" in str(answer.json())

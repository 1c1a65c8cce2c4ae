"""The usage API on the test world: events and summaries each person may read, imports, the price book."""

from __future__ import annotations

from collections.abc import Callable

from rest_framework.test import APIClient

from tests.world import World

GPU_EVENT = {
    "event_id": "import-gpu-1",
    "kind": "gpu",
    "started_at": "2026-11-02T10:00:00+00:00",
    "ended_at": "2026-11-02T12:00:00+00:00",
    "user": "carol",
    "project": "apollo",
    "pool": "h100",
    "gpus": "1/7",
}


def test_an_import_reports_what_was_new_known_and_refused(api: Callable[..., APIClient]) -> None:
    admin = api("alice")
    admin.put(
        "/api/v1/price-book/",
        {"gpu_hour": {"H100": "7"}, "tokens_million": {}, "gb_month": "0"},
        format="json",
    )
    bad = {**GPU_EVENT, "event_id": "import-gpu-2", "ended_at": "2026-11-02T09:00:00+00:00"}
    response = admin.post("/api/v1/usage/events/", {"events": [GPU_EVENT, bad, "nonsense"]}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["accepted"], body["duplicates"]) == (1, 0)
    reasons = {item["event_id"]: item["reason"] for item in body["rejected"]}
    assert "before it starts" in reasons["import-gpu-2"]
    assert reasons["#2"] == "expected an object"
    again = admin.post("/api/v1/usage/events/", {"events": [GPU_EVENT]}, format="json").json()
    assert (again["accepted"], again["duplicates"], again["rejected"]) == (0, 1, [])
    refused = admin.get("/api/v1/usage/rejections/").json()["results"]
    assert {row["event_id"] for row in refused} >= {"import-gpu-2", "#2"}
    (event,) = [
        e for e in admin.get("/api/v1/usage/?kind=gpu").json()["results"] if e["event_id"] == "import-gpu-1"
    ]
    assert (event["gpus"], event["gpu_hours"], event["cost_usd"]) == ("1/7", "0.285714", "2.000000")


def test_summaries_add_up_per_project_and_user(api: Callable[..., APIClient], world: World) -> None:
    api("alice").post("/api/v1/usage/events/", {"events": [GPU_EVENT]}, format="json")
    by_user = api("alice").get("/api/v1/usage/summary/?by=user").json()
    rows = {row["user"]: row for row in by_user["rows"]}
    assert rows["carol"]["gpu_hours"] == "0.285714"
    assert (rows["bob"]["tokens_in"], rows["bob"]["tokens_out"]) == (5, 7)
    by_project = api("alice").get(
        "/api/v1/usage/summary/?by=project&kind=gpu&since=2026-11-01T00:00:00%2B00:00"
    )
    assert [row["project"] for row in by_project.json()["rows"]] == ["apollo"]
    mine = api("bob").get("/api/v1/usage/summary/?by=user").json()["rows"]
    assert [row["user"] for row in mine] == ["bob"]  # others' usage is not a member's to read
    assert [e["username"] for e in api("bob").get("/api/v1/usage/").json()["results"]] == ["bob"]
    wrong = api("alice").get("/api/v1/usage/summary/?by=planet")
    assert wrong.status_code == 400


def test_the_price_book_refuses_what_is_not_a_price(api: Callable[..., APIClient]) -> None:
    response = api("alice").put(
        "/api/v1/price-book/",
        {"gpu_hour": {"H100": "-2"}, "tokens_million": {"chat": {"in": "1", "out": "x"}}, "gb_month": "0"},
        format="json",
    )
    assert response.status_code == 400
    assert "gpu_hour.H100: a price in USD from 0 to 1,000,000" in response.json()["detail"]
    fine = api("alice").put(
        "/api/v1/price-book/",
        {
            "gpu_hour": {"H100": "2.5", "*": "1"},
            "tokens_million": {"chat": {"in": "0.15", "out": "0.6"}},
            "gb_month": "0.02",
        },
        format="json",
    )
    assert fine.status_code == 200, fine.content
    assert api("bob").get("/api/v1/price-book/").json()["tokens_million"] == {
        "chat": {"in": "0.15", "out": "0.6"}
    }

"""Resource configuration in real Chromium, through its forms: change a pool, add a pool, a profile and a
compute resource, see the report after each save, a malformed value refused with the reason while what was
typed stays, remove an item, provision. The JSON document follows every form save."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.http import QueryDict

from apps.core.errors import error_lines
from apps.portal.configuration import policy_from, profile_from
from tests.portal.conftest import Portal, screenshot, sign_in
from tests.portal.test_portal import UNLABELLED

pytestmark = pytest.mark.django_db


def item(page: Any, key: str) -> Any:
    """An item's form, opened."""
    details = page.locator(f"details[data-item='{key}']")
    if not details.evaluate("element => element.open"):
        details.locator("summary").click()
    return details


def adder(page: Any, section: str) -> Any:
    details = page.locator(f"details[data-new='{section}']")
    details.locator("summary").click()
    return details


def test_pools_profiles_and_policies_change_through_their_forms(page: Any, portal: Portal) -> None:
    from apps.resources.models import ComputeResource, Pool

    page.on("dialog", lambda dialog: dialog.accept())
    sign_in(page, portal)
    page.get_by_role("link", name="Configuration").click()
    assert page.evaluate(UNLABELLED) == []

    h100 = item(page, "pools:h100")
    h100.get_by_label("GPUs", exact=True).fill("lots")
    h100.get_by_role("button", name="Save pool h100").click()
    alert = page.locator("#report").get_by_role("alert")
    alert.wait_for()
    assert alert.inner_text().startswith("The draft is not well formed, so nothing was saved: ")
    assert "pools[1].capacity_gpus: A valid integer is required." in alert.inner_text()
    assert h100.get_by_label("GPUs", exact=True).input_value() == "lots"  # what was typed stays

    h100.get_by_label("GPUs", exact=True).fill("12")
    h100.get_by_role("button", name="Save pool h100").click()
    page.get_by_role("status").filter(has_text="Saved pool h100 in the draft.").wait_for()
    page.get_by_role("status").filter(has_text="Valid: the draft can be provisioned.").wait_for()
    assert page.locator("details[data-item='pools:h100']").evaluate("element => element.open")  # still open
    screenshot(page, "configuration-pool-form")
    draft = json.loads(page.get_by_label("Draft configuration (JSON)").input_value())
    assert next(pool for pool in draft["pools"] if pool["name"] == "h100")["capacity_gpus"] == 12

    spot = adder(page, "pools")
    spot.get_by_label("Name", exact=True).fill("spot")
    spot.get_by_label("Environment").select_option("neocloud")
    spot.get_by_label("GPUs", exact=True).fill("4")
    spot.get_by_label("GPU class").fill("L40S")
    spot.get_by_role("button", name="Add pool").click()
    page.get_by_role("status").filter(has_text="Saved pool spot in the draft.").wait_for()

    profile = adder(page, "profiles")
    profile.get_by_label("Name", exact=True).fill("one-spot")
    profile.get_by_label("Display name").fill("1 GPU, spot")
    profile.get_by_label("Pools, in order").fill("spot, baremetal")
    profile.get_by_label("GPUs", exact=True).fill("1")
    profile.get_by_role("button", name="Add profile").click()
    page.get_by_role("status").filter(has_text="Saved profile one-spot in the draft.").wait_for()

    dev = item(page, "policies:dev")
    dev.get_by_label("Profile of a new compute resource").select_option("one-spot")
    dev.get_by_label("Name of a new compute resource").fill("Dev: spot GPU")
    dev.get_by_label("Limit (GPUs)").fill("20")
    dev.get_by_role("button", name="Save policy dev").click()
    page.get_by_role("status").filter(has_text="Saved policy dev in the draft.").wait_for()
    screenshot(page, "configuration-forms")

    item(page, "pools:spot").get_by_role("button", name="Remove pool spot").click()
    page.get_by_role("status").filter(has_text="Removed pool spot from the draft.").wait_for()
    report = page.locator("#report").inner_text()
    assert "Not valid" in report
    assert "spot" in report
    page.get_by_role("button", name="Provision").click()
    page.locator("#report").get_by_role("alert").wait_for()
    assert portal.run(lambda: Pool.objects.filter(name="spot").exists()) is False

    spot = adder(page, "pools")
    spot.get_by_label("Name", exact=True).fill("spot")
    spot.get_by_label("GPUs", exact=True).fill("4")
    spot.get_by_role("button", name="Add pool").click()
    page.get_by_role("status").filter(has_text="Valid: the draft can be provisioned.").wait_for()
    page.get_by_role("button", name="Provision").click()
    page.get_by_role("status").filter(has_text="Provisioned:").wait_for()
    assert page.get_by_role("row").filter(has_text="dev").locator(".limit").inner_text() == "20 GPUs"

    def provisioned() -> tuple[int, list[str]]:
        spot_pool = Pool.objects.get(name="spot")
        names = sorted(ComputeResource.objects.filter(policy__name="dev").values_list("name", flat=True))
        return Pool.objects.get(name="h100").capacity_gpus + spot_pool.capacity_gpus, names

    assert portal.run(provisioned) == (16, ["Dev: 4 GPUs", "Dev: spot GPU"])
    assert portal.errors == []


def test_a_form_keeps_what_it_does_not_show() -> None:
    """Batch templates of a compute resource and a pool's execution priority survive a form save."""
    before = {
        "name": "hpc",
        "group": "research",
        "reservation_gpus": "0",
        "limit_gpus": "8",
        "compute_resources": [
            {"profile": "four-gpu", "name": "HPC", "batch": {"slurm": {"defaults": {"partition": "gpu"}}}}
        ],
    }
    form = QueryDict(mutable=True)
    form.update({"name": "hpc", "group": "research", "reservation_gpus": "2", "limit_gpus": "8"})
    form.setlist("resource_index", ["0", ""])
    form.setlist("resource_profile", ["four-gpu", ""])
    form.setlist("resource_name", ["HPC nodes", ""])
    form.setlist("resource_priority", ["5", "0"])
    after = policy_from(form, json.loads(json.dumps(before)))
    assert after["reservation_gpus"] == "2"
    assert after["compute_resources"] == [
        {
            "profile": "four-gpu",
            "name": "HPC nodes",
            "queuing_priority": 5,
            "batch": {"slurm": {"defaults": {"partition": "gpu"}}},
        }
    ]

    profile = {"name": "p", "gpus": "4", "pools": [{"pool": "a", "execution_priority": 3}, {"pool": "b"}]}
    form = QueryDict(mutable=True)
    form.update({"name": "p", "sharing": "whole", "pools": "b, a, c", "nodes": "2", "gpus_per_node": "4"})
    changed = profile_from(form, profile)
    assert changed["pools"] == [{"pool": "b"}, {"pool": "a", "execution_priority": 3}, {"pool": "c"}]
    assert "gpus" not in changed
    assert (changed["nodes"], changed["gpus_per_node"]) == (2, 4)


def test_nested_errors_read_as_paths() -> None:
    detail = {"pools": {1: {"capacity_gpus": ["A valid integer is required."]}}, "profiles": ["Bad."]}
    assert error_lines(detail) == ["pools[1].capacity_gpus: A valid integer is required.", "profiles: Bad."]
    assert error_lines({"policies": [{}, {"name": ["Required."]}]}) == ["policies[1].name: Required."]


def test_a_policy_form_keeps_a_group_and_a_profile_the_lists_do_not_have() -> None:
    """A draft may name a group not made yet, or a profile it lacks (the report says so): the form shows
    them selected rather than quietly putting the first choice in their place."""
    from django.template.loader import render_to_string

    policy = {
        "name": "later",
        "group": "not-made-yet",
        "reservation_gpus": "0",
        "limit_gpus": "4",
        "compute_resources": [{"profile": "gone", "name": "Later"}],
    }
    html = render_to_string(
        "portal/_policy_form.html",
        {"item": policy, "key": 1, "group_names": ["dev"], "profile_names": ["four-gpu"]},
    )
    assert "<option selected>not-made-yet</option>" in html
    assert "<option selected>gone</option>" in html


def seed_a_day_of_research() -> None:
    """Ten 4-GPU tasks of Research that ran two hours each, ten minutes apart, over the last day."""
    from datetime import timedelta

    from django.utils import timezone

    from apps.accounts.models import User
    from apps.resources.models import ComputeResource, Pool
    from apps.scheduling.models import Task

    resource = ComputeResource.objects.get(name="Research: 4 GPUs")
    start = timezone.now() - timedelta(days=1)
    for index in range(10):
        submitted = start + timedelta(minutes=10 * index)
        Task.objects.create(
            compute_resource=resource, compute_resource_name=resource.name,
            submitter=User.objects.get(username="pat"), size_units=4 * 840, state="completed",
            submitted_at=submitted, queued_at=submitted, started_at=submitted,
            ended_at=submitted + timedelta(hours=2), pool=Pool.objects.first(),
        )  # fmt: skip


def test_what_if_replays_the_last_days_against_the_draft_before_provisioning(
    page: Any, portal: Portal
) -> None:
    portal.run(seed_a_day_of_research)

    def draft_pools() -> list[int]:
        from apps.configuration.services import draft_get

        return [pool["capacity_gpus"] for pool in draft_get().document["pools"]]

    sign_in(page, portal)
    page.get_by_role("link", name="Configuration").click()
    document = json.loads(page.get_by_label("Draft configuration (JSON)").input_value())
    for pool in document["pools"]:
        pool["capacity_gpus"] = 4  # every pool halves: Research's waits grow
    page.get_by_label("Draft configuration (JSON)").fill(json.dumps(document, indent=2))
    saved = portal.run(draft_pools)

    days = page.get_by_label("Before provisioning: replay the last days of work against the draft")
    days.fill("0")
    assert days.evaluate("element => element.validity.valid") is False  # the browser says so first
    days.evaluate("element => { element.removeAttribute('min'); element.removeAttribute('max'); }")
    for wrong in ("0", "91"):  # and the server, to a request that did not come through the form's checks
        days.fill(wrong)
        page.get_by_role("button", name="What if?").click()
        alert = page.locator("#what-if").get_by_role("alert").filter(has_text=f"'{wrong}' was given")
        alert.wait_for()
        assert alert.inner_text() == f"Days of history is a whole number from 1 to 90; '{wrong}' was given."

    days.fill("2")
    page.get_by_role("button", name="What if?").click()
    page.locator("#what-if-teams").wait_for()
    assert (
        "Replayed 10 tasks of the last 2 days" in page.locator("#what-if").get_by_role("status").inner_text()
    )
    research = page.locator("#what-if-teams tr[data-team='research']")
    assert "(worse)" in research.inner_text()
    assert research.locator("td.worse").count() >= 1
    resource = page.locator("#what-if-resources tr[data-resource='Research: 4 GPUs']").locator("td")
    assert resource.first.inner_text() == "10 → 10"

    assert portal.run(draft_pools) == saved  # what the page showed was replayed, and nothing saved
    screenshot(page, "configuration-what-if")

    page.get_by_label("Draft configuration (JSON)").fill('{"pools": [')
    page.get_by_role("button", name="What if?").click()
    alert = page.locator("#what-if").get_by_role("alert").filter(has_text="not JSON")
    alert.wait_for()
    assert alert.inner_text().startswith("The draft is not JSON: ")
    page.get_by_label("Draft configuration (JSON)").fill('{"pools": [{"name": "x"}]}')
    page.get_by_role("button", name="What if?").click()
    alert = page.locator("#what-if").get_by_role("alert").filter(has_text="malformed")
    alert.wait_for()
    assert "pools[0]" in alert.inner_text()
    assert portal.errors == []

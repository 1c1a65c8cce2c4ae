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

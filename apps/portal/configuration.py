"""The portal's resource configuration: the draft as forms (a pool, a profile or a policy at a time) and as
one JSON document, both saved through the same draft service; validate shows the report inline, "what
if" replays the tenant's last days against the draft and the configuration in force (per team, compute
resource and queue-wait objective, side by side), and provision makes the draft the configuration.

A form changes only the fields it shows: what else an item holds (a compute resource's batch templates, a
profile's pool priorities) is kept. A form that does not make a well-formed draft saves nothing and says
what was wrong, keeping what was typed."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, QueryDict
from django.shortcuts import render
from django.views.decorators.http import require_POST

from apps.accounts.models import Group, User
from apps.configuration.services import (
    draft_get,
    draft_provision,
    draft_save,
    draft_simulate,
    draft_validate,
)
from apps.core.errors import InvalidInput, KliqueError, error_lines
from apps.portal.views import admin_only
from apps.resources.models import Environment, ResourcePolicy, SharingMethod, TaskSharing
from apps.scheduling.engine import describe, describe_seconds

SIZE_FIELDS = ("gpus", "nodes", "gpus_per_node", "min_gpus", "max_gpus", "mig_profile")
NOUN = {"pools": "pool", "profiles": "profile", "policies": "policy"}


def _whole(value: str | None) -> int | str:
    """A whole number as typed becomes a number; anything else is kept, for the draft's check to name."""
    text = (value or "").strip()
    return int(text) if text.isdigit() else text


def _optional(item: dict[str, Any], key: str, value: str | None, *, whole: bool = False) -> None:
    """Set key to what was typed, or leave it out (the document's default) when nothing was."""
    text = (value or "").strip()
    if text:
        item[key] = _whole(text) if whole else text
    else:
        item.pop(key, None)


def pool_from(form: QueryDict, item: dict[str, Any]) -> dict[str, Any]:
    item["name"] = form.get("name", "").strip()
    item["environment"] = form.get("environment", "")
    item["capacity_gpus"] = _whole(form.get("capacity_gpus"))
    item["sharing"] = form.getlist("sharing") or ["whole"]
    for key in ("gpu_class", "region"):
        _optional(item, key, form.get(key))
    for key in ("cost_tier", "heartbeat_timeout_seconds"):
        _optional(item, key, form.get(key), whole=True)
    return item


def profile_from(form: QueryDict, item: dict[str, Any]) -> dict[str, Any]:
    item["name"] = form.get("name", "").strip()
    item["sharing"] = form.get("sharing", TaskSharing.WHOLE)
    _optional(item, "display_name", form.get("display_name"))
    for key in SIZE_FIELDS:
        _optional(item, key, form.get(key), whole=key in ("nodes", "gpus_per_node"))
    kept = {entry.get("pool"): entry for entry in item.get("pools", []) if isinstance(entry, dict)}
    names = [name.strip() for name in form.get("pools", "").split(",") if name.strip()]
    item["pools"] = [kept.get(name, {"pool": name}) for name in names]  # in the order typed
    item["strict_fifo"] = form.get("strict_fifo") == "on"
    _optional(item, "starvation_seconds", form.get("starvation_seconds"), whole=True)
    return item


def policy_from(form: QueryDict, item: dict[str, Any]) -> dict[str, Any]:
    item["name"] = form.get("name", "").strip()
    item["group"] = form.get("group", "").strip()
    item["reservation_gpus"] = form.get("reservation_gpus", "").strip()
    item["limit_gpus"] = form.get("limit_gpus", "").strip()
    before = list(item.get("compute_resources", []))
    resources = []
    rows = zip(
        form.getlist("resource_index"),
        form.getlist("resource_profile"),
        form.getlist("resource_name"),
        form.getlist("resource_priority"),
        strict=False,
    )
    for index, profile, name, priority in rows:
        if not profile:
            continue  # a row without a profile is removed (or was the empty row for a new one)
        resource = dict(before[int(index)]) if index.isdigit() and int(index) < len(before) else {}
        resource.update(profile=profile, name=name.strip(), queuing_priority=_whole(priority or "0"))
        resources.append(resource)
    item["compute_resources"] = resources
    return item


SECTIONS: dict[str, Callable[[QueryDict, dict[str, Any]], dict[str, Any]]] = {
    "pools": pool_from,
    "profiles": profile_from,
    "policies": policy_from,
}


def _malformed(error: InvalidInput) -> str:
    return "The draft is not well formed, so nothing was saved: " + "; ".join(error_lines(error.errors))


def _policies() -> list[dict[str, Any]]:
    return [
        {
            "name": policy.name,
            "group": policy.group.name,
            "reservation": describe(policy.reservation_units),
            "limit": describe(policy.limit_units),
            "resources": ", ".join(resource.name for resource in policy.compute_resources.all()),
        }
        for policy in ResourcePolicy.objects.select_related("group").prefetch_related("compute_resources")
    ]


def _editor(document: dict[str, Any]) -> dict[str, Any]:
    """What the editor shows of a draft: each item's form, and the whole as JSON."""

    profiles = [
        {**profile, "pool_names": ", ".join(str(entry.get("pool", "")) for entry in profile.get("pools", []))}
        for profile in document.get("profiles", [])
    ]
    return {
        "document": json.dumps(document, indent=2),
        "pools": document.get("pools", []),
        "profiles": profiles,
        "policies": document.get("policies", []),
        "profile_names": [profile.get("name", "") for profile in document.get("profiles", [])],
        "group_names": list(Group.objects.order_by("name").values_list("name", flat=True)),
        "environments": Environment.values,
        "sharing_methods": SharingMethod.values,
        "task_sharing": TaskSharing.values,
    }


@admin_only
def configuration(request: HttpRequest) -> HttpResponse:
    """The draft configuration, as forms and as one document: edit, validate (the report inline),
    provision."""

    context = {**_editor(draft_get().document), "policies_in_force": _policies(), "page": "configuration"}
    return render(request, "portal/configuration.html", context)


def _refused(request: HttpRequest, message: str) -> HttpResponse:
    """A change that saved nothing: the message goes where the report is; the forms keep what was typed."""
    response = render(request, "portal/_report.html", {"error": message})
    response["HX-Retarget"] = "#report"
    response["HX-Reswap"] = "innerHTML"
    return response


def _save(request: HttpRequest, document: Any) -> HttpResponse | None:
    """Save `document` as the draft; the refusal to answer with when it is not well formed."""

    user = request.user
    assert isinstance(user, User)
    try:
        draft_save(tenant=request.tenant, user=user, document=document)  # type: ignore[attr-defined]
    except InvalidInput as error:
        return _refused(request, _malformed(error))
    return None


def _edited(
    request: HttpRequest, document: dict[str, Any], message: str = "", opened: str = ""
) -> HttpResponse:
    """The editor again, with the saved draft's report and what was done."""

    context = {**_editor(document), "report": draft_validate(), "message": message, "opened": opened}
    return render(request, "portal/_editor.html", context)


@admin_only
@require_POST
def item_save(request: HttpRequest, section: str) -> HttpResponse:
    """Save one pool, profile or policy into the draft from its form (HTMX): the editor again, with the
    draft's report and the item's form still open."""

    if section not in SECTIONS:
        raise Http404(section)
    document = copy.deepcopy(draft_get().document)
    items: list[dict[str, Any]] = document.setdefault(section, [])
    original = request.POST.get("original", "")
    index = next((i for i, item in enumerate(items) if item.get("name") == original), None)
    if original and index is None:
        return _refused(
            request,
            f"The {NOUN[section]} {original} is no longer in the draft; reload the page to see it now.",
        )
    item = SECTIONS[section](request.POST, copy.deepcopy(items[index]) if index is not None else {})
    if any(other.get("name") == item["name"] for i, other in enumerate(items) if i != index):
        return _refused(
            request, f"The draft already has a {NOUN[section]} named {item['name']}; choose another."
        )
    if index is None:
        items.append(item)
    else:
        items[index] = item
    refused = _save(request, document)
    noun, name = NOUN[section], item["name"]
    return refused or _edited(request, document, f"Saved {noun} {name} in the draft.", f"{section}:{name}")


@admin_only
@require_POST
def item_remove(request: HttpRequest, section: str) -> HttpResponse:
    """Take one pool, profile or policy out of the draft (HTMX)."""

    if section not in SECTIONS:
        raise Http404(section)
    document = copy.deepcopy(draft_get().document)
    name = request.POST.get("original", "")
    kept = [item for item in document.get(section, []) if item.get("name") != name]
    if len(kept) == len(document.get(section, [])):
        return _refused(request, f"The {NOUN[section]} {name} is no longer in the draft; reload the page.")
    document[section] = kept
    refused = _save(request, document)
    return refused or _edited(request, document, f"Removed {NOUN[section]} {name} from the draft.")


def _save_document(request: HttpRequest) -> tuple[dict[str, Any] | None, HttpResponse | None]:
    """Save the JSON document the page holds as the draft: (the document, None), or (None, the refusal)."""
    try:
        document = json.loads(request.POST.get("document", ""))
    except json.JSONDecodeError as error:
        where_ = f"line {error.lineno}, column {error.colno}"
        return None, _refused(request, f"The draft is not JSON: {error.msg} at {where_}; nothing was saved.")
    refused = _save(request, document)
    return (None, refused) if refused else (document, None)


@admin_only
@require_POST
def validate(request: HttpRequest) -> HttpResponse:
    """Save the draft as the JSON document shows it and report on it (HTMX): the editor again."""
    document, refused = _save_document(request)
    if refused is not None:
        return refused
    assert document is not None
    return _edited(request, document)


@admin_only
@require_POST
def provision(request: HttpRequest) -> HttpResponse:
    """Save the draft as the page shows it and make it the configuration (HTMX): the result, and the
    policies as they now are."""

    _, refused = _save_document(request)
    if refused is not None:
        return refused
    context: dict[str, Any] = {}
    user = request.user
    assert isinstance(user, User)
    try:
        done = draft_provision(tenant=request.tenant, user=user)  # type: ignore[attr-defined]
        made, gone = sum(done.created.values()), sum(done.deleted.values())
        context["message"] = f"Provisioned: {made} created, {gone} removed."
    except KliqueError as error:
        context["error"] = error.message
    context["policies_in_force"] = _policies()
    return render(request, "portal/_provisioned.html", context)


# -- what if -------------------------------------------------------------------------------------------

WHAT_IF_DAYS = (1, 90)


def _wait(seconds: float | None) -> str:
    return "-" if seconds is None else describe_seconds(seconds)


def _compared(old: float | None, new: float | None) -> dict[str, Any]:
    """A wait now and under the draft, and whether it grows (by more than a tenth and a minute) or
    shrinks as much: the page marks both, as `klique simulate` does."""
    worse = old is not None and new is not None and new > old * 1.1 + 60
    better = old is not None and new is not None and new < old * 0.9 - 60
    return {"current": _wait(old), "proposed": _wait(new), "worse": worse, "better": better}


def _side_by_side(
    rows: list[dict[str, Any]], proposed: list[dict[str, Any]], key: str
) -> list[tuple[Any, ...]]:
    after = {row[key]: row for row in proposed}
    before = {row[key]: row for row in rows}
    return [(name, before.get(name, {}), after.get(name, {})) for name in sorted(set(before) | set(after))]


def what_if_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The replay's result as the page shows it: each team's and compute resource's waits, and each
    objective's attainment, current beside draft, with what gets worse marked."""
    current, proposed = result["current"], result["proposed"]
    teams = [
        {
            "name": name,
            "waits": [
                _compared(old.get(f"wait_{p}_seconds"), new.get(f"wait_{p}_seconds"))
                for p in ("p50", "p95", "p99")
            ],
            "reservation_use": [_percent(old.get("reservation_use")), _percent(new.get("reservation_use"))],
            "borrowed": [old.get("borrowed_gpu_hours", 0), new.get("borrowed_gpu_hours", 0)],
            "preempted": [old.get("preemptions_suffered", 0), new.get("preemptions_suffered", 0)],
        }
        for name, old, new in _side_by_side(current["teams"], proposed["teams"], "policy")
    ]
    resources = [
        {
            "name": name,
            "started": [old.get("jobs_started", 0), new.get("jobs_started", 0)],
            "waits": [
                _compared(old.get(f"wait_{p}_seconds"), new.get(f"wait_{p}_seconds"))
                for p in ("p50", "p95", "p99")
            ],
        }
        for name, old, new in _side_by_side(current["resources"], proposed["resources"], "compute_resource")
    ]
    objectives = [
        {
            "name": name,
            "promise": f"p{old['percentile']:g} within {describe_seconds(old['target_seconds'])}",
            "value": _compared(old.get("value_seconds"), new.get("value_seconds")),
            "attainment": [_percent(old.get("attainment")), _percent(new.get("attainment"))],
            "met": [old.get("met"), new.get("met")],
            "missed": bool(old.get("met")) and new.get("met") is False,
        }
        for name, old, new in _side_by_side(current["objectives"], proposed["objectives"], "objective")
        if old
    ]
    overall = [
        ("Jobs finished", current["finished"], proposed["finished"]),
        ("Refused (no compute resource or too large)", current["refused"], proposed["refused"]),
        ("GPU utilization", _percent(current["gpu_utilization"]), _percent(proposed["gpu_utilization"])),
        ("Queue wait p50", _wait(current["wait_p50_seconds"]), _wait(proposed["wait_p50_seconds"])),
        ("Queue wait p95", _wait(current["wait_p95_seconds"]), _wait(proposed["wait_p95_seconds"])),
        ("Preemptions", current["preemptions"], proposed["preemptions"]),
    ]
    return {"jobs": result["jobs"], "overall": overall, "teams": teams, "resources": resources,
            "objectives": objectives}  # fmt: skip


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


@admin_only
@require_POST
def what_if(request: HttpRequest) -> HttpResponse:
    """Replay the tenant's last N days against the draft as the page shows it (saved or not: nothing is
    saved) and against the configuration in force (HTMX): the figures side by side, before anything is
    provisioned."""
    low, high = WHAT_IF_DAYS
    days = request.POST.get("days", "").strip()
    if not days.isdigit() or not low <= int(days) <= high:
        return _refused_what_if(
            request, f"Days of history is a whole number from {low} to {high}; {days!r} was given."
        )
    try:
        document = json.loads(request.POST.get("document", ""))
    except json.JSONDecodeError as error:
        where_ = f"line {error.lineno}, column {error.colno}"
        return _refused_what_if(request, f"The draft is not JSON: {error.msg} at {where_}.")
    try:
        result = draft_simulate(days=int(days), trace=None, interval=60.0, document=document).as_dict()
    except KliqueError as error:
        return _refused_what_if(request, error.message)
    return render(request, "portal/_what_if.html", {"days": int(days), **what_if_figures(result)})


def _refused_what_if(request: HttpRequest, message: str) -> HttpResponse:
    return render(request, "portal/_what_if.html", {"error": message})

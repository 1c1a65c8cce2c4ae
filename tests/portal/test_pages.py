"""The portal's other pages in real Chromium: queues and what a person may use, tokens (shown once,
revoked), write-only secrets, gateway usage; each control labelled, no console errors."""

from __future__ import annotations

from typing import Any

import pytest

from tests.portal.conftest import Portal, screenshot, sign_in, wait_for
from tests.portal.test_portal import UNLABELLED

pytestmark = pytest.mark.django_db


def visit(page: Any, portal: Portal, link: str) -> None:
    sign_in(page, portal)
    page.get_by_role("navigation", name="Portal").get_by_role("link", name=link).click()
    assert page.evaluate(UNLABELLED) == []


def test_queues_show_what_a_person_may_use_and_each_queue(page: Any, portal: Portal) -> None:
    visit(page, portal, "Queues")
    research = page.locator("tr[data-policy='research']")
    assert "research" in research.inner_text()
    cells = research.locator("td").all_inner_texts()
    assert cells[2:4] == ["8 GPUs", "12 GPUs"] or cells[2:4] == [
        "8 GPUs",
        "16 GPUs",
    ]  # (another test may change it)
    assert "Research: 4 GPUs" in cells[6]
    queue = page.locator("tr[data-queue='Research: 4 GPUs']")
    assert queue.locator("td").nth(1).inner_text() == "yes"
    screenshot(page, "queues")
    assert portal.errors == []


def test_a_token_is_shown_once_and_revoked(page: Any, portal: Portal) -> None:
    visit(page, portal, "Tokens")
    page.get_by_label("Name", exact=True).fill("notebook")
    page.get_by_label("Scope").select_option("read")
    page.get_by_role("button", name="Create token").click()
    page.get_by_role("status").filter(has_text="Token notebook created").wait_for()
    secret = page.locator("#token-made pre.token").inner_text()
    assert secret.startswith("klq_")
    row = page.locator("tr[data-token='notebook']")
    assert secret not in row.inner_text()  # only its prefix is listed
    screenshot(page, "tokens")
    page.on("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Revoke notebook").click()
    page.locator("tr[data-token='notebook']").filter(has_text="revoked").wait_for()
    page.reload()
    assert secret not in page.content()  # shown that once, never again
    assert portal.errors == []


def test_a_secret_is_kept_and_never_shown(page: Any, portal: Portal) -> None:
    visit(page, portal, "Secrets")
    page.get_by_label("Name (as an environment variable").fill("WANDB_API_KEY")
    page.get_by_label("Value").fill("wandb-value-that-must-not-leak")
    page.get_by_role("button", name="Keep it").click()
    page.get_by_role("status").filter(has_text="Kept WANDB_API_KEY (user)").wait_for()
    assert page.locator("tr[data-secret='WANDB_API_KEY']").is_visible()
    assert page.get_by_label("Value").input_value() == ""
    page.get_by_label("Name (as an environment variable").fill("CUDA_VISIBLE_DEVICES")
    page.get_by_label("Value").fill("0")
    page.get_by_role("button", name="Keep it").click()
    page.get_by_role("alert").wait_for()
    assert "CUDA_VISIBLE_DEVICES" in page.get_by_role("alert").inner_text()
    page.reload()
    assert "wandb-value-that-must-not-leak" not in page.content()
    screenshot(page, "secrets")
    assert portal.errors == []


def test_gateway_usage_lists_calls_and_budgets(page: Any, portal: Portal) -> None:
    from datetime import UTC, datetime

    from apps.accounts.models import User
    from gateway.models import Usage
    from gateway.services import budget_create

    def seed() -> None:
        pat = User.objects.get(username="pat")
        call = {
            "at": datetime.now(UTC),
            "user_id": pat.pk,
            "username": "pat",
            "endpoint": "chat.completions",
            "model": "chat",
            "tokens_in": 11,
            "tokens_out": 22,
            "cost_nano_usd": 5,
        }
        Usage.objects.get_or_create(request_id="kqr-portal-1", defaults=call)
        budget_create(scope="user", user="pat", unit="tokens", limit=1000, period="day")

    portal.run(seed)
    visit(page, portal, "Gateway")
    assert "pat's daily budget" in page.get_by_role("table").first.inner_text()
    calls = page.get_by_role("table").nth(1).inner_text()
    assert "chat" in calls
    assert "22" in calls
    screenshot(page, "gateway-usage")
    assert portal.errors == []


def test_an_admin_creates_a_service_account_with_its_first_token(page: Any, portal: Portal) -> None:
    visit(page, portal, "Service accounts")
    page.get_by_label("Name", exact=True).fill("nightly-ci")
    page.get_by_label("What it is for").fill("the nightly evaluation")
    page.get_by_role("button", name="Create service account").click()
    page.get_by_role("status").filter(has_text="Service account nightly-ci created").wait_for()
    assert page.locator("#account-made pre.token").inner_text().startswith("klq_")
    row = page.locator("tr[data-account='nightly-ci']").locator("td").all_inner_texts()
    assert row == ["nightly-ci", "member", "the nightly evaluation", "1"]
    screenshot(page, "service-accounts")
    assert portal.errors == []


def test_a_task_is_cancelled_from_its_page_and_its_state_follows(page: Any, portal: Portal) -> None:
    from apps.accounts.models import User
    from apps.scheduling.services import TaskRequest, tasks_submit
    from tenants.models import Tenant

    def submit() -> str:
        tenant = Tenant.objects.get(schema_name="portal")
        pat = User.objects.get(username="pat")
        (task,) = tasks_submit(
            tenant=tenant, user=pat, requests=[TaskRequest(compute_resource="Dev: 4 GPUs", name="to-cancel")]
        )
        return str(task.pk)

    task_id = portal.run(submit)
    sign_in(page, portal)
    page.goto(f"{portal.base}/portal/tasks/{task_id}/")
    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel task").click()
    page.locator("#state").filter(has_text="aborted").wait_for()
    # The facts are fetched again at each task event: the reason can come with a later one than the state.
    page.locator("#facts").filter(has_text="Cancelled by pat.").wait_for(timeout=10_000)
    assert page.get_by_role("button", name="Cancel task").count() == 0  # nothing left to cancel
    assert portal.errors == []


def test_the_agents_acting_for_a_person_show_what_they_spent_and_are_revoked(
    page: Any, portal: Portal
) -> None:
    from datetime import UTC, datetime

    from apps.accounts.models import ApiToken
    from gateway.models import Usage
    from gateway.services import meter_calls

    visit(page, portal, "Tokens")
    page.get_by_label("Name", exact=True).fill("helper-token")
    page.get_by_label("Scope").select_option("submit")
    page.get_by_label("For an AI agent").fill("bad;agent")
    page.get_by_role("button", name="Create token").click()
    page.get_by_role("alert").wait_for()  # the API's own check of an agent's name
    assert "Agent:" in page.get_by_role("alert").inner_text()
    page.get_by_label("For an AI agent").fill("helper")
    page.get_by_label("The agent's GPU quota").fill("2")
    page.get_by_role("button", name="Create token").click()
    page.get_by_role("status").filter(has_text="Token helper-token created").wait_for()

    def called() -> None:
        token = ApiToken.objects.get(name="helper-token")
        Usage.objects.get_or_create(
            request_id="kqr-portal-agent-1",
            defaults={"at": datetime.now(UTC), "user_id": token.user_id, "username": "pat",
                      "token_prefix": token.prefix, "agent": "helper", "endpoint": "chat.completions",
                      "model": "chat", "tokens_in": 30, "tokens_out": 12},
        )  # fmt: skip
        meter_calls()

    portal.run(called)
    page.get_by_role("navigation", name="Portal").get_by_role("link", name="Agents").click()
    assert page.evaluate(UNLABELLED) == []
    row = page.locator("tr[data-agent='helper']")
    cells = row.locator("td").all_inner_texts()
    assert cells[2:5] == ["submit", "2", "0 (0)"]
    assert cells[7] == "42 (1)"  # gateway tokens in and out, one call
    screenshot(page, "agents")
    page.on("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Revoke helper").click()
    page.get_by_role("status").filter(has_text="Revoked agent helper").wait_for()
    assert "revoked" in page.locator("tr[data-agent='helper']").inner_text()
    assert portal.run(lambda: ApiToken.objects.get(name="helper-token").revoked_at) is not None
    assert portal.errors == []


def seed_an_objective_with_a_week_of_samples() -> str:
    """research-p95 (p95 within an hour over 7 days), measured in three past hours and now: one hour with
    nothing measured in between (a gap), and a task waiting past the target."""
    from datetime import timedelta

    from django.utils import timezone

    from apps.scheduling.models import WaitObjective, WaitObjectiveSample
    from apps.scheduling.objectives import objective_save

    WaitObjective.objects.filter(name="research-p95").delete()
    objective = objective_save(
        name="research-p95", policy="research", percentile=95, target_seconds=3600, window_seconds=7 * 86_400
    )
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    for back, value, attained in ((4, 1200.0, 1.0), (3, 2400.0, 0.97), (1, 4800.0, 0.9)):
        WaitObjectiveSample.objects.create(
            objective=objective, hour=hour - timedelta(hours=back), value_seconds=value, target_seconds=3600,
            attainment=attained, error_budget_left=max(0.0, 1 - (1 - attained) / 0.05), state="ok",
        )  # fmt: skip
    return str(objective.pk)


def test_the_dashboard_shows_each_objective_with_its_trend(page: Any, portal: Portal) -> None:
    portal.run(seed_an_objective_with_a_week_of_samples)
    sign_in(page, portal)
    page.get_by_role("link", name="Dashboard").click()
    row = page.locator("tr[data-objective='research-p95']")
    assert "p95 within 1 h over 7 d" in row.inner_text()
    assert "policy research" in row.inner_text()
    assert "(target 1 h)" in row.locator(".value").inner_text()
    assert "(goal 95%)" in row.locator(".attainment").inner_text()
    canvas = "document.querySelector('canvas[data-trend]')"
    wait_for(page, f"{canvas} && {canvas}.chart !== undefined")
    measured = page.evaluate(f"{canvas}.chart.data.datasets[0].data")
    target = page.evaluate(f"{canvas}.chart.data.datasets[1].data")
    assert len(measured) == 7 * 24
    assert measured[-5:-1] == [20.0, 40.0, None, 80.0]  # minutes, with the unmeasured hour a gap
    assert target[-5] == 60.0
    screenshot(page, "dashboard-objectives")
    assert portal.errors == []


def test_the_queues_page_shows_what_each_policy_promises(page: Any, portal: Portal) -> None:
    portal.run(seed_an_objective_with_a_week_of_samples)
    visit(page, portal, "Queues")
    row = page.locator("tr[data-policy-objective='research/research-p95']")
    cells = row.locator("td").all_inner_texts()
    assert cells[0] == "research"
    assert "p95 within 1 h over 7 d" in cells[1]
    assert "(target 1 h)" in cells[3]
    assert cells[6] in ("ok", "at_risk", "breached")
    assert portal.errors == []

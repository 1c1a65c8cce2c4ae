"""An app's stable address, https://<tenant>/apps/<id>/: who asks is checked with the portal's session,
then sent on to the app's own host with a one-time ticket (apps.catalogue.addresses says why a host of
its own). A stopped app's address says so and offers to start it; a starting one says what it waits for."""

from __future__ import annotations

import json
from urllib.parse import quote, urlencode

from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from apps.accounts.models import User
from apps.catalogue import addresses, selectors, services, slurm, tickets
from apps.catalogue.models import AppInstance
from apps.core.errors import KliqueError
from apps.fleet import credentials
from apps.fleet import errors as fleet_errors
from apps.scheduling.models import Task


def _reachable(request: HttpRequest, app_id: str) -> AppInstance | HttpResponse:
    user = request.user
    if not isinstance(user, User) or not user.is_active:
        return HttpResponseRedirect(f"/portal/sign-in/?next={quote(request.path)}")
    app = AppInstance.objects.select_related("task", "project").filter(pk=app_id).first()
    if app is None or not selectors.can_reach(user, app):
        raise Http404("No such app.")
    return app


@require_http_methods(["GET", "POST"])
def address(request: HttpRequest, app_id: str, rest: str = "") -> HttpResponse:
    """GET: on to the app; POST (the form of a stopped app's page): start it again."""
    if request.method == "POST":
        return _start(request, app_id)
    app = _reachable(request, app_id)
    if isinstance(app, HttpResponse):
        return app
    state = selectors.app_state(app)
    if state.state in (selectors.STOPPED, selectors.STOPPING, selectors.STARTING):
        status = 503 if state.state != selectors.STOPPED else 409
        return render(request, "portal/app_state.html", {"app": app, "state": state}, status=status)
    if request.session.session_key is None:
        request.session.save()
    ticket = tickets.ticket(session_key=str(request.session.session_key), app_id=str(app.pk))
    query = urlencode({"ticket": ticket, "next": "/" + rest})
    host = addresses.app_host(app.slug, request.get_host())
    return HttpResponseRedirect(f"{request.scheme}://{host}/_klique/enter?{query}")


def _start(request: HttpRequest, app_id: str) -> HttpResponse:
    app = _reachable(request, app_id)
    if isinstance(app, HttpResponse):
        return app
    assert isinstance(request.user, User)
    try:
        services.app_start(tenant=request.tenant, user=request.user, app=app)  # type: ignore[attr-defined]
    except KliqueError as error:
        state = selectors.app_state(app)
        context = {"app": app, "state": state, "error": error.message}
        return render(request, "portal/app_state.html", context, status=error.status_code)
    return HttpResponseRedirect(f"/apps/{app.pk}/")


def _slurm_controller(request: HttpRequest, task_id: str) -> Task | JsonResponse:
    """The controller task whose run's token the request carries, locked; else the answer refusing it."""
    tenant = getattr(request, "tenant", None)
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if (
        tenant is None
        or scheme.lower() != "bearer"
        or not presented.startswith(f"{credentials.TASK_TOKEN_KIND}_")
    ):
        return JsonResponse(
            {"detail": "Send 'Authorization: Bearer <the controller run's task token>'."}, status=401
        )
    try:
        return credentials.task_authenticate(
            schema_name=tenant.schema_name, presented=presented.strip(), task_id=str(task_id)
        )
    except fleet_errors.AgentRejected as rejected:
        return JsonResponse({"detail": str(rejected)}, status=403)


@csrf_exempt
@require_http_methods(["GET", "POST"])
@transaction.atomic
def slurm_workers(request: HttpRequest, task_id: str) -> HttpResponse:
    """/agents/v1/tasks/{id}/slurm/, with the controller run's task token (apps.catalogue.slurm): POST, a
    Slurm cluster's resume or suspend program asks for its nodes, {"resume": "<host list>"} or
    {"suspend": "<host list>"}; GET, its reconciler reads which nodes have a worker task now, as text
    (names separated by spaces, for the shell). Outside the user API on purpose: the token opens this and
    its task's reports, nothing else."""
    controller = _slurm_controller(request, task_id)
    if isinstance(controller, JsonResponse):
        return controller
    if request.method == "GET":
        try:
            live = slurm.workers_live(controller=controller)
        except KliqueError as error:
            return JsonResponse({"detail": error.message}, status=error.status_code)
        return HttpResponse(" ".join(live), content_type="text/plain")
    try:
        body = json.loads(request.body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if (
        not isinstance(body, dict)
        or not body.keys() & {"resume", "suspend"}
        or body.keys() - {"resume", "suspend"}
    ):
        return JsonResponse(
            {"detail": 'Send {"resume": "<host list>"} or {"suspend": "<host list>"}.'}, status=400
        )
    try:
        changed = slurm.workers_change(
            tenant=request.tenant,  # type: ignore[attr-defined]
            controller=controller,
            resume=body.get("resume"),
            suspend=body.get("suspend"),
        )
    except KliqueError as error:
        return JsonResponse({"detail": error.message}, status=error.status_code)
    status = 409 if changed.refused and not (changed.made or changed.kept or changed.ended) else 200
    return JsonResponse(changed.as_json(), status=status)

"""Agent tokens (tenant admins) and what tasks wrote: logs, metrics and outputs (their submitter, their
project's members and tenant admins: apps.scheduling.selectors.may_read_output)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from django.core.files.storage import default_storage
from django.db import transaction
from django.http import FileResponse, HttpRequest, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.api_base import TenantAPIView
from apps.accounts.models import Role, User
from apps.accounts.selectors import project_list
from apps.core.ids import as_uuid
from apps.fleet import buckets, cloud, credentials, dispatch, errors, outputs, selectors
from apps.fleet.models import AgentToken, CloudInstance, OutputDestination, TaskOutput
from apps.metering.selectors import instance_hours_text, instance_time, usd_text
from apps.resources.models import Pool
from apps.scheduling import runs
from apps.scheduling.models import Task, TaskRun
from apps.scheduling.selectors import may_read_output, output_readers, tasks_visible_to
from protocol import cloud as protocol_cloud
from protocol import outputs as protocol_outputs
from protocol.messages import ProtocolError

if TYPE_CHECKING:
    from tenants.models import Tenant


class AgentTokenOut(serializers.ModelSerializer[AgentToken]):
    pool = serializers.CharField(source="pool.name")
    prefix = serializers.SerializerMethodField()

    class Meta:
        model = AgentToken
        fields = [
            "id", "name", "pool", "prefix", "created_at", "revoked_at", "last_used_at", "bound_agent_id",
            "bound_at", "conflict_at", "conflict",
        ]  # fmt: skip

    def get_prefix(self, token: AgentToken) -> str:
        return f"kqa_{token.prefix}"


class AgentTokenIn(serializers.Serializer[AgentToken]):
    name = serializers.CharField(max_length=100)


class PoolAgentTokensView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses=AgentTokenOut(many=True), summary="The pool's agent tokens")
    def get(self, request: Request, pool_id: str) -> Response:
        pool = get_object_or_404(Pool, pk=pool_id)
        return self.page(AgentToken.objects.filter(pool=pool).select_related("pool"), AgentTokenOut)

    @extend_schema(
        request=AgentTokenIn, responses={201: AgentTokenOut}, summary="Issue an agent token (shown once)"
    )
    def post(self, request: Request, pool_id: str) -> Response:
        pool = get_object_or_404(Pool, pk=pool_id)
        data = AgentTokenIn(data=request.data)
        data.is_valid(raise_exception=True)
        issued = credentials.agent_token_create(pool=pool, name=data.validated_data["name"])
        body = {**AgentTokenOut(issued.token).data, "token": issued.secret}
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})


class AgentTokenDetailView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(responses={204: None}, summary="Revoke an agent token; its agent is refused from then on")
    def delete(self, request: Request, token_id: str) -> Response:
        credentials.agent_token_revoke(tenant=self.tenant, token=get_object_or_404(AgentToken, pk=token_id))
        return Response(status=status.HTTP_204_NO_CONTENT)


def _after(request: Request) -> int:
    """The ?after= cursor: the `cursor` of the last chunk or metric the caller has read."""
    try:
        return int(request.query_params.get("after", 0))
    except ValueError:
        raise serializers.ValidationError(
            {"after": ["The cursor of the last item read, a number."]}
        ) from None


def _readable_task(user: User, task_id: str) -> Task:
    task = get_object_or_404(tasks_visible_to(user), pk=task_id)
    if not may_read_output(user, task):
        raise PermissionDenied(output_readers(task))
    return task


class TaskLogsView(TenantAPIView):
    @extend_schema(summary="The task's output, in order; ?after=CURSOR for what came since")
    def get(self, request: Request, task_id: str) -> Response:
        task = _readable_task(self.user, task_id)
        return Response(selectors.task_logs(task, after=_after(request)))


class TaskMetricsView(TenantAPIView):
    @extend_schema(summary="The task's metrics as its nodes reported them; ?after=CURSOR for what came since")
    def get(self, request: Request, task_id: str) -> Response:
        task = _readable_task(self.user, task_id)
        return Response(selectors.task_metrics(task, after=_after(request)))


class TaskOutputOut(serializers.ModelSerializer[TaskOutput]):
    location = serializers.SerializerMethodField(help_text='"plane", or the s3:// address of the object')

    class Meta:
        model = TaskOutput
        fields = ["name", "size", "sha256", "at", "location"]

    def get_location(self, output: TaskOutput) -> str:
        if output.destination is None:
            return protocol_outputs.PLANE
        return f"s3://{output.destination.bucket}/{output.stored}"


class OutputDestinationIo(serializers.Serializer[OutputDestination]):
    store = serializers.ChoiceField(choices=protocol_outputs.STORES, help_text="plane (the default) or s3")
    bucket = serializers.CharField(required=False, max_length=63)
    prefix = serializers.CharField(required=False, max_length=200, allow_blank=True, default="")
    region = serializers.CharField(required=False, max_length=60)
    endpoint = serializers.CharField(
        required=False, max_length=300, allow_blank=True, default="", help_text="empty for AWS S3"
    )
    access_key_secret = serializers.CharField(
        required=False, max_length=128, help_text="a vault secret's name"
    )
    secret_key_secret = serializers.CharField(
        required=False, max_length=128, help_text="a vault secret's name"
    )
    created_by = serializers.CharField(read_only=True)
    created_at = serializers.DateTimeField(read_only=True)

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data["store"] == protocol_outputs.S3:
            missing = [
                key
                for key in ("bucket", "region", "access_key_secret", "secret_key_secret")
                if not data.get(key)
            ]
            if missing:
                raise serializers.ValidationError({key: ["An s3 store needs it."] for key in missing})
        return data


def _destination_out(destination: OutputDestination | None) -> dict[str, Any]:
    if destination is None:
        return {"store": protocol_outputs.PLANE}
    fields = (
        "bucket",
        "prefix",
        "region",
        "endpoint",
        "access_key_secret",
        "secret_key_secret",
        "created_by",
    )
    return {
        "store": protocol_outputs.S3,
        **{field: getattr(destination, field) for field in fields},
        "created_at": destination.created_at,
    }


class ProjectOutputsView(TenantAPIView):
    """Where a project's task outputs go: the plane's file store, or a bucket in its region."""

    write_role = Role.VIEWER  # project admins; checked per project

    @extend_schema(responses=OutputDestinationIo, summary="Where the project's outputs go")
    def get(self, request: Request, project_id: str) -> Response:
        project = get_object_or_404(project_list(), pk=project_id)
        return Response(_destination_out(buckets.current(project)))

    @extend_schema(
        request=OutputDestinationIo, responses=OutputDestinationIo, summary="Send outputs elsewhere"
    )
    def put(self, request: Request, project_id: str) -> Response:
        project = get_object_or_404(project_list(), pk=project_id)
        data = OutputDestinationIo(data=request.data)
        data.is_valid(raise_exception=True)
        asked = None
        if data.validated_data["store"] == protocol_outputs.S3:
            fields = {key: value for key, value in data.validated_data.items() if key != "store"}
            asked = buckets.Destination(**fields)
        destination = buckets.destination_set(user=self.user, project=project, asked=asked)
        return Response(_destination_out(destination))


class TaskOutputListView(TenantAPIView):
    @extend_schema(responses=TaskOutputOut(many=True), summary="The files the task left as outputs")
    def get(self, request: Request, task_id: str) -> Response:
        task = _readable_task(self.user, task_id)
        return Response(TaskOutputOut(selectors.task_outputs(task), many=True).data)


class TaskOutputDownloadView(TenantAPIView):
    @extend_schema(responses={(200, "application/octet-stream"): bytes}, summary="Download one output")
    def get(self, request: Request, task_id: str, name: str) -> FileResponse | HttpResponseRedirect:
        task = _readable_task(self.user, task_id)
        output = selectors.task_output(task, name)
        if output is None:
            raise NotFound(f"Task {task.pk} has no output {name!r} in its latest run.")
        if output.destination is not None:  # in the project's bucket: the reader fetches it from there
            url = buckets.download_url(
                output.destination, output.stored, PurePosixPath(output.name).name, reader=self.user.username
            )
            return HttpResponseRedirect(url)
        try:
            stored = default_storage.open(output.stored, "rb")
        except OSError:
            raise NotFound(
                f"Output {output.name} is listed but its file is gone from the plane's store; ask an "
                "administrator to check KLIQUE_FILES_DIR."
            ) from None
        return FileResponse(stored, as_attachment=True, filename=output.name)


def _bearer(request: HttpRequest) -> str | None:
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    return presented.strip() if scheme.lower() == "bearer" and presented.strip() else None


class StaleUpload(errors.AgentRejected):
    """An upload for a run that is not the task's current run: dropped, not retried (409)."""


def _uploader_task(tenant: Tenant, presented: str, task_id: str, lease: str) -> Task:
    """The task an agent token (its pool's tasks, under the run's lease) or a task token (that task's
    current run) may write outputs of."""
    if presented.startswith(f"{credentials.TASK_TOKEN_KIND}_"):
        return credentials.task_authenticate(
            schema_name=tenant.schema_name, presented=presented, task_id=task_id
        )
    token = credentials.agent_authenticate(presented=presented)
    task = selectors.pool_task(task_id, token.pool)
    if task is None:
        raise errors.AgentRejected(f"Task {task_id} is not in pool {token.pool.name}.")
    identifier = as_uuid(lease)
    run = TaskRun.objects.filter(pk=identifier, task=task).first() if identifier is not None else None
    # The task's current run, or a run given up that its agent is bringing back (uploads may come before
    # its hello): the same lease, nothing run since.
    if run is None or not (runs.is_current(task, run) or runs.reclaimable(task, run)):
        raise StaleUpload(
            f"Lease {lease or '(none sent)'} is not the current run of task {task_id} ({task.state}): "
            "its outputs are not kept. Send the run's lease in X-Klique-Lease."
        )
    return task


@csrf_exempt
@transaction.atomic
def agent_output_upload(request: HttpRequest, task_id: str, name: str) -> JsonResponse:
    """PUT /agents/v1/tasks/{id}/outputs/{name}: an agent, or an HPC job's node reporter with its task
    token, uploads a task's output. Outside the user API on purpose: these tokens open nothing else."""
    if request.method != "PUT":
        return JsonResponse({"detail": "Upload an output with PUT."}, status=405)
    tenant, presented = getattr(request, "tenant", None), _bearer(request)
    if tenant is None or presented is None:
        return JsonResponse({"detail": "Send 'Authorization: Bearer <agent or task token>'."}, status=401)
    lease = request.headers.get("X-Klique-Lease", "")
    try:
        task = _uploader_task(tenant, presented, str(task_id), lease)
        output = outputs.output_store(
            tenant=tenant,
            task=task,
            name=name,
            content=request,
            sha256=request.headers.get("X-Klique-Sha256", ""),
        )
    except errors.AgentRejected as rejected:
        return _refused(rejected)
    return JsonResponse(TaskOutputOut(output).data, status=201)


def _claim(request: HttpRequest) -> protocol_outputs.Claim:
    try:
        return protocol_outputs.Claim.from_json(json.loads(request.body or b"{}"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProtocolError('Send {"sha256": "<hex>", "size": <bytes>} as JSON.') from None


def _output_call(
    request: HttpRequest,
    task_id: str,
    act: Callable[[Task, protocol_outputs.Claim], dict[str, Any]],
    answer: int = 200,
) -> JsonResponse:
    """An agent's (or a node reporter's) call about one output of the task's current run."""
    if request.method != "POST":
        return JsonResponse({"detail": "Use POST."}, status=405)
    tenant, presented = getattr(request, "tenant", None), _bearer(request)
    if tenant is None or presented is None:
        return JsonResponse({"detail": "Send 'Authorization: Bearer <agent or task token>'."}, status=401)
    try:
        claim = _claim(request)
        task = _uploader_task(tenant, presented, str(task_id), request.headers.get("X-Klique-Lease", ""))
        return JsonResponse(act(task, claim), status=answer)
    except (ProtocolError, errors.AgentRejected) as refused:
        return _refused(refused)


def _refused(refused: Exception) -> JsonResponse:
    """An output call refused, as the agent reads it: 409 stale (dropped), OutputNotStored's own status
    (retried or not), 400 for what was sent, 403 for who sent it."""
    if isinstance(refused, StaleUpload):
        return JsonResponse({"detail": str(refused), "verdict": "stale"}, status=409)
    if isinstance(refused, errors.OutputNotStored):
        return JsonResponse({"detail": str(refused)}, status=refused.status)
    bad_input = isinstance(refused, ProtocolError) or "output" in str(refused)
    return JsonResponse({"detail": str(refused)}, status=400 if bad_input else 403)


@csrf_exempt
@transaction.atomic
def agent_output_ticket(request: HttpRequest, task_id: str, name: str) -> JsonResponse:
    """POST /agents/v1/tasks/{id}/output-tickets/{name}: where to store this output (protocol/outputs.py)."""
    return _output_call(
        request,
        task_id,
        lambda task, claim: outputs.output_ticket(task=task, name=name, claim=claim).to_json(),
    )


@csrf_exempt
@transaction.atomic
def agent_output_receipt(request: HttpRequest, task_id: str, name: str) -> JsonResponse:
    """POST /agents/v1/tasks/{id}/output-receipts/{name}: the output is in the project's bucket; keep it
    listed once the bucket shows it as claimed."""
    return _output_call(
        request,
        task_id,
        lambda task, claim: dict(
            TaskOutputOut(outputs.output_receipt(task=task, name=name, claim=claim)).data
        ),
        answer=201,
    )


MAX_REPORTS_PER_POST = 1000


@csrf_exempt
@transaction.atomic
def agent_reports_post(request: HttpRequest, task_id: str) -> JsonResponse:
    """POST /agents/v1/tasks/{id}/reports/: an HPC job's node reporter sends what its node saw, with the
    task's token: {"reports": [{"type": "log"|"status"|"metric", "source": "node-<rank>", "seq": n, ...}]}.
    Each (source, seq) is kept once, so a retried post counts once. Results come from the agent only."""
    if request.method != "POST":
        return JsonResponse({"detail": "Send reports with POST."}, status=405)
    tenant, presented = getattr(request, "tenant", None), _bearer(request)
    if tenant is None or presented is None or not presented.startswith(f"{credentials.TASK_TOKEN_KIND}_"):
        return JsonResponse({"detail": "Send 'Authorization: Bearer <the task token>'."}, status=401)
    try:
        reports = json.loads(request.body or b"{}").get("reports")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        reports = None
    if not isinstance(reports, list) or len(reports) > MAX_REPORTS_PER_POST:
        return JsonResponse(
            {"detail": f'Send {{"reports": [...]}} with at most {MAX_REPORTS_PER_POST} reports.'}, status=400
        )
    try:
        task = credentials.task_authenticate(
            schema_name=tenant.schema_name, presented=presented, task_id=str(task_id)
        )
    except errors.AgentRejected as rejected:
        return JsonResponse({"detail": str(rejected)}, status=403)
    kept = 0
    for item in reports:
        problem = _node_report_problem(item)
        if problem:
            transaction.set_rollback(True)
            return JsonResponse({"detail": problem}, status=400)
        body = {key: value for key, value in item.items() if key not in {"type", "source", "seq", "task_id"}}
        kept += dispatch.task_report(
            tenant=tenant, task=task, source=item["source"], seq=item["seq"], kind=item["type"], body=body
        )
    return JsonResponse({"kept": kept, "received": len(reports)})


def _node_report_problem(item: object) -> str | None:
    if not isinstance(item, dict):
        return "Each report is an object."
    if item.get("type") not in ("log", "status", "metric"):
        return "A node reports log, status or metric; the job's result comes from the agent."
    source, seq = item.get("source"), item.get("seq")
    if not isinstance(source, str) or not source.startswith("node-") or len(source) > 40 or source == "agent":
        return 'Each report names its source: "node-<rank>".'
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq < 2**31:
        return "Each report has a positive whole sequence number, per source."
    return None


AutoscalerCall = Callable[..., JsonResponse]


def _autoscaler(request: HttpRequest) -> tuple[Tenant, AgentToken] | JsonResponse:
    """The tenant and the autoscaler's token of a cloud call, or the answer that refuses it."""
    if request.method != "POST":
        return JsonResponse({"detail": "Use POST."}, status=405)
    tenant, presented = getattr(request, "tenant", None), _bearer(request)
    if tenant is None or presented is None:
        return JsonResponse(
            {"detail": "Send 'Authorization: Bearer <the autoscaler's agent token>'."}, status=401
        )
    try:
        return tenant, cloud.autoscaler_authenticate(presented=presented)
    except errors.AgentRejected as rejected:
        return JsonResponse({"detail": str(rejected)}, status=403)


def _body(request: HttpRequest) -> object:
    try:
        return json.loads(request.body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def autoscaler_call(view: AutoscalerCall) -> Callable[..., JsonResponse]:
    """A cloud call of protocol.cloud: POST, from a cloud pool's autoscaler (its agent token), CSRF-exempt
    (no cookie opens it). The view gets the tenant and the token; what the protocol refuses is a 400, a
    lease that is not the caller's a 409 saying stale, any other refusal a 409 with why."""

    @csrf_exempt
    @functools.wraps(view)
    def call(request: HttpRequest, **kwargs: Any) -> JsonResponse:
        authenticated = _autoscaler(request)
        if isinstance(authenticated, JsonResponse):
            return authenticated
        tenant, token = authenticated
        try:
            return view(tenant, token, _body(request), **kwargs)
        except ProtocolError as error:
            what = view.__name__.removeprefix("agent_").replace("_", " ")
            return JsonResponse({"detail": f"Malformed {what}: {error}"}, status=400)
        except errors.StaleLease as stale:
            return JsonResponse({"detail": str(stale), "verdict": "stale"}, status=409)
        except errors.AgentRejected as rejected:
            return JsonResponse({"detail": str(rejected)}, status=409)

    return call


@autoscaler_call
def agent_instance_token(tenant: Tenant, token: AgentToken, body: object, name: str) -> JsonResponse:
    """POST /agents/v1/cloud/instances/{name}/token/ {"seconds": n}: the autoscaler mints the token of a new
    instance's agent."""
    seconds = body.get("seconds", cloud.INSTANCE_TOKEN_SECONDS) if isinstance(body, dict) else None
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        raise ProtocolError('send {"seconds": n}: how long the token is good for a first hello.')
    minted = cloud.instance_token_mint(tenant=tenant, token=token, name=name, seconds=float(seconds))
    answer = protocol_cloud.Minted(minted.token, minted.expires_at).as_json()
    return JsonResponse(answer, status=201, headers={"Cache-Control": "no-store"})


@autoscaler_call
def agent_handoff(tenant: Tenant, token: AgentToken, body: object) -> JsonResponse:
    """POST /agents/v1/cloud/handoff/: the autoscaler hands a run on to an instance's agent."""
    handoff = protocol_cloud.Handoff.parse(body)
    return JsonResponse(cloud.handoff(tenant=tenant, token=token, handoff=handoff).as_json())


@autoscaler_call
def agent_instances(tenant: Tenant, token: AgentToken, body: object) -> JsonResponse:
    """POST /agents/v1/cloud/instances/: the autoscaler reports its instances and reads the plane's view of
    their agents."""
    report = protocol_cloud.InstancesReport.parse(body)
    return JsonResponse(cloud.instances_report(tenant=tenant, token=token, report=report).as_json())


class CloudInstanceOut(serializers.ModelSerializer[CloudInstance]):
    pool = serializers.CharField(source="pool.name")
    month = serializers.SerializerMethodField(help_text="its hours and cost this month, busy and idle")

    class Meta:
        model = CloudInstance
        fields = [
            "name", "pool", "instance_type", "gpus", "spot", "region", "state", "reason", "provider_id",
            "launched_at", "state_since", "ended_at", "month",
        ]  # fmt: skip

    def get_month(self, instance: CloudInstance) -> dict[str, str]:
        figures = self.context["time"].get(instance.name, {})
        return {
            "busy_hours": instance_hours_text(figures.get("busy_ms", 0)),
            "idle_hours": instance_hours_text(figures.get("idle_ms", 0)),
            "busy_cost_usd": usd_text(figures.get("busy_nano_usd", 0)),
            "idle_cost_usd": usd_text(figures.get("idle_nano_usd", 0)),
        }


class CloudInstancesView(TenantAPIView):
    read_role = Role.ADMIN

    @extend_schema(
        responses=CloudInstanceOut(many=True),
        summary="The cloud pools' instances (?pool=NAME; ?all=true: ended ones too) and this month's hours",
    )
    def get(self, request: Request) -> Response:
        pool = None
        if name := request.query_params.get("pool"):
            pool = get_object_or_404(Pool, name=name)
        instances = selectors.cloud_instances(live=request.query_params.get("all") != "true", pool=pool)
        month = timezone.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        return self.page(instances, CloudInstanceOut, context={"time": instance_time(since=month)})

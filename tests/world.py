"""The test world: two tenants and the people in them, made once per test session.

Personas (as in STYLE.md):
- alice: admin of tenant A (acme); first admin, made with the tenant.
- bob: member of A, and a member (not an admin) of project apollo.
- dave: viewer of A.
- carol: member of A and admin of project apollo.
- charlie: admin of tenant B (globex); he must never see A's objects.
- paula: a public-schema user who is not a provider admin (a viewer).
- root: provider admin.

Each test runs inside a transaction that is rolled back, so tests may change this world freely.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.utils import timezone
from django_tenants.utils import get_public_schema_name, schema_context

from apps.accounts.models import Role, User
from apps.accounts.services import (
    group_save,
    project_member_set,
    project_save,
    service_account_create,
    token_create,
    user_create,
)
from apps.configuration.services import draft_provision, draft_save
from apps.fleet.credentials import agent_token_create
from apps.fleet.models import TaskOutput
from apps.metering.ledger import Event, ingest
from apps.provider.services import public_tenant_ensure, tenant_create
from apps.resources.models import ComputeResource, Pool
from apps.scheduling.objectives import objective_save
from apps.scheduling.services import TaskRequest, tasks_submit
from apps.scheduling.webhooks import webhook_save
from apps.vault.services import secret_set
from gateway.models import Usage
from gateway.services import budget_create
from tenants.models import Tenant
from tests.scheduling.config import acme_document

BASE = "klique.test"
HOST_A = f"acme.{BASE}"
HOST_B = f"globex.{BASE}"
HOST_PROVIDER = BASE
SECRET_VALUE_A = "s3cr3t-acme-shared-token-value"


@dataclass(frozen=True)
class World:
    tenant_a: Tenant
    tenant_b: Tenant
    public: Tenant
    tokens: dict[str, str]  # persona -> bearer token
    users: dict[str, str]  # persona -> user id (in their own schema)
    project_a: str
    group_a: str  # research: resource policies use it
    group_unused: str
    service_account_a: str
    token_ids: dict[str, str]  # persona -> id of the token in `tokens`
    compute_resource_a: str  # "Research: 4 GPUs"
    task_a: str  # bob's queued task on it
    pool_a: str  # h100
    agent_token_a: str  # an agent token of h100 (its id)
    agent_secret_a: str
    project_b: str
    secret_a: str  # acme's tenant secret SHARED_TOKEN (its id); its value is SECRET_VALUE_A
    wallet_a: str  # acme's gateway wallet (a tenant budget in USD, period none)
    usage_a: str  # the request id of one gateway call bob made in acme
    objective_a: str  # acme's queue-wait objective research-p95 (its id)
    webhook_a: str  # acme's webhook (its id), signed with SHARED_TOKEN
    ledger_a: str = "kq-world-ledger-1"  # one ledger event of bob's in acme


def build_world() -> World:
    public = public_tenant_ensure()
    tokens: dict[str, str] = {}
    token_ids: dict[str, str] = {}
    users: dict[str, str] = {}
    with schema_context(get_public_schema_name()):
        for name, role in (("root", Role.ADMIN), ("paula", Role.VIEWER)):
            person = User.objects.create(username=name, role=role)
            users[name] = str(person.pk)
            issued = token_create(tenant=public, user=person, name="test")
            tokens[name], token_ids[name] = issued.secret, str(issued.token.pk)

    created_a = tenant_create(slug="acme", name="Acme", admin_username="alice", admin_email="alice@acme.test")
    created_b = tenant_create(slug="globex", name="Globex", admin_username="charlie", gpu_share=16)
    tenant_a, tenant_b = created_a.tenant, created_b.tenant
    tokens["alice"], tokens["charlie"] = created_a.admin_token, created_b.admin_token

    with schema_context(tenant_a.schema_name):
        alice = User.objects.get(username="alice")
        users["alice"] = str(alice.pk)
        for name, role in (("bob", Role.MEMBER), ("dave", Role.VIEWER), ("carol", Role.MEMBER)):
            person = user_create(tenant=tenant_a, username=name, email=f"{name}@acme.test", role=role)
            users[name] = str(person.pk)
            issued = token_create(tenant=tenant_a, user=person, name="test")
            tokens[name], token_ids[name] = issued.secret, str(issued.token.pk)
        dave = User.objects.get(username="dave")
        helper = token_create(tenant=tenant_a, user=dave, name="helper", scope="read", agent="helper")
        token_ids["dave_agent"] = str(helper.token.pk)  # an AI agent acting for dave
        bob = User.objects.get(username="bob")
        carol = User.objects.get(username="carol")
        project = project_save(tenant=tenant_a, name="apollo", description="Moonshot", admin=alice)
        project_member_set(tenant=tenant_a, project=project, user=bob, role=Role.MEMBER)
        project_member_set(tenant=tenant_a, project=project, user=carol, role=Role.ADMIN)
        group = group_save(tenant=tenant_a, name="research", members=[alice, bob])
        robot = service_account_create(tenant=tenant_a, name="ci-bot", description="CI")
        group_save(tenant=tenant_a, name="dev", members=[carol])
        unused = group_save(tenant=tenant_a, name="reading-club", members=[bob])
        draft_save(tenant=tenant_a, user=alice, document=acme_document())
        draft_provision(tenant=tenant_a, user=alice)
        Pool.objects.update(last_heartbeat_at=timezone.now())
        compute_resource = ComputeResource.objects.get(name="Research: 4 GPUs")
        objective = objective_save(
            name="research-p95",
            policy="research",
            percentile=95,
            target_seconds=3600,
            window_seconds=7 * 86_400,
        )
        h100 = Pool.objects.get(name="h100")
        agent_token = agent_token_create(pool=h100, name="rack-1")
        (task,) = tasks_submit(
            tenant=tenant_a,
            user=bob,
            requests=[TaskRequest(compute_resource=compute_resource.name, name="first")],
        )
        stored = default_storage.save(f"acme/{task.pk}/result.txt", ContentFile(b"accuracy 0.93\n"))
        TaskOutput.objects.create(task=task, name="result.txt", size=14, sha256="0" * 64, stored=stored)
        secret = secret_set(user=alice, scope="tenant", name="SHARED_TOKEN", value=SECRET_VALUE_A)
        webhook_a = str(
            webhook_save(
                url="https://93.184.215.14/klique", secret_name="SHARED_TOKEN", kinds=[], actor="alice"
            ).pk
        )
        wallet = budget_create(scope="tenant", unit="usd", limit=100, period="none")
        call = Usage.objects.create(
            request_id="kqr-world-bob-1",
            at=timezone.now(),
            user_id=bob.pk,
            username="bob",
            project_id=project.pk,
            project_name="apollo",
            endpoint="chat.completions",
            model="chat",
            deployment="chat#0",
            tokens_in=12,
            tokens_out=30,
            cost_nano_usd=72_000,
        )
        ingest(
            [
                Event(
                    event_id="kq-world-ledger-1",
                    kind="tokens",
                    started_at=timezone.now(),
                    user="bob",
                    project="apollo",
                    model="chat",
                    tokens_in=5,
                    tokens_out=7,
                    cost_nano_usd=19_000,
                    source="gateway",
                )
            ]
        )
    with schema_context(tenant_b.schema_name):
        charlie = User.objects.get(username="charlie")
        users["charlie"] = str(charlie.pk)
        project_b = project_save(tenant=tenant_b, name="hermes", admin=charlie)
    return World(
        tenant_a=tenant_a,
        tenant_b=tenant_b,
        public=public,
        tokens=tokens,
        users=users,
        project_a=str(project.pk),
        group_a=str(group.pk),
        group_unused=str(unused.pk),
        service_account_a=str(robot.pk),
        token_ids=token_ids,
        compute_resource_a=str(compute_resource.pk),
        task_a=str(task.pk),
        pool_a=str(h100.pk),
        agent_token_a=str(agent_token.token.pk),
        agent_secret_a=agent_token.secret,
        project_b=str(project_b.pk),
        secret_a=str(secret.pk),
        wallet_a=str(wallet.pk),
        usage_a=call.request_id,
        objective_a=str(objective.pk),
        webhook_a=webhook_a,
    )

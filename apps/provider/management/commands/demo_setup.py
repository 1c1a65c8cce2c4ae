"""`klique up --demo` calls this: a demo tenant with people, a group and a project, and fresh tokens.

Safe to run again: what exists is kept and only new tokens are issued (the old ones stay valid until
they expire), so a second `make demo` reuses the data of the first. Each run also gives alice and the
provider a new password for the portal and the Platform Management Center, shown once in the banner.
"""

from __future__ import annotations

import json
import secrets
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand
from django_tenants.utils import get_public_schema_name, schema_context

from apps.accounts.models import Group, Project, Role, User
from apps.accounts.services import group_save, project_member_set, project_save, token_create, user_create
from apps.configuration.services import draft_provision, draft_save
from apps.fleet.credentials import agent_token_create
from apps.provider import services
from apps.resources.models import ComputeResource, Pool
from apps.scheduling.models import Task
from apps.scheduling.services import TaskRequest, tasks_submit
from gateway.models import Budget
from gateway.services import budget_create, settings_save
from tenants import selectors

DEMO_SLUG = "demo"

# `klique up --demo` runs a bare-metal agent for lab-h100 with a configured inventory of 8 GPUs, so the
# demo's tasks run there. Cloud capacity is online while its autoscaler (`klique-agent --backend cloud`)
# is connected, with or without instances; without one, work that overflows waits in the queue.
DEMO_TASK = (
    "import os, time\n"
    "print('GPUs:', os.environ.get('CUDA_VISIBLE_DEVICES'))\n"
    "for epoch in range(1, 4):\n"
    "    time.sleep(1)\n"
    "    print(f'epoch {epoch}/3 loss={1 / epoch:.3f}')\n"
    "open('metrics.json', 'w').write('{\"loss\": 0.333}')\n"
)
DEMO_SPEC = {"command": ["python3", "-c", DEMO_TASK], "outputs": ["metrics.json"]}
DEMO_CONFIGURATION = {
    "pools": [
        {
            "name": "cloud-a100",
            "environment": "cloud",
            "capacity_gpus": 16,
            "gpu_class": "A100",
            "sharing": ["whole", "fraction"],
            "region": "eu-west-1",
        },
        {
            "name": "lab-h100",
            "environment": "baremetal",
            "capacity_gpus": 8,
            "gpu_class": "H100",
            "sharing": ["whole", "fraction", "mig_static"],
        },
    ],
    "profiles": [
        {
            "name": "four-gpu",
            "display_name": "4 GPUs",
            "gpus": "4",
            "pools": [{"pool": "lab-h100"}, {"pool": "cloud-a100"}],
        },
        {
            "name": "shared",
            "display_name": "shared GPU",
            "sharing": "fraction",
            "min_gpus": "0.25",
            "max_gpus": "0.5",
            "pools": [{"pool": "lab-h100"}, {"pool": "cloud-a100"}],
        },
    ],
    "policies": [
        {
            "name": "research",
            "group": "research",
            "reservation_gpus": "8",
            "limit_gpus": "16",
            "compute_resources": [
                {"profile": "four-gpu", "name": "Research: 4 GPUs"},
                {"profile": "shared", "name": "Research: shared GPU"},
            ],
        },
    ],
}


def _new_password(user: User) -> str:
    """A fresh random password for the portal's sign-in (the demo's people have no single sign-on)."""
    password = secrets.token_urlsafe(12)
    user.set_password(password)
    user.save(update_fields=["password"])
    return password


class Command(BaseCommand):
    help = "Create or refresh the demo tenant and print its address and tokens as one JSON line."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--tasks",
            action="store_true",
            help="only submit the sample tasks (once the demo agent is connected), unless some exist",
        )
        parser.add_argument(
            "--model-url",
            default="",
            help="an OpenAI-compatible server (`klique up` starts gateway.echo) to serve the demo's gateway",
        )

    def handle(self, *args: Any, tasks: bool = False, model_url: str = "", **options: Any) -> None:
        if tasks:
            self.submit_samples()
            return
        public = services.public_tenant_ensure()
        with schema_context(get_public_schema_name()):
            provider, _ = User.objects.get_or_create(username="provider", defaults={"role": Role.ADMIN})
            provider_password = _new_password(provider)
            provider_token = token_create(tenant=public, user=provider, name="demo provider token").secret

        tenant = selectors.tenant_get(slug=DEMO_SLUG)
        if tenant is None:
            created_tenant = services.tenant_create(
                slug=DEMO_SLUG,
                name="Demo",
                admin_username="alice",
                admin_email="alice@example.com",
                gpu_share=64,
            )
            tenant, admin_token = created_tenant.tenant, created_tenant.admin_token
        else:
            with schema_context(tenant.schema_name):
                admin_token = token_create(
                    tenant=tenant, user=User.objects.get(username="alice"), name="demo admin token"
                ).secret
        with schema_context(tenant.schema_name):
            alice = User.objects.get(username="alice")
            admin_password = _new_password(alice)
            bob = User.objects.filter(username="bob").first() or user_create(
                tenant=tenant, username="bob", email="bob@example.com", role=Role.MEMBER
            )
            if not Group.objects.filter(name="research").exists():
                group_save(
                    tenant=tenant, name="research", description="Research engineers", members=[alice, bob]
                )
            project = Project.objects.filter(name="vision").first() or project_save(
                tenant=tenant, name="vision", description="Vision models", admin=alice
            )
            project_member_set(tenant=tenant, project=project, user=bob, role=Role.MEMBER)
            if not ComputeResource.objects.exists():
                draft_save(tenant=tenant, user=alice, document=DEMO_CONFIGURATION)
                draft_provision(tenant=tenant, user=alice)
            if model_url:
                self.gateway(alice, model_url)
        with schema_context(tenant.schema_name):
            agent_token = agent_token_create(pool=Pool.objects.get(name="lab-h100"), name="demo agent").secret
            cloud_token = agent_token_create(
                pool=Pool.objects.get(name="cloud-a100"), name="demo autoscaler"
            ).secret
        self.stdout.write(
            json.dumps(
                {
                    "agent_token": agent_token,
                    "cloud_token": cloud_token,
                    "tenant": tenant.slug,
                    "tenant_address": selectors.tenant_address(tenant),
                    "admin": "alice",
                    "admin_token": admin_token,
                    "admin_password": admin_password,
                    "provider": "provider",
                    "provider_token": provider_token,
                    "provider_password": provider_password,
                }
            )
        )

    def gateway(self, alice: User, model_url: str) -> None:
        """The demo's LLM gateway: one model, "demo-echo", on the local server, and a monthly budget."""

        demo_echo = {
            "model_name": "demo-echo",
            "litellm_params": {"model": "openai/echo", "api_base": model_url},
            # The echo server answers as many words as it may; a reply of a few dozen words reads like one.
            "model_info": {
                "input_cost_per_million": 0.15,
                "output_cost_per_million": 0.6,
                "max_output_tokens": 32,
            },
        }
        settings_save(user=alice, document={"model_list": [demo_echo]})
        if not Budget.objects.filter(scope=Budget.Scope.TENANT).exists():
            budget_create(scope="tenant", unit="tokens", limit=1_000_000, period="month")

    def submit_samples(self) -> None:
        tenant = selectors.tenant_get(slug=DEMO_SLUG)
        if tenant is None:
            return
        with schema_context(tenant.schema_name):
            if Task.objects.exists():
                return
            bob = User.objects.get(username="bob")
            tasks_submit(
                tenant=tenant,
                user=bob,
                requests=[
                    TaskRequest(
                        compute_resource="Research: 4 GPUs",
                        name="resnet-50",
                        project="vision",
                        spec=DEMO_SPEC,
                    ),
                    TaskRequest(
                        compute_resource="Research: shared GPU",
                        gpus="0.5",
                        name="notebook",
                        spec=DEMO_SPEC,
                    ),
                    TaskRequest(
                        compute_resource="Research: 4 GPUs",
                        name="sweep",
                        priority=1,
                        spec=DEMO_SPEC,
                    ),
                ],
            )
        self.stdout.write("Submitted three sample tasks.")

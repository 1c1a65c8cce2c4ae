"""An app's template: what a catalogue entry runs and how Klique knows that it serves.

The plane validates a template when an entry is added (every problem listed, each by its path, so an
administrator fixes the document in one pass) and copies it into the spec of each app instance's task;
the agent reads the spec's `app` section (`AppSpec`) to pick the app's port, wait for its health check
and open the app's tunnel.

    {
      "name": "jupyterlab", "version": "4.2.0", "title": "JupyterLab", "kind": "ide",
      "description": "...",
      "image": "localhost/klique-jupyter:4.2",          (optional: without it, the host's programs)
      "command": ["jupyter", "lab", "--port={port}", ...],
      "port": null,                                     (null: the agent picks a free one)
      "health": {"path": "/api", "startup_seconds": 300},
      "gpus": "0", "compute_resource": "Research: shared GPU",
      "environment": {"JUPYTER_TOKEN": ""},
      "variables": [{"name": "NOTEBOOK_DIR", "description": "...", "default": "/work", "required": false}],
      "secrets": ["HF_TOKEN"],                          (vault secrets every instance is given)
      "idle_timeout_seconds": 3600,
      "serves": {"model_variable": "SERVED_NAME", "mode": "chat", "when_idle": "scale_to_zero"},
      "gateway_session": {"tokens": 200000},
      "cluster": {"service": "k3k", "servers": 1, "agents": 2, "version": "v1.31.3-k3s1"}
    }

`{port}` in the command is the port the app must serve on; the same number is in its `PORT` variable.
Nothing else is substituted into the command: a user's variables reach the app as environment variables
by name, never as words of its command line.

`serves` makes the app a model endpoint: while it is ready, the tenant's gateway routes calls for its model
(named in the template, or by one of its variables) to it, through its tunnel. `when_idle` says what its
idle timeout does: `stop` (the model leaves the gateway until someone starts the app again) or
`scale_to_zero` (its GPUs go back to the pool, the model stays listed, and the next call starts it again).

`cluster` makes the app a clustering service (kind `cluster`, on Kubernetes pools only): a team's own
cluster made on the pool's nodes (protocol.clusters), whose GPUs are the app's, split evenly over its
`agents`; the app's own container is the way in (for K3k, `kubectl proxy` to the virtual cluster's API).

`gateway_session` gives each run of the app a key for the tenant's gateway with a quota of its own, dead
when the run ends (protocol.sessions): an agent session's coding agent calls models with it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol import clusters, environment, images, sessions

KINDS = ("ide", "model", "agent", "cluster", "custom")
SLUG = re.compile(r"[a-z][a-z0-9-]{0,62}")
VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,39}")
HEALTH_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/?-]{0,499}")
GPUS = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4})?")
PORT_WORD = "{port}"
MAX_COMMAND_WORDS = 200
MAX_WORD = 4096
MAX_VARIABLES = 50
MAX_SECRETS = 50
MAX_STARTUP_SECONDS = 3600
DEFAULT_STARTUP_SECONDS = 300
MIN_IDLE_SECONDS = 60
MAX_IDLE_SECONDS = 30 * 24 * 3600
FIELDS = frozenset(
    {
        "name", "version", "title", "description", "kind", "image", "command", "port", "health", "gpus",
        "compute_resource", "environment", "variables", "idle_timeout_seconds", "secrets", "serves",
        "gateway_session", "cluster",
    }
)  # fmt: skip
SERVES_FIELDS = frozenset(
    {"model", "model_variable", "mode", "when_idle", "input_cost_per_million", "output_cost_per_million"}
)
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,99}")  # a model group's name in the gateway
MODEL_MODES = ("chat", "completion", "embedding")
WHEN_IDLE = ("stop", "scale_to_zero")
MAX_PRICE = 1_000_000  # USD per million tokens


class TemplateInvalid(ValueError):
    """A template with problems: `problems` lists each as "path: what is wrong"."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    description: str = ""
    default: str = ""
    required: bool = False


def _text(document: Mapping[str, Any], key: str, problems: list[str], *, limit: int, required: bool) -> str:
    value = document.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        problems.append(f"{key}: a non-empty text is required." if required else f"{key}: must be text.")
        return ""
    if len(value) > limit or "\x00" in value:
        problems.append(f"{key}: at most {limit} characters, without NUL.")
    return value


def _command(value: object, problems: list[str]) -> list[str]:
    if not isinstance(value, list) or not value:
        problems.append('command: a list of words is required, as ["program", "argument", ...].')
        return []
    if len(value) > MAX_COMMAND_WORDS:
        problems.append(f"command: at most {MAX_COMMAND_WORDS} words.")
    for index, word in enumerate(value):
        if not isinstance(word, str) or not word or len(word) > MAX_WORD or "\x00" in word:
            problems.append(f"command[{index}]: a non-empty text of at most {MAX_WORD} characters.")
    return [word for word in value if isinstance(word, str)]


def _port(value: object, problems: list[str]) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1024 <= value <= 65535:
        problems.append("port: a port from 1024 to 65535, or null to let the agent pick a free one.")
        return None
    return value


def _health(value: object, problems: list[str]) -> tuple[str, int]:
    if value is None:
        return "/", DEFAULT_STARTUP_SECONDS
    if not isinstance(value, dict):
        problems.append('health: an object {"path": "/", "startup_seconds": 300}.')
        return "/", DEFAULT_STARTUP_SECONDS
    for key in sorted(set(value) - {"path", "startup_seconds"}):
        problems.append(f"health.{key}: not a field of a health check (path, startup_seconds).")
    path = value.get("path", "/")
    if not isinstance(path, str) or not HEALTH_PATH.fullmatch(path):
        problems.append("health.path: a path that starts with / (letters, digits and URL punctuation).")
        path = "/"
    startup = value.get("startup_seconds", DEFAULT_STARTUP_SECONDS)
    if not isinstance(startup, int) or isinstance(startup, bool) or not 1 <= startup <= MAX_STARTUP_SECONDS:
        problems.append(f"health.startup_seconds: a whole number of seconds from 1 to {MAX_STARTUP_SECONDS}.")
        startup = DEFAULT_STARTUP_SECONDS
    return path, startup


def _variables(value: object, fixed: Mapping[str, str], problems: list[str]) -> tuple[Variable, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_VARIABLES:
        problems.append(f"variables: a list of at most {MAX_VARIABLES} variables.")
        return ()
    found: list[Variable] = []
    for index, item in enumerate(value):
        where = f"variables[{index}]"
        if not isinstance(item, dict):
            problems.append(f'{where}: an object {{"name": ..., "description": ..., "default": ...}}.')
            continue
        for key in sorted(set(item) - {"name", "description", "default", "required"}):
            problems.append(
                f"{where}.{key}: not a field of a variable (name, description, default, required)."
            )
        name = item.get("name")
        if (why := environment.refusal(name)) is not None:
            problems.append(f"{where}.name: {why}")
            continue
        assert isinstance(name, str)
        if name == "PORT" or name in fixed or any(known.name == name for known in found):
            problems.append(f"{where}.name: {name} is set twice (PORT is the agent's).")
        description, default = item.get("description", ""), item.get("default", "")
        if not isinstance(description, str) or len(description) > 500:
            problems.append(f"{where}.description: text of at most 500 characters.")
            description = ""
        if not isinstance(default, str) or len(default.encode()) > environment.MAX_VALUE_BYTES:
            problems.append(f"{where}.default: text of at most {environment.MAX_VALUE_BYTES} bytes.")
            default = ""
        required = item.get("required", False)
        if not isinstance(required, bool):
            problems.append(f"{where}.required: true or false.")
            required = False
        found.append(Variable(name, description, default, required))
    return tuple(found)


def secret_names(value: object, problems: list[str], where: str = "secrets") -> tuple[str, ...]:
    """Names of vault secrets an app is given (as environment variables of the same names)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_SECRETS:
        problems.append(f"{where}: a list of at most {MAX_SECRETS} secret names.")
        return ()
    names: list[str] = []
    for index, name in enumerate(value):
        if (why := environment.refusal(name)) is not None:
            problems.append(f"{where}[{index}]: {why}")
        elif name == "PORT":
            problems.append(f"{where}[{index}]: PORT is the agent's.")
        elif name not in names:
            names.append(name)
    return tuple(names)


def _fixed_environment(value: object, problems: list[str]) -> dict[str, str]:
    try:
        fixed = environment.checked(value, "environment")
    except environment.NameRefused as error:
        problems.append(f"environment: {error}")
        return {}
    if "PORT" in fixed:
        problems.append("environment.PORT: the agent sets PORT to the port it picked; leave it out.")
    return fixed


@dataclass(frozen=True, slots=True)
class Serves:
    """What a model endpoint serves: its model's name in the gateway (fixed, or a variable's value), the
    kind of calls it takes, its prices (USD per million tokens, for budgets in USD) and what idleness
    does to it."""

    model: str = ""
    model_variable: str = ""
    mode: str = "chat"
    when_idle: str = "scale_to_zero"
    input_cost_per_million: float = 0.0
    output_cost_per_million: float = 0.0

    def model_name(self, values: Mapping[str, str]) -> str:
        return values.get(self.model_variable, "") if self.model_variable else self.model

    def as_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "mode": self.mode,
            "when_idle": self.when_idle,
            "input_cost_per_million": self.input_cost_per_million,
            "output_cost_per_million": self.output_cost_per_million,
        }
        if self.model_variable:
            document["model_variable"] = self.model_variable
        else:
            document["model"] = self.model
        return document


def _price(value: object, where: str, problems: list[str]) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_PRICE:
        problems.append(f"{where}: USD per million tokens, from 0 to {MAX_PRICE}.")
        return 0.0
    return float(value)


def _serves(value: object, variables: tuple[Variable, ...], problems: list[str]) -> Serves | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.append('serves: an object {"model": ..., "mode": "chat", "when_idle": "scale_to_zero"}.')
        return None
    for key in sorted(set(value) - SERVES_FIELDS):
        problems.append(f"serves.{key}: not a field of serves ({', '.join(sorted(SERVES_FIELDS))}).")
    model, variable = value.get("model"), value.get("model_variable")
    if (model is None) == (variable is None):
        problems.append("serves: name the model with exactly one of model and model_variable.")
    elif model is not None and (not isinstance(model, str) or not MODEL_NAME.fullmatch(model)):
        problems.append(
            "serves.model: up to 100 letters, digits and . _ : / @ -, starting with one of the first two."
        )
    elif variable is not None and not any(known.name == variable for known in variables):
        names = ", ".join(known.name for known in variables) or "none"
        problems.append(f"serves.model_variable: one of the template's variables ({names}).")
    mode = value.get("mode", "chat")
    if mode not in MODEL_MODES:
        problems.append(f"serves.mode: one of {', '.join(MODEL_MODES)}.")
    when_idle = value.get("when_idle", "scale_to_zero")
    if when_idle not in WHEN_IDLE:
        problems.append(f"serves.when_idle: one of {', '.join(WHEN_IDLE)}.")
    return Serves(
        model=model if isinstance(model, str) else "",
        model_variable=variable if isinstance(variable, str) else "",
        mode=mode if isinstance(mode, str) else "chat",
        when_idle=when_idle if isinstance(when_idle, str) else "stop",
        input_cost_per_million=_price(
            value.get("input_cost_per_million"), "serves.input_cost_per_million", problems
        ),
        output_cost_per_million=_price(
            value.get("output_cost_per_million"), "serves.output_cost_per_million", problems
        ),
    )


def _session(value: object, problems: list[str]) -> sessions.GatewaySession | None:
    try:
        return sessions.parse(value)
    except sessions.SessionRefused as error:
        problems.append(str(error))
        return None


@dataclass(frozen=True, slots=True)
class Template:
    name: str
    version: str
    title: str
    description: str
    kind: str
    image: str
    command: tuple[str, ...]
    port: int | None
    health_path: str
    startup_seconds: int
    gpus: str
    compute_resource: str
    environment: Mapping[str, str]
    variables: tuple[Variable, ...]
    idle_timeout_seconds: int | None
    secrets: tuple[str, ...] = ()
    serves: Serves | None = None
    gateway_session: sessions.GatewaySession | None = None
    cluster: clusters.ClusterService | None = None

    @classmethod
    def parse(cls, document: object) -> Template:
        """The template, or TemplateInvalid listing every problem of the document."""
        if not isinstance(document, dict):
            raise TemplateInvalid(["(document): a template is a JSON object."])
        problems = [f"{key}: not a field of a template." for key in sorted(set(document) - FIELDS)]
        name = _text(document, "name", problems, limit=63, required=True)
        if name and not SLUG.fullmatch(name):
            problems.append("name: lowercase letters, digits and hyphens, starting with a letter.")
        version = _text(document, "version", problems, limit=40, required=True)
        if version and not VERSION.fullmatch(version):
            problems.append('version: letters, digits and ". + _ -", as in "4.2.0".')
        kind = document.get("kind", "custom")
        if kind not in KINDS:
            problems.append(f"kind: one of {', '.join(KINDS)}.")
        image = document.get("image") or ""
        if image:
            try:
                images.checked(image)
            except images.ImageRefused as error:
                problems.append(f"image: {error}")
        gpus = document.get("gpus", "0")
        gpus = str(gpus) if isinstance(gpus, int | float) and not isinstance(gpus, bool) else gpus
        if not isinstance(gpus, str) or not GPUS.fullmatch(gpus):
            problems.append('gpus: a number of GPUs, as "0", "1" or "0.5".')
            gpus = "0"
        idle = document.get("idle_timeout_seconds")
        if idle is not None and (
            not isinstance(idle, int)
            or isinstance(idle, bool)
            or not MIN_IDLE_SECONDS <= idle <= MAX_IDLE_SECONDS
        ):
            problems.append(
                f"idle_timeout_seconds: null (never) or {MIN_IDLE_SECONDS} to {MAX_IDLE_SECONDS} seconds."
            )
            idle = None
        fixed = _fixed_environment(document.get("environment"), problems)
        variables = _variables(document.get("variables"), fixed, problems)
        template = cls(
            name=name,
            version=version,
            title=_text(document, "title", problems, limit=100, required=False) or name,
            description=_text(document, "description", problems, limit=2000, required=False),
            kind=kind if isinstance(kind, str) else "custom",
            image=image if isinstance(image, str) else "",
            command=tuple(_command(document.get("command"), problems)),
            port=_port(document.get("port"), problems),
            health_path=(health := _health(document.get("health"), problems))[0],
            startup_seconds=health[1],
            gpus=gpus,
            compute_resource=_text(document, "compute_resource", problems, limit=200, required=False),
            environment=fixed,
            variables=variables,
            idle_timeout_seconds=idle,
            secrets=secret_names(document.get("secrets"), problems),
            serves=_serves(document.get("serves"), variables, problems),
            gateway_session=_session(document.get("gateway_session"), problems),
            cluster=_cluster(document.get("cluster"), kind, gpus, problems, idle=idle),
        )
        if problems:
            raise TemplateInvalid(problems)
        return template

    def values(self, given: Mapping[str, object]) -> dict[str, str]:
        """The app's variables as a user set them over the template's defaults; TemplateInvalid lists
        each one that is not the template's, not text, or required and missing."""
        problems = []
        known = {variable.name: variable for variable in self.variables}
        for name in sorted(set(given) - set(known)):
            problems.append(
                f"variables.{name}: not a variable of {self.name} ({', '.join(known) or 'none'})."
            )
        values: dict[str, str] = {}
        for variable in self.variables:
            value = given.get(variable.name, variable.default)
            if (
                not isinstance(value, str)
                or len(value.encode()) > environment.MAX_VALUE_BYTES
                or "\x00" in value
            ):
                problems.append(
                    f"variables.{variable.name}: text of at most {environment.MAX_VALUE_BYTES} bytes."
                )
            elif variable.required and not value:
                problems.append(f"variables.{variable.name}: required; {variable.description or 'set it'}.")
            else:
                values[variable.name] = value
        named = self.serves.model_variable if self.serves is not None else ""
        if named in values and not MODEL_NAME.fullmatch(values[named]):
            problems.append(
                f"variables.{named}: the model's name in the gateway: up to 100 letters, digits and "
                ". _ : / @ -, starting with one of the first two."
            )
        if problems:
            raise TemplateInvalid(problems)
        return values

    def spec(
        self, values: Mapping[str, str], *, instance: str, secrets: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """The spec of the task that runs one instance of the app; `secrets` are those its user added to
        the template's (the vault resolves them at dispatch, for the task's user and project)."""
        spec: dict[str, Any] = {
            "command": list(self.command),
            "environment": {**self.environment, **values},
            "app": AppSpec(
                instance, self.port, self.health_path, self.startup_seconds, self.cluster
            ).as_json(),
        }
        if names := list(dict.fromkeys((*self.secrets, *secrets))):
            spec["secrets"] = names
        if self.image:
            spec["image"] = self.image
        if self.gateway_session is not None:
            spec["gateway_session"] = self.gateway_session.as_json()
        return spec

    def as_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "name": self.name,
            "version": self.version,
            "title": self.title,
            "description": self.description,
            "kind": self.kind,
            "command": list(self.command),
            "port": self.port,
            "health": {"path": self.health_path, "startup_seconds": self.startup_seconds},
            "gpus": self.gpus,
            "environment": dict(self.environment),
            "variables": [
                {"name": v.name, "description": v.description, "default": v.default, "required": v.required}
                for v in self.variables
            ],
            "idle_timeout_seconds": self.idle_timeout_seconds,
        }
        if self.image:
            document["image"] = self.image
        if self.compute_resource:
            document["compute_resource"] = self.compute_resource
        if self.secrets:
            document["secrets"] = list(self.secrets)
        if self.serves is not None:
            document["serves"] = self.serves.as_json()
        if self.gateway_session is not None:
            document["gateway_session"] = self.gateway_session.as_json()
        if self.cluster is not None:
            document["cluster"] = self.cluster.as_json()
        return document


def _cluster(
    value: object, kind: object, gpus: str, problems: list[str], *, idle: int | None = None
) -> clusters.ClusterService | None:
    """A clustering service's section: present exactly where the template's kind is `cluster`. A cluster has
    no idle timeout: its work runs inside it, unseen by its route, on GPUs its agent does not sample, so a
    timeout would stop a cluster busy with jobs."""
    if kind == "cluster" and idle is not None:
        problems.append(
            "idle_timeout_seconds: a cluster has none (its jobs run inside it, unseen by its route); leave "
            "it out, and stop the cluster when the team is done."
        )
    if value is None:
        if kind == "cluster":
            problems.append('cluster: a template of kind cluster says which service, as {"service": "k3k"}.')
        return None
    if kind != "cluster":
        problems.append("cluster: only a template of kind cluster makes a cluster.")
    try:
        return clusters.ClusterService.parse(value, gpus=gpus)
    except clusters.ServiceInvalid as error:
        problems.extend(error.problems)
        return None


@dataclass(frozen=True, slots=True)
class AppSpec:
    """The `app` section of an app task's spec: which instance it is, where it serves, how to see that
    it does. `port` is None until the agent picks one (then it is in the run's spec on the host)."""

    instance: str
    port: int | None
    health_path: str = "/"
    startup_seconds: int = DEFAULT_STARTUP_SECONDS
    cluster: clusters.ClusterService | None = None  # a clustering service's cluster, made beside the app

    @classmethod
    def parse(cls, value: object) -> AppSpec:
        problems: list[str] = []
        if not isinstance(value, dict):
            raise TemplateInvalid(["app: an object {instance, port, health_path, startup_seconds}."])
        instance = value.get("instance")
        if not isinstance(instance, str) or not re.fullmatch(r"[0-9a-f-]{1,64}", instance):
            problems.append("app.instance: the app instance's id.")
        port = _port(value.get("port"), problems)
        path, startup = _health(
            {"path": value.get("health_path", "/"), "startup_seconds": value.get("startup_seconds", 300)},
            problems,
        )
        cluster = None
        if value.get("cluster") is not None:
            try:
                cluster = clusters.ClusterService.parse(value["cluster"])
            except clusters.ServiceInvalid as error:
                problems.extend(f"app.{problem}" for problem in error.problems)
        if problems:
            raise TemplateInvalid(problems)
        assert isinstance(instance, str)
        return cls(instance, port, path, startup, cluster)

    def as_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "instance": self.instance,
            "port": self.port,
            "health_path": self.health_path,
            "startup_seconds": self.startup_seconds,
        }
        if self.cluster is not None:
            document["cluster"] = self.cluster.as_json()
        return document


def with_port(spec: Mapping[str, Any], port: int) -> dict[str, Any]:
    """The spec with the app's port chosen: in `app.port`, in `PORT`, and for each `{port}` of its command."""
    app = AppSpec.parse(spec.get("app"))
    return {
        **spec,
        "command": [word.replace(PORT_WORD, str(port)) for word in spec.get("command") or []],
        "environment": {**(spec.get("environment") or {}), "PORT": str(port)},
        "app": AppSpec(app.instance, port, app.health_path, app.startup_seconds, app.cluster).as_json(),
    }

"""A tenant's gateway configuration: model groups, routing, prices and guardrails, checked in one pass.

The document keeps LiteLLM's vocabulary (`model_list`, `model_name`, `litellm_params`, `router_settings`,
`routing_strategy`) so that a LiteLLM proxy configuration carries over, with two differences: a
deployment's key is never written inline but named with `api_key_secret` (a secret in the tenant's vault),
and each deployment carries its prices (`model_info.input_cost_per_million` and
`output_cost_per_million`, in USD), which budgets in USD count with.

No Django here: `parse` turns a document into frozen dataclasses or raises ConfigInvalid listing every
problem with its path, so the API can show them all at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

# Providers whose API is OpenAI's own: the gateway calls them itself. Any other provider LiteLLM knows
# (anthropic, bedrock, vertex_ai, ...) goes through LiteLLM's adapters, imported when first needed.
OPENAI_COMPATIBLE = frozenset({"openai", "hosted_vllm", "llamafile", "lm_studio", "openai_like"})
STRATEGIES = ("simple-shuffle", "least-busy", "latency-based-routing")
MODES = ("chat", "completion", "embedding")
PII_KINDS = ("email", "phone", "credit_card", "ssn", "iban")
PII_ACTIONS = ("off", "redact", "refuse")
ROLES = ("viewer", "member", "admin")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,99}")
SECRET_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]{0,99}")
DEFAULT_MAX_OUTPUT = 4096


class ConfigInvalid(ValueError):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class Deployment:
    id: str  # "<model_name>#<index>": stable while the list keeps its order
    model_name: str
    provider: str
    model: str  # the name the upstream knows
    api_base: str
    api_key_secret: str
    weight: float
    timeout: float
    mode: str
    max_output_tokens: int
    input_cost_per_million: Decimal
    output_cost_per_million: Decimal
    # A model one of the tenant's apps serves (gateway.selfhosted): the app's id, and who may call it.
    app: str = ""
    audience: frozenset[str] | None = None  # user ids; None: everyone the model is allowed to

    @property
    def openai_compatible(self) -> bool:
        return self.provider in OPENAI_COMPATIBLE or bool(self.app)

    def serves(self, user_id: str | None) -> bool:
        return self.audience is None or user_id is None or user_id in self.audience


@dataclass(frozen=True)
class RouterSettings:
    routing_strategy: str = "simple-shuffle"
    fallbacks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    num_retries: int = 1  # further deployments tried in a group after one fails
    allowed_fails: int = 3  # failures within a minute before a deployment cools down
    cooldown_time: float = 30.0  # seconds


@dataclass(frozen=True)
class Guardrails:
    blocked_terms: tuple[str, ...] = ()
    pii_action: str = "off"
    pii_kinds: tuple[str, ...] = PII_KINDS
    models_by_role: dict[str, tuple[str, ...]] | None = None  # None: every role may call every model
    max_tokens_cap: int | None = None
    check_output: bool = True


@dataclass(frozen=True)
class GatewayConfig:
    deployments: tuple[Deployment, ...] = ()
    router: RouterSettings = RouterSettings()
    guardrails: Guardrails = Guardrails()

    def group(self, model_name: str, user_id: str | None = None) -> tuple[Deployment, ...]:
        """The group's deployments; those `user_id` may be served by, where it is given."""
        return tuple(
            deployment
            for deployment in self.deployments
            if deployment.model_name == model_name and deployment.serves(user_id)
        )

    @property
    def model_names(self) -> list[str]:
        return sorted({deployment.model_name for deployment in self.deployments})

    def model_names_for(self, user_id: str) -> list[str]:
        return sorted({d.model_name for d in self.deployments if d.serves(user_id)})

    def with_deployments(self, more: tuple[Deployment, ...]) -> GatewayConfig:
        return GatewayConfig(self.deployments + more, self.router, self.guardrails)

    def secret_names(self) -> set[str]:
        return {deployment.api_key_secret for deployment in self.deployments if deployment.api_key_secret}


EMPTY = GatewayConfig()


def _price(value: Any, where: str, errors: list[str]) -> Decimal:
    try:
        price = Decimal(str(value if value is not None else 0))
    except InvalidOperation:
        errors.append(f"{where}: expected a number of USD per million tokens, got {value!r}")
        return Decimal(0)
    if not price.is_finite() or price < 0:
        errors.append(f"{where}: a price cannot be negative or infinite (got {value!r})")
        return Decimal(0)
    return price


def _positive_int(value: Any, where: str, errors: list[str], *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        errors.append(f"{where}: expected a whole number {'>= 0' if allow_zero else '>= 1'}, got {value!r}")
        return 0
    return value


def _unknown(where: str, given: dict[str, Any], allowed: set[str], errors: list[str]) -> None:
    if unknown := set(given) - allowed:
        errors.append(f"{where}: unknown keys {sorted(unknown)}")


def _number(value: Any, where: str, limit: float, default: float, errors: list[str], *, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= limit:
        errors.append(f"{where}: {what}, above 0 and up to {limit:g} (got {value!r})")
        return default
    return float(value)


def _params(where: str, params: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    """The checked `litellm_params` of one deployment."""
    if "api_key" in params:
        errors.append(
            f"{where}.api_key: keys are never stored in the configuration; put it in the "
            "vault (PUT /api/v1/secrets/) and name it with api_key_secret"
        )
    _unknown(where, params, {"model", "api_base", "api_key_secret", "weight", "timeout", "api_key"}, errors)
    model = params.get("model")
    provider, _, upstream = str(model or "").partition("/")
    if not isinstance(model, str) or not provider or not upstream:
        errors.append(
            f"{where}.model: expected '<provider>/<model>', as 'openai/gpt-4o-mini' or "
            f"'hosted_vllm/meta-llama/Llama-3.1-8B-Instruct' (got {model!r})"
        )
    api_base = params.get("api_base", "")
    if api_base and (not isinstance(api_base, str) or not re.fullmatch(r"https?://[^\s]+", api_base)):
        errors.append(f"{where}.api_base: expected an http(s) address (got {api_base!r})")
        api_base = ""
    if provider in OPENAI_COMPATIBLE and provider != "openai" and not api_base:
        errors.append(f"{where}.api_base: a self-hosted {provider} deployment needs its address")
    secret = params.get("api_key_secret", "")
    if secret and (not isinstance(secret, str) or not SECRET_NAME_RE.fullmatch(secret)):
        errors.append(f"{where}.api_key_secret: a vault secret's name, as OPENAI_API_KEY")
        secret = ""
    return {
        "provider": provider,
        "model": upstream,
        "api_base": str(api_base).rstrip("/"),
        "api_key_secret": str(secret),
        "weight": _number(params.get("weight", 1), f"{where}.weight", 1000, 1, errors, what="a number"),
        "timeout": _number(params.get("timeout", 600), f"{where}.timeout", 3600, 600, errors, what="seconds"),
    }


def _info(where: str, info: Any, errors: list[str]) -> dict[str, Any]:
    """The checked `model_info` of one deployment: its mode, reply cap and prices."""
    if not isinstance(info, dict):
        errors.append(f"{where}: expected an object")
        info = {}
    _unknown(
        where,
        info,
        {"input_cost_per_million", "output_cost_per_million", "max_output_tokens", "mode"},
        errors,
    )
    mode = info.get("mode", "chat")
    if mode not in MODES:
        errors.append(f"{where}.mode: one of {', '.join(MODES)} (got {mode!r})")
    cap = info.get("max_output_tokens", DEFAULT_MAX_OUTPUT)
    return {
        "mode": str(mode),
        "max_output_tokens": _positive_int(cap, f"{where}.max_output_tokens", errors) or DEFAULT_MAX_OUTPUT,
        "input_cost_per_million": _price(
            info.get("input_cost_per_million"), f"{where}.input_cost_per_million", errors
        ),
        "output_cost_per_million": _price(
            info.get("output_cost_per_million"), f"{where}.output_cost_per_million", errors
        ),
    }


def _deployment(index: int, entry: Any, errors: list[str]) -> Deployment | None:
    where = f"model_list[{index}]"
    if not isinstance(entry, dict):
        errors.append(f"{where}: expected an object with model_name and litellm_params")
        return None
    _unknown(where, entry, {"model_name", "litellm_params", "model_info"}, errors)
    name = entry.get("model_name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        errors.append(f"{where}.model_name: the name users call, letters, digits and ._:/@- (got {name!r})")
        name = ""
    params = entry.get("litellm_params")
    if not isinstance(params, dict):
        errors.append(f"{where}.litellm_params: expected an object with at least 'model'")
        return None
    return Deployment(
        id=f"{name}#{index}",
        model_name=name,
        **_params(f"{where}.litellm_params", params, errors),
        **_info(f"{where}.model_info", entry.get("model_info", {}), errors),
    )


def _router(settings: Any, names: set[str], errors: list[str]) -> RouterSettings:
    if not isinstance(settings, dict):
        errors.append("router_settings: expected an object")
        return RouterSettings()
    unknown = set(settings) - {
        "routing_strategy",
        "fallbacks",
        "num_retries",
        "allowed_fails",
        "cooldown_time",
    }
    if unknown:
        errors.append(f"router_settings: unknown keys {sorted(unknown)}")
    strategy = settings.get("routing_strategy", "simple-shuffle")
    if strategy not in STRATEGIES:
        errors.append(f"router_settings.routing_strategy: one of {', '.join(STRATEGIES)} (got {strategy!r})")
        strategy = "simple-shuffle"
    fallbacks: dict[str, tuple[str, ...]] = {}
    raw = settings.get("fallbacks", [])
    if not isinstance(raw, list):
        errors.append('router_settings.fallbacks: expected a list like [{"chat": ["chat-backup"]}]')
        raw = []
    for index, rule in enumerate(raw):
        if not isinstance(rule, dict) or len(rule) != 1:
            errors.append(
                f'router_settings.fallbacks[{index}]: expected one entry, as {{"chat": ["chat-backup"]}}'
            )
            continue
        ((source, targets),) = rule.items()
        if source not in names:
            errors.append(f"router_settings.fallbacks[{index}]: no model group {source!r} in model_list")
        if not isinstance(targets, list) or not targets:
            errors.append(f"router_settings.fallbacks[{index}].{source}: expected a list of model groups")
            continue
        for target in targets:
            if target not in names or target == source:
                errors.append(
                    f"router_settings.fallbacks[{index}].{source}: {target!r} is not another model group"
                )
        fallbacks[source] = tuple(str(target) for target in targets)
    return RouterSettings(
        routing_strategy=str(strategy),
        fallbacks=fallbacks,
        num_retries=_positive_int(
            settings.get("num_retries", 1), "router_settings.num_retries", errors, allow_zero=True
        ),
        allowed_fails=_positive_int(
            settings.get("allowed_fails", 3), "router_settings.allowed_fails", errors
        ),
        cooldown_time=float(
            _positive_int(settings.get("cooldown_time", 30), "router_settings.cooldown_time", errors)
        ),
    )


def _pii(pii: Any, errors: list[str]) -> tuple[str, tuple[str, ...]]:
    if not isinstance(pii, dict):
        errors.append('guardrails.pii: expected an object, as {"action": "redact", "kinds": ["email"]}')
        pii = {}
    action = pii.get("action", "off")
    if action not in PII_ACTIONS:
        errors.append(f"guardrails.pii.action: one of {', '.join(PII_ACTIONS)} (got {action!r})")
        action = "off"
    kinds = pii.get("kinds", list(PII_KINDS))
    if not isinstance(kinds, list) or any(kind not in PII_KINDS for kind in kinds):
        errors.append(f"guardrails.pii.kinds: a list drawn from {', '.join(PII_KINDS)} (got {kinds!r})")
        kinds = list(PII_KINDS)
    return str(action), tuple(kinds)


def _models_by_role(by_role: Any, names: set[str], errors: list[str]) -> dict[str, tuple[str, ...]] | None:
    if by_role is None:
        return None
    if not isinstance(by_role, dict) or set(by_role) - set(ROLES):
        roles = ", ".join(ROLES)
        errors.append(f'guardrails.models_by_role: an object keyed by role ({roles}), as {{"viewer": []}}')
        return None
    allowed = {}
    for role, models in by_role.items():
        if not isinstance(models, list) or any(model not in names and model != "*" for model in models):
            errors.append(f"guardrails.models_by_role.{role}: a list of model groups in model_list, or '*'")
            continue
        allowed[role] = tuple(models)
    return allowed


def _guardrails(settings: Any, names: set[str], errors: list[str]) -> Guardrails:
    if not isinstance(settings, dict):
        errors.append("guardrails: expected an object")
        return Guardrails()
    _unknown(
        "guardrails",
        settings,
        {"blocked_terms", "pii", "models_by_role", "max_tokens_cap", "check_output"},
        errors,
    )
    terms = settings.get("blocked_terms", [])
    if not isinstance(terms, list) or not all(isinstance(term, str) and term.strip() for term in terms):
        errors.append("guardrails.blocked_terms: expected a list of non-empty words or phrases")
        terms = []
    action, kinds = _pii(settings.get("pii", {"action": "off"}), errors)
    cap = settings.get("max_tokens_cap")
    if cap is not None:
        cap = _positive_int(cap, "guardrails.max_tokens_cap", errors) or None
    check_output = settings.get("check_output", True)
    if not isinstance(check_output, bool):
        errors.append("guardrails.check_output: true or false")
        check_output = True
    return Guardrails(
        blocked_terms=tuple(term.strip() for term in terms),
        pii_action=action,
        pii_kinds=kinds,
        models_by_role=_models_by_role(settings.get("models_by_role"), names, errors),
        max_tokens_cap=cap,
        check_output=check_output,
    )


def parse(document: Any) -> GatewayConfig:
    """The configuration a document describes, or ConfigInvalid listing everything wrong with it."""
    if not isinstance(document, dict):
        raise ConfigInvalid(["expected an object with model_list, router_settings and guardrails"])
    errors: list[str] = []
    if unknown := set(document) - {"model_list", "router_settings", "guardrails"}:
        errors.append(f"unknown keys {sorted(unknown)}: expected model_list, router_settings and guardrails")
    entries = document.get("model_list", [])
    if not isinstance(entries, list):
        errors.append("model_list: expected a list of deployments")
        entries = []
    deployments = [
        d for index, entry in enumerate(entries) if (d := _deployment(index, entry, errors)) is not None
    ]
    names = {deployment.model_name for deployment in deployments}
    for name in sorted(names):
        modes = {deployment.mode for deployment in deployments if deployment.model_name == name}
        if len(modes) > 1:
            errors.append(
                f"model_list: the deployments of {name!r} mix modes {sorted(modes)}; one group, one mode"
            )
    router = _router(document.get("router_settings", {}), names, errors)
    guardrails = _guardrails(document.get("guardrails", {}), names, errors)
    if errors:
        raise ConfigInvalid(errors)
    return GatewayConfig(deployments=tuple(deployments), router=router, guardrails=guardrails)

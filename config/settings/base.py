"""Settings shared by every deployment. Values that differ between deployments come from `config.env`."""

from __future__ import annotations

from pathlib import Path

import dj_database_url

from config import env

BASE_DIR = Path(__file__).resolve().parent.parent.parent

SECRET_KEY = env.text("SECRET_KEY", "klique-insecure-development-key-change-me-in-production")
DEBUG = env.flag("DEBUG", default=False)

# Tenants are reached at <slug>.<base domain>; the base domain itself serves the provider (public schema).
KLIQUE_BASE_DOMAIN = (env.text("KLIQUE_BASE_DOMAIN", "localhost") or "localhost").lower()
ALLOWED_HOSTS = [KLIQUE_BASE_DOMAIN, f".{KLIQUE_BASE_DOMAIN}", *env.words("KLIQUE_EXTRA_HOSTS")]
# Ranges the plane may call on a tenant's behalf although they are not public (apps.core.outbound): a
# provider's self-hosted models on its private network. None by default.
KLIQUE_OUTBOUND_ALLOW = env.words("KLIQUE_OUTBOUND_ALLOW")
KLIQUE_DATA_DIR = env.data_dir()
# The vault's master keys (Fernet, comma-separated, the current one first); without any, a key is made
# once in the data folder (laptops, tests). Production requires them.
KLIQUE_MASTER_KEYS = env.words("KLIQUE_MASTER_KEYS")
# Stripe, for the provider's billing: the secret key, another API address (a local Stripe in tests), and
# whether usage goes in as billing meter events ("meter_events") or invoice items ("invoice_items").
KLIQUE_STRIPE_API_KEY = env.text("KLIQUE_STRIPE_API_KEY", "") or ""
KLIQUE_STRIPE_API_BASE = env.text("KLIQUE_STRIPE_API_BASE", "") or ""
KLIQUE_STRIPE_MODE = env.text("KLIQUE_STRIPE_MODE", "meter_events") or "meter_events"

# Single sign-on is configured per tenant (apps.sso); these are mozilla-django-oidc's defaults.
AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.ModelBackend", "apps.sso.backend.TenantOIDCBackend"]
LOGIN_REDIRECT_URL = "/portal/"  # after single sign-on, unless the sign-in named where to go next
LOGOUT_REDIRECT_URL = "/"
OIDC_CALLBACK_CLASS = "apps.sso.views.Callback"
OIDC_AUTHENTICATION_CALLBACK_URL = "oidc_authentication_callback"
# New tenant schemas are replayed from a template dumped once per set of migrations (tenants/template.py);
# off, or where pg_dump is missing, each new schema runs every migration.
KLIQUE_SCHEMA_TEMPLATE = env.flag("KLIQUE_SCHEMA_TEMPLATE", default=True)
# Lifetime of a new API token when the request names none, and the longest one may ask for.
KLIQUE_TOKEN_DEFAULT_DAYS = env.integer("KLIQUE_TOKEN_DEFAULT_DAYS", default=90, minimum=1)
KLIQUE_TOKEN_MAX_DAYS = env.integer("KLIQUE_TOKEN_MAX_DAYS", default=365, minimum=1)
# Events within this many seconds share one scheduling cycle; beat runs one per tenant every so often anyway.
KLIQUE_CYCLE_DEBOUNCE_SECONDS = env.integer("KLIQUE_CYCLE_DEBOUNCE_MS", default=500, minimum=0) / 1000
KLIQUE_CYCLE_SAFETY_NET_SECONDS = env.integer("KLIQUE_CYCLE_SAFETY_NET_SECONDS", default=30, minimum=1)
# A tenant with at least this many queued tasks is kept in the worker between cycles, and a cycle decides only
# what changed since the last one, with a full cycle read afresh at least every KLIQUE_CYCLE_FULL_SECONDS
# (apps/scheduling/incremental.py). 0 keeps every tenant.
KLIQUE_CYCLE_INCREMENTAL_FROM = env.integer("KLIQUE_CYCLE_INCREMENTAL_FROM", default=1000, minimum=0)
KLIQUE_CYCLE_FULL_SECONDS = env.integer("KLIQUE_CYCLE_FULL_SECONDS", default=30, minimum=1)
# The walk (tenants/due.py): this many tenants visited every so many seconds; 10,000 tenants in 50 minutes.
KLIQUE_DUE_WALK_PAGE = env.integer("KLIQUE_DUE_WALK_PAGE", default=200, minimum=1)
KLIQUE_DUE_WALK_SECONDS = env.integer("KLIQUE_DUE_WALK_SECONDS", default=60, minimum=1)
# A worker that takes no message this long while its queue holds some and it has a free slot ends itself,
# to be started again (config/watchdog.py: its consumer was lost with a Redis restart); 0 turns this off.
KLIQUE_WORKER_STALL_SECONDS = env.integer("KLIQUE_WORKER_STALL_SECONDS", default=60, minimum=0)

SHARED_APPS = [
    "django_tenants",
    "tenants",
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "apps.core",
    # Users live in both: provider admins in the public schema, each tenant's people in its own schema.
    "apps.accounts",
    "apps.audit",  # the provider's actions are audited in the public schema, a tenant's in its own
    "apps.billing",  # the provider's Stripe customers and usage pushes
    "apps.provider",  # tenants' lifecycle, the Platform Management Center's API, the provider's commands
]
TENANT_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "apps.accounts",
    "apps.resources",
    "apps.configuration",  # the draft and its provisioning, the pools' and compute resources' API
    "apps.scheduling",
    "apps.fleet",
    "apps.catalogue",
    "apps.audit",
    "apps.vault",
    "apps.sso",
    "apps.metering",
    "apps.portal",  # the tenant portal's pages (templates and assets in frontend/)
    "gateway",  # the LLM gateway: its settings, budgets and usage live in each tenant's schema
]
INSTALLED_APPS = list(SHARED_APPS) + [app for app in TENANT_APPS if app not in SHARED_APPS]

TENANT_MODEL = "tenants.Tenant"
TENANT_DOMAIN_MODEL = "tenants.Domain"
PUBLIC_SCHEMA_NAME = "public"
# `SET search_path` only when the connection's schema changes, not before every cursor (a round trip
# each). django-tenants forgets what it set on a rollback, to a savepoint too, and on a new connection.
TENANT_LIMIT_SET_CALLS = True
# The bearer token's row is read in the round trip that finds the request's tenant (tenants.middleware).
TENANT_ENTER_READ = "apps.accounts.authentication.BearerRead"
ROOT_URLCONF = "config.urls"
PUBLIC_SCHEMA_URLCONF = "config.urls_public"
AUTH_USER_MODEL = "accounts.User"

MIDDLEWARE = [
    "apps.core.middleware.RequestContextMiddleware",
    "apps.core.middleware.ProbeMiddleware",
    "tenants.middleware.TenantMiddleware",
    "apps.core.middleware.RefuseNulMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # Django's session, CSRF, auth and message middlewares, passed by a bearer-token API call, which uses
    # none of them (apps.core.portal_middleware).
    "apps.core.portal_middleware.PortalSessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "apps.core.portal_middleware.PortalCsrfMiddleware",
    "apps.core.portal_middleware.PortalAuthenticationMiddleware",
    "apps.core.portal_middleware.PortalMessageMiddleware",
    "apps.audit.middleware.RefusedUseAudit",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "apps.core.middleware.PortalContentSecurityPolicy",
]
X_FRAME_OPTIONS = "DENY"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "frontend" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

ASGI_APPLICATION = "config.asgi.application"


def database_settings(url: str, *, pool_size: int, prepared: bool = True) -> dict[str, object]:
    """Connection settings. Under ASGI, Django runs each request's sync code in a thread of its own, so
    per-thread persistent connections would mean a new PostgreSQL connection per request; the web process
    therefore shares a psycopg pool (pool_size > 0). Celery's prefork children keep plain persistent
    connections: a pool's threads do not survive fork."""
    database = dict(dj_database_url.parse(url, conn_max_age=60, conn_health_checks=True))
    database["ENGINE"] = "django_tenants.postgresql_backend"
    # A request's writes commit together or not at all; side effects wait for the commit (on_commit).
    database["ATOMIC_REQUESTS"] = True
    # The few statements every request makes are prepared (apps.core.postgresql.prepared_cursor), unless a
    # pooler in front of PostgreSQL cannot keep prepared statements (PgBouncer in transaction mode before
    # 1.21, or without max_prepared_statements).
    database["PREPARED_STATEMENTS"] = prepared
    if pool_size:
        database["CONN_MAX_AGE"] = 0
        # With a pool, Django's health checks are the pool's: each connection is checked as it leaves
        # the pool, so after a PostgreSQL restart a broken one is replaced there instead of failing the
        # request that drew it (apps.core.postgresql: by a poll of its socket, a query only where it has
        # something to read).
        database["CONN_HEALTH_CHECKS"] = True
        options = dict(database.get("OPTIONS") or {})  # type: ignore[call-overload]
        options["pool"] = {"min_size": 1, "max_size": pool_size, "timeout": 10}
        database["OPTIONS"] = options
    return database


# `klique web` sets KLIQUE_DB_POOL_SIZE; other processes connect without a pool.
DATABASES = {
    "default": database_settings(
        env.database_url(),
        pool_size=env.integer("KLIQUE_DB_POOL_SIZE", default=0),
        prepared=env.flag("KLIQUE_DB_PREPARED_STATEMENTS", default=True),
    )
}
DATABASE_ROUTERS = ["django_tenants.routers.TenantSyncRouter"]
# The backend django-tenants' own is built on: Django's, with Klique's pool check (apps.core.postgresql).
ORIGINAL_BACKEND = "apps.core.postgresql"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env.redis_url()
# Redis publish/subscribe: Klique only sends to groups of connected websockets (events, logs, agents'
# notices), which pub/sub does with one subscriber connection per process. The list-based layer
# (channels_redis.core) shares one blocking pop per process under a lock; a websocket closing while its
# consumer held that pop could leave it stuck, and every other websocket of the process without messages.
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
        "CONFIG": {"hosts": [{"address": REDIS_URL}], "prefix": "klique:channels:"},
    },
}

CELERY_BROKER_URL = env.celery_broker_url(REDIS_URL)
# No result backend: nothing in Klique reads a task's return value (state lives in PostgreSQL). With a
# Redis result backend every send also subscribes the sender to the task's result channel: the web
# process gathers subscriptions it never reads, and while Redis is away each send stalls for some
# twenty seconds in that subscription's reconnect, which in a worker process holds up every task it has.
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# A task is acknowledged only when it has finished, so a killed worker's task is delivered again.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Remote control rides on a Redis pub/sub (fanout) channel, and kombu's redis transport can crash the
# whole worker ("Unrecoverable error") when Redis goes away under it; Klique sends no control commands,
# so the worker keeps only its task queue and rides out a Redis restart by reconnecting.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
# Workers log through Django's LOGGING, so their lines are JSON with the tenant a task runs for.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE_FILENAME = str(KLIQUE_DATA_DIR / "celerybeat-schedule")
# Periodic work goes only to the tenants marked as having it due (tenants/due.py): a tenant at rest costs
# one Redis read per entry and a visit of the walk per sweep, not a task per tick.
CELERY_BEAT_SCHEDULE = {
    "scheduling-safety-net": {  # tenants with tasks queued or running: leases, limits, lost agents
        "task": "tenants.for_marked_tenants",
        "schedule": float(KLIQUE_CYCLE_SAFETY_NET_SECONDS),
        "args": ("scheduling.run_cycle", ["cycle"]),
    },
    "apps-reclaim-idle": {  # apps without requests for their idle timeout are stopped, GPUs handed back
        "task": "tenants.for_marked_tenants",
        "schedule": 60.0,
        "args": ("catalogue.reclaim_idle", ["cycle"]),
    },
    "purge-expired-tokens": {
        "task": "tenants.for_marked_tenants",
        "schedule": 600.0,
        "args": ("accounts.token_purge_expired", ["token_purge"]),
    },
    "gateway-usage-outbox": {"task": "gateway.drain_usage_outbox", "schedule": 30.0},
    "metering-gateway-calls": {
        "task": "tenants.for_marked_tenants",
        "schedule": 15.0,
        "args": ("metering.gateway_calls", ["gateway_calls"]),
    },
    "billing-push-pending": {"task": "billing.push_pending", "schedule": 300.0},
    "metering-running-gpus": {  # each hour's GPU time of running tasks, a few minutes after the hour
        "task": "tenants.for_marked_tenants",
        "schedule": 300.0,
        "args": ("metering.running_gpus", ["cycle"]),
    },
    "metering-storage": {
        "task": "tenants.for_marked_tenants",
        "schedule": 3600.0,
        "args": ("metering.storage", ["storage"]),
    },
    "gateway-sweep-holds": {"task": "gateway.sweep_holds", "schedule": 600.0},
    "queue-wait-objectives": {  # SLO attainment; slo.at_risk / slo.breached / slo.recovered on changes
        "task": "tenants.for_marked_tenants",
        "schedule": 60.0,
        "args": ("scheduling.objectives", ["cycle", "objectives"]),
    },
    "due-walk": {  # the slow safety net: a page of tenants a tick, marking the work each has due
        "task": "tenants.walk_due",
        "schedule": float(KLIQUE_DUE_WALK_SECONDS),
    },
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.accounts.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
    "EXCEPTION_HANDLER": "apps.core.api_errors.exception_handler",
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "apps.core.negotiation.ContentNegotiation",
    "DEFAULT_PARSER_CLASSES": [
        "apps.core.parsers.JSONParser",  # refuses NUL characters, which PostgreSQL's text cannot hold
        "apps.core.parsers.FormParser",
        "apps.core.parsers.MultiPartParser",
    ],
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Klique API",
    "DESCRIPTION": "One queue model over every place GPUs live.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 12}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

# Browsers ignore (and complain about) Cross-Origin-Opener-Policy on plain-HTTP origins other than
# localhost, as local tenant addresses are; production, served over HTTPS, sets it (settings/production.py).
SECURE_CROSS_ORIGIN_OPENER_POLICY: str | None = None

STATIC_URL = "/static/"
# The portal's own assets, and the front-end packages `make install` fetches with npm (frontend/package.json).
STATICFILES_DIRS = [
    BASE_DIR / "frontend" / "static",
    ("vendor/htmx", BASE_DIR / "frontend" / "node_modules" / "htmx.org" / "dist"),
    ("vendor/chart.js", BASE_DIR / "frontend" / "node_modules" / "chart.js" / "dist"),
]
STATIC_ROOT: Path | None = KLIQUE_DATA_DIR / "static"
# Task outputs and other files; a deployment points this at shared storage (see the README).
MEDIA_ROOT = Path(env.text("KLIQUE_FILES_DIR", str(KLIQUE_DATA_DIR / "files")) or KLIQUE_DATA_DIR / "files")
KLIQUE_MAX_OUTPUT_BYTES = env.integer("KLIQUE_MAX_OUTPUT_MB", default=512, minimum=1) * 1024 * 1024
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False
CSRF_FAILURE_VIEW = "apps.core.views.csrf_refused"

LOG_FORMAT = env.text("KLIQUE_LOG_FORMAT", "json")
LOG_LEVEL = (env.text("KLIQUE_LOG_LEVEL", "INFO") or "INFO").upper()
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {"()": "apps.core.logging.JsonFormatter"},
        "text": {"()": "apps.core.logging.TextFormatter"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT},
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.server": {"level": "WARNING"},
        # 4xx responses are in the access log already, with their request id; keep 5xx reports only.
        "django.request": {"level": "ERROR"},
        "uvicorn.access": {"level": "WARNING"},
    },
}

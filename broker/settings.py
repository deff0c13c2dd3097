"""Settings for the WhaleZen broker.

Defaults give a self-contained service (SQLite, a file-based task queue, a local-memory cache; a disk cache
shared by the web server's processes).
`DATABASE_URL` switches to PostgreSQL, `REDIS_URL` to Redis for the task queue and the cache.
`DJANGO_ENV=production` turns on the hardened settings that `manage.py check --deploy` expects.
"""
from __future__ import annotations

import ipaddress
import os
from datetime import timedelta
from pathlib import Path

import dj_database_url

from broker.var_dir import BASE_DIR, var_dir

VAR_DIR = var_dir()


def _close_var_dir(path: Path) -> None:
    """The var dir holds the embedded database, logs and the demo agents' folders, and on a demo
    machine jobs run there as another user: they may pass through it (their work dirs are inside)
    but never list it; what it holds is closed file by file (the database is 0600, broker.sqlite)."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        path.chmod(0o711)
    except PermissionError:  # not ours (a shared, read-only checkout): leave it as its owner set it
        pass


_close_var_dir(VAR_DIR)

ENVIRONMENT = os.environ.get("DJANGO_ENV", "development")
PRODUCTION = ENVIRONMENT == "production"

_DEV_SECRET = "dev-only-insecure-secret-key-change-me-in-production-0123456789abcdef"
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "" if PRODUCTION else _DEV_SECRET)
if PRODUCTION and not SECRET_KEY:
    raise RuntimeError("DJANGO_SECRET_KEY must be set when DJANGO_ENV=production")

# Off unless asked for, also in development: `make run` is the service new users and anonymous callers
# meet, and Django's debug pages would show them every URL pattern (any 404 off the API) and, on an
# error, a traceback with the settings; recording every query also costs the web server about 4%.
DEBUG = os.environ.get("DJANGO_DEBUG", "0") == "1"
ALLOWED_HOSTS = [
    h.strip()
    for h in os.environ.get(
        "DJANGO_ALLOWED_HOSTS", "" if PRODUCTION else "127.0.0.1,localhost,testserver,[::1]"
    ).split(",")
    if h.strip()
]
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]

INSTALLED_APPS = [
    # django.contrib.admin with a site for superusers only (the admin is not tenant-scoped).
    "broker.tenancy.apps.OperatorAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "axes",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "broker.tenancy",
    "broker.inventory",
    "broker.jobs",
    "broker.scheduler",
    "broker.agents",
    "broker.provisioning",
    "broker.ops",
    "broker.billing",
    "broker.console",
    "django_htmx",
]

MIDDLEWARE = [
    # Outermost: every response gets its X-Request-ID, and errors under /api/ answer JSON.
    "broker.api.middleware.RequestIdMiddleware",
    # Times every request for /metrics (whalezen_api_request_duration_seconds).
    "broker.ops.request_metrics.RequestDurationMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    # request.htmx: console views answer an htmx request with the fragment it swaps in.
    "django_htmx.middleware.HtmxMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: answers a locked-out login with 429.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "broker.urls"
WSGI_APPLICATION = "broker.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "broker.console.context_processors.console",
            ],
        },
    },
]

DATABASE_URL = os.environ.get("DATABASE_URL", "")
if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
else:
    DATABASES = {
        "default": {
            # Django's SQLite backend, with one process's writers queued on a lock (see its docstring).
            "ENGINE": "broker.sqlite",
            "NAME": VAR_DIR / "whalezen.sqlite3",
            # A connection per thread kept between requests, as on PostgreSQL: opening one (Django registers
            # its SQL functions, then the PRAGMAs below) was a tenth of a heartbeat's CPU (bench.service).
            "CONN_MAX_AGE": 60,
            # Tests in memory, as Django does for its own SQLite engine; said explicitly because
            # pytest-django's xdist support recognises only that engine's name, and would otherwise
            # give each worker a file beside the real database.
            "TEST": {"NAME": ":memory:"},
            "OPTIONS": {
                # SQLite serialises writers; wait up to this many seconds for the lock instead of failing.
                "timeout": 20,
                # Writes take the lock at BEGIN: a deferred transaction that reads and then writes cannot
                # wait for the lock (SQLite answers "database is locked" at once, skipping the busy timeout).
                "transaction_mode": "IMMEDIATE",
                # WAL: readers never block the writer nor the writer them (the default rollback journal makes
                # a committing writer wait for every open read, e.g. a scheduling cycle's snapshot); NORMAL
                # sync is durable in WAL mode except for the last commits on power loss, and commits faster.
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
            },
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL", "")
if REDIS_URL:
    # Django's Redis cache, less a client object built per call (broker/ops/cache.py).
    CACHES = {"default": {"BACKEND": "broker.ops.cache.SharedClientRedisCache", "LOCATION": REDIS_URL}}
elif os.environ.get("WHALEZEN_WEB_SHARED_DIR"):
    # The processes of one web server (broker/ops/gunicorn_conf.py sets the directory): SQLite files, so that
    # a rate limit counts every process's requests (broker/ops/cache.py).
    CACHES = {"default": {"BACKEND": "broker.ops.cache.SharedDiskCache",
                          "LOCATION": os.path.join(os.environ["WHALEZEN_WEB_SHARED_DIR"], "cache"),
                          # One SQLite file: each thread opens every shard on its first use (8 by default).
                          "SHARDS": 1}}
else:  # one process: a management command, the worker, the tests
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Password logins (the admin's) are throttled by django-axes: its backend first refuses a locked-out
# username + IP before any password is checked. API tokens and node tokens do not go through these.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# 5 failed logins for one username from one IP lock that pair out for 15 minutes (a success before
# that resets the count). Attempts are kept in the database (AccessAttempt, visible in the admin).
# The client IP is REMOTE_ADDR: behind a reverse proxy install django-ipware and set AXES_IPWARE_*.
AXES_FAILURE_LIMIT = int(os.environ.get("WHALEZEN_LOGIN_FAILURE_LIMIT", 5))
AXES_COOLOFF_TIME = timedelta(minutes=int(os.environ.get("WHALEZEN_LOGIN_COOLOFF_MINUTES", 15)))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False  # no "AXES: BEGIN ..." banner on every manage.py command

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# The console's login page; after login, its dashboard.
LOGIN_URL = "console:login"
LOGIN_REDIRECT_URL = "console:dashboard"

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Serve static files from the app directories without collectstatic in development.
WHITENOISE_USE_FINDERS = not PRODUCTION
if not PRODUCTION:
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "broker.tenancy.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["broker.tenancy.permissions.IsTenantMember"],
    "DEFAULT_PARSER_CLASSES": [
        "broker.api.parsers.BoundedJSONParser",
        "broker.api.parsers.BoundedYAMLParser",
        "broker.api.parsers.YAMLAliasParser",
        "broker.api.parsers.TextYAMLParser",
    ],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PAGINATION_CLASS": "broker.api.pagination.StandardPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "broker.api.errors.exception_handler",
    "DEFAULT_THROTTLE_RATES": {
        "job_submit": os.environ.get("WHALEZEN_SUBMIT_RATE", "600/min"),
    },
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    # Per-address throttles (agent registration) read REMOTE_ADDR: X-Forwarded-For is the client's
    # to forge unless this many proxies in front of the broker set it.
    "NUM_PROXIES": int(os.environ.get("WHALEZEN_NUM_PROXIES", 0)),
}

SPECTACULAR_SETTINGS = {
    "TITLE": "WhaleZen API",
    "DESCRIPTION": "Multi-cloud GPU broker: submit GPU jobs, follow them, see your capacity.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    # No badge from validator.swagger.io: the page would load it from there with our schema's URL.
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "APPEND_COMPONENTS": {
        "securitySchemes": {
            "bearerAuth": {"type": "http", "scheme": "bearer", "description": "WhaleZen API token (wz_...)"}
        }
    },
    "SECURITY": [{"bearerAuth": []}],
}

# The tag value that marks cloud resources as ours (keep it stable: the reconciler trusts it).
WHALEZEN_BROKER_ID = os.environ.get("WHALEZEN_BROKER_ID", "whalezen")
# The URL node agents (on cloud instances too) use to reach this broker.
WHALEZEN_PUBLIC_URL = os.environ.get("WHALEZEN_PUBLIC_URL", f"http://127.0.0.1:{os.environ.get('PORT', '8000')}")
# How long a place that failed with a capacity/quota error is left out of the offers.
WHALEZEN_OFFER_BLOCK_SECONDS = int(os.environ.get("WHALEZEN_OFFER_BLOCK_SECONDS", 900))
# A cloud instance with no job for this long is terminated; orphans older than the grace are too.
WHALEZEN_IDLE_INSTANCE_SECONDS = int(os.environ.get("WHALEZEN_IDLE_INSTANCE_SECONDS", 600))
WHALEZEN_ORPHAN_GRACE_SECONDS = int(os.environ.get("WHALEZEN_ORPHAN_GRACE_SECONDS", 900))
# A placed job not started by its node within this time, or an instance not registered within the
# boot timeout, is given up on and its jobs are placed again.
WHALEZEN_START_TIMEOUT_SECONDS = int(os.environ.get("WHALEZEN_START_TIMEOUT_SECONDS", 600))
WHALEZEN_BOOT_TIMEOUT_SECONDS = int(os.environ.get("WHALEZEN_BOOT_TIMEOUT_SECONDS", 1200))
# Agents heartbeat every WHALEZEN_AGENT_HEARTBEAT_SECONDS; a node silent for
# WHALEZEN_NODE_LOST_AFTER_SECONDS while the broker is up is LOST. After the broker itself was down
# (worker gap, or the web server not answering WHALEZEN_BROKER_PROBE_URL; "" = never probe), every
# node gets that limit again plus WHALEZEN_AGENT_RETRY_CAP_SECONDS (the agents' backoff cap). A job
# requeued from a LOST node starts again once its old copy is confirmed stopped, or after
# WHALEZEN_FENCE_WAIT_SECONDS (unset: WHALEZEN_AGENT_FENCE_AFTER_SECONDS + the LOST limit + two
# heartbeats; broker/agents/fencing.py says what that bound covers). Agents cut off from the broker
# stop their jobs after WHALEZEN_AGENT_FENCE_AFTER_SECONDS (agent --fence-after-seconds, read from
# the same variable: keep them equal; 0 = agents never do, and the wait is then two LOST periods).
WHALEZEN_AGENT_HEARTBEAT_SECONDS = int(os.environ.get("WHALEZEN_AGENT_HEARTBEAT_SECONDS", 5))
WHALEZEN_NODE_LOST_AFTER_SECONDS = int(os.environ.get("WHALEZEN_NODE_LOST_AFTER_SECONDS",
                                                      6 * WHALEZEN_AGENT_HEARTBEAT_SECONDS))
WHALEZEN_AGENT_RETRY_CAP_SECONDS = int(os.environ.get("WHALEZEN_AGENT_RETRY_CAP_SECONDS", 60))
WHALEZEN_AGENT_FENCE_AFTER_SECONDS = int(os.environ.get("WHALEZEN_AGENT_FENCE_AFTER_SECONDS", 900))
WHALEZEN_FENCE_WAIT_SECONDS = (int(os.environ["WHALEZEN_FENCE_WAIT_SECONDS"])
                               if os.environ.get("WHALEZEN_FENCE_WAIT_SECONDS") else None)
WHALEZEN_BROKER_PROBE_URL = os.environ.get("WHALEZEN_BROKER_PROBE_URL", WHALEZEN_PUBLIC_URL.rstrip("/") + "/healthz")

# Agent routes (broker/agents/throttles.py): registration per client address, the rest per node.
WHALEZEN_AGENT_REGISTER_RATE = os.environ.get("WHALEZEN_AGENT_REGISTER_RATE", "30/min")
WHALEZEN_AGENT_HEARTBEAT_RATE = os.environ.get("WHALEZEN_AGENT_HEARTBEAT_RATE", "60/min")
WHALEZEN_AGENT_ASSIGNMENTS_RATE = os.environ.get("WHALEZEN_AGENT_ASSIGNMENTS_RATE", "60/min")
WHALEZEN_AGENT_STATUS_RATE = os.environ.get("WHALEZEN_AGENT_STATUS_RATE", "600/min")

# Largest request body the API parses; bigger ones get a 400 naming `body`.
WHALEZEN_MAX_BODY_BYTES = int(os.environ.get("WHALEZEN_MAX_BODY_BYTES", 256 * 1024))
# Deepest nesting of lists/objects a JSON or YAML body may have (job specs need 3, agents 4).
WHALEZEN_MAX_BODY_DEPTH = int(os.environ.get("WHALEZEN_MAX_BODY_DEPTH", 32))
# Local checkpoint URIs (absolute paths, file://) must lie under one of these directories.
WHALEZEN_CHECKPOINT_ROOTS = [
    r.strip() for r in os.environ.get("WHALEZEN_CHECKPOINT_ROOTS", str(VAR_DIR / "checkpoints")).split(",") if r.strip()
]
# A checkpoint request that gets no committed checkpoint in this time is given up (the job runs on).
WHALEZEN_CHECKPOINT_TIMEOUT_SECONDS = float(os.environ.get("WHALEZEN_CHECKPOINT_TIMEOUT_SECONDS", 300))
# Preemption and moves (broker.jobs.migration): a job is neither preempted nor moved before it has run
# this long since it (re)started; a preempted job with checkpoints gets the grace to commit one.
WHALEZEN_MIN_RUN_BEFORE_PREEMPT_SECONDS = float(os.environ.get("WHALEZEN_MIN_RUN_BEFORE_PREEMPT_SECONDS", 600))
WHALEZEN_MIN_RUN_BEFORE_MOVE_SECONDS = float(os.environ.get("WHALEZEN_MIN_RUN_BEFORE_MOVE_SECONDS", 600))
WHALEZEN_MAX_MOVES_PER_CYCLE = int(os.environ.get("WHALEZEN_MAX_MOVES_PER_CYCLE", 4))
WHALEZEN_CONSOLIDATION_INTERVAL_SECONDS = float(os.environ.get("WHALEZEN_CONSOLIDATION_INTERVAL_SECONDS", 60))
# Monitoring endpoints (/metrics, /metrics/targets): loopback always; others with this bearer token or from these
# addresses / CIDR networks (comma-separated). Checked here, at start, so a typo fails loudly.
WHALEZEN_METRICS_TOKEN = os.environ.get("WHALEZEN_METRICS_TOKEN", "")
WHALEZEN_METRICS_ALLOW = os.environ.get("WHALEZEN_METRICS_ALLOW", "")
for _network in filter(None, (n.strip() for n in WHALEZEN_METRICS_ALLOW.split(","))):
    ipaddress.ip_network(_network, strict=False)  # raises ValueError naming the bad entry
WHALEZEN_PREEMPTION_GRACE_SECONDS = float(os.environ.get("WHALEZEN_PREEMPTION_GRACE_SECONDS", 120))
# Fair share (issue 11): a team's past GPU-hours on owned capacity count half after this many hours (Slurm's
# PriorityDecayHalfLife, default 7 days).
WHALEZEN_FAIR_SHARE_HALF_LIFE_HOURS = float(os.environ.get("WHALEZEN_FAIR_SHARE_HALF_LIFE_HOURS", 168))
# Seconds between two updates of the teams' decayed usage by the scheduling cycles (each update charges what
# the teams hold then for the whole interval since the last).
WHALEZEN_FAIR_SHARE_STEP_SECONDS = float(os.environ.get("WHALEZEN_FAIR_SHARE_STEP_SECONDS", 30))
WHALEZEN_MIGRATION_STOP_TIMEOUT_SECONDS = float(os.environ.get("WHALEZEN_MIGRATION_STOP_TIMEOUT_SECONDS", 120))
# Where the broker reads s3:// checkpoints to verify them (None: AWS itself; set for MinIO or moto).
WHALEZEN_CHECKPOINT_S3_ENDPOINT_URL = os.environ.get("WHALEZEN_CHECKPOINT_S3_ENDPOINT_URL") or None
DATA_UPLOAD_MAX_MEMORY_SIZE = WHALEZEN_MAX_BODY_BYTES
# Uploads (broker/jobs/uploads.py, docs/job-spec.md "Uploads"): the tar.gz archives `whalezen submit` sends of a
# SkyPilot task's local workdir / file_mounts. Their route streams the body to disk (the body limit above does not
# apply to it); blobs live under WHALEZEN_UPLOAD_DIR, never in the database.
WHALEZEN_UPLOAD_DIR = Path(os.environ.get("WHALEZEN_UPLOAD_DIR", VAR_DIR / "uploads"))
WHALEZEN_MAX_UPLOAD_BYTES = int(os.environ.get("WHALEZEN_MAX_UPLOAD_BYTES", 64 * 1024 * 1024))
WHALEZEN_MAX_UPLOADS_PER_TENANT = int(os.environ.get("WHALEZEN_MAX_UPLOADS_PER_TENANT", 500))
WHALEZEN_MAX_UPLOAD_BYTES_PER_TENANT = int(os.environ.get("WHALEZEN_MAX_UPLOAD_BYTES_PER_TENANT", 10 * 1024 ** 3))
# An upload no unfinished job names is deleted this long after it was sent.
WHALEZEN_UPLOAD_EXPIRY_DAYS = float(os.environ.get("WHALEZEN_UPLOAD_EXPIRY_DAYS", 7))
# How long the token in a job's assignment may download its upload (the job fetches it as it starts).
WHALEZEN_UPLOAD_TOKEN_SECONDS = int(os.environ.get("WHALEZEN_UPLOAD_TOKEN_SECONDS", 24 * 3600))

# Task queue: Redis when REDIS_URL is set, otherwise Celery's file-system transport under var/.
CELERY_TASK_ALWAYS_EAGER = os.environ.get("WHALEZEN_TASKS_EAGER", "0") == "1"
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS: dict = {"visibility_timeout": 3600}
else:
    _queue_dir = VAR_DIR / "queue"
    for _sub in ("in", "processed", "control"):
        (_queue_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_queue_dir / "in"),
        "data_folder_out": str(_queue_dir / "in"),
        "processed_folder": str(_queue_dir / "processed"),
        "control_folder": str(_queue_dir / "control"),
        "store_processed": False,
    }
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("WHALEZEN_QUEUE", "whalezen")
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TIME_LIMIT = 600
CELERY_TASK_SOFT_TIME_LIMIT = 540
CELERY_TASK_IGNORE_RESULT = True
WHALEZEN_CYCLE_SECONDS = float(os.environ.get("WHALEZEN_CYCLE_SECONDS", 5))
# A worker killed mid-cycle holds its tenant's cycle lease at most this long.
WHALEZEN_CYCLE_LEASE_SECONDS = int(os.environ.get("WHALEZEN_CYCLE_LEASE_SECONDS", 120))
# A queue whose inputs did not change since a cycle that changed nothing is decided again at least this
# often (broker/scheduler/digest.py): run times, checkpoint ages and spend change with time alone.
WHALEZEN_CYCLE_REFRESH_SECONDS = float(os.environ.get("WHALEZEN_CYCLE_REFRESH_SECONDS", 60))
CELERY_BEAT_SCHEDULE = {
    "scheduling-sweep": {"task": "scheduler.sweep", "schedule": WHALEZEN_CYCLE_SECONDS},
    "provisioning-sweep": {"task": "provisioning.sweep", "schedule": 30.0},
    # Must stay well under WHALEZEN_NODE_LOST_AFTER_SECONDS: a longer gap between runs reads as an outage.
    "agents-mark-lost": {"task": "agents.mark_lost",
                         "schedule": float(os.environ.get("WHALEZEN_LOST_SWEEP_SECONDS", 10))},
    "refresh-offers": {"task": "provisioning.refresh_offers", "schedule": 900.0},
    "checkpoints-sweep": {"task": "checkpoints.sweep", "schedule": 5.0},
    # Usage records, utilisation samples and budget alerts (broker/billing): the price of an allocation is
    # fixed by the first run after it starts, so keep this short.
    "billing-meter": {"task": "billing.meter", "schedule": float(os.environ.get("WHALEZEN_BILLING_METER_SECONDS", 60))},
    # Uploads no unfinished job names, older than WHALEZEN_UPLOAD_EXPIRY_DAYS (broker/jobs/uploads.py).
    "uploads-expire": {"task": "uploads.expire", "schedule": 3600.0},
}
# GPU readings of nodes without the WhaleZen agent, from a site's Prometheus scraping dcgm-exporter
# (broker/agents/prometheus_telemetry.py). Empty: off.
WHALEZEN_PROMETHEUS_URL = os.environ.get("WHALEZEN_PROMETHEUS_URL", "")
if WHALEZEN_PROMETHEUS_URL:
    CELERY_BEAT_SCHEDULE["prometheus-telemetry"] = {
        "task": "agents.prometheus_telemetry",
        "schedule": float(os.environ.get("WHALEZEN_PROMETHEUS_TELEMETRY_SECONDS", 30))}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": os.environ.get("WHALEZEN_LOG_LEVEL", "INFO")},
}

if PRODUCTION:
    SECURE_SSL_REDIRECT = os.environ.get("DJANGO_SECURE_SSL_REDIRECT", "1") == "1"
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(os.environ.get("DJANGO_HSTS_SECONDS", 31536000))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_CONTENT_TYPE_NOSNIFF = True
    SECURE_REFERRER_POLICY = "same-origin"
    X_FRAME_OPTIONS = "DENY"
    # /healthz is probed over plain HTTP by the orchestrator.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$"]

from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from broker.api.health import healthz
from broker.api.metrics import metrics, metrics_targets
from broker.ops.agent_package import agent_package

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("metrics/targets", metrics_targets, name="metrics-targets"),
    path("agent/package.tar.gz", agent_package, name="agent-package"),
    path("admin/", admin.site.urls),
    path("api/v1/agent/", include("broker.agents.urls")),
    path("api/v1/", include("broker.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(permission_classes=[], authentication_classes=[]), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[],
                                                     authentication_classes=[]), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema", permission_classes=[],
                                                    authentication_classes=[]), name="api-redoc"),
    # Browsers ask for /favicon.ico whatever a page links: the console's icon, not a 404.
    path("favicon.ico", RedirectView.as_view(url=static("console/whalezen.svg"), permanent=True)),
    # The web console (broker/console/): "/" is its dashboard.
    path("", include("broker.console.urls")),
]
handler404 = "broker.api.errors.not_found"

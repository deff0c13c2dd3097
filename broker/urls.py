from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from broker.api.health import healthz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("admin/", admin.site.urls),
    path("api/v1/agent/", include("broker.agents.urls")),
    path("api/v1/", include("broker.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(permission_classes=[], authentication_classes=[]), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[],
                                                     authentication_classes=[]), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema", permission_classes=[],
                                                    authentication_classes=[]), name="api-redoc"),
]

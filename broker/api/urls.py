from broker.api import schema as _schema  # noqa: F401  (registers OpenAPI extensions)
from django.urls import include, path
from rest_framework.routers import DefaultRouter

from broker.api.inventory import GpuModelViewSet, NodeViewSet, PoolViewSet, QuotaView
from broker.api.jobs import JobViewSet
from broker.api.tokens import TokenViewSet

router = DefaultRouter()
router.include_root_view = False
router.register("jobs", JobViewSet, basename="job")
router.register("gpu-models", GpuModelViewSet, basename="gpu-model")
router.register("pools", PoolViewSet, basename="pool")
router.register("nodes", NodeViewSet, basename="node")
router.register("tokens", TokenViewSet, basename="token")

urlpatterns = [
    path("quota/", QuotaView.as_view(), name="quota"),
    path("", include(router.urls)),
]

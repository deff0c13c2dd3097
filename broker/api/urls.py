from broker.api import schema as _schema  # noqa: F401  (registers OpenAPI extensions)
from django.urls import include, path
from rest_framework.routers import DefaultRouter

from broker.api.inventory import GpuModelViewSet, NodeViewSet, PoolViewSet, QuotaView
from broker.api.jobs import JobViewSet
from broker.api.tokens import TokenViewSet
from broker.api.uploads import UploadViewSet
from broker.billing.api import (BudgetView, CostsView, QuoteView, SavingsView, StatementDetailView,
                               StatementListView)

router = DefaultRouter()
router.include_root_view = False
router.register("jobs", JobViewSet, basename="job")
router.register("gpu-models", GpuModelViewSet, basename="gpu-model")
router.register("pools", PoolViewSet, basename="pool")
router.register("nodes", NodeViewSet, basename="node")
router.register("tokens", TokenViewSet, basename="token")
router.register("uploads", UploadViewSet, basename="upload")

urlpatterns = [
    path("quota/", QuotaView.as_view(), name="quota"),
    # Billing (broker/billing/api.py).
    path("costs/", CostsView.as_view(), name="costs"),
    path("costs/savings/", SavingsView.as_view(), name="costs-savings"),
    path("statements/", StatementListView.as_view(), name="statements"),
    # {id} is the month (YYYY-MM), named as every other path parameter of the API.
    path("statements/<str:id>/", StatementDetailView.as_view(), name="statement"),
    path("budget/", BudgetView.as_view(), name="budget"),
    path("quotes/", QuoteView.as_view(), name="quotes"),
    path("", include(router.urls)),
]

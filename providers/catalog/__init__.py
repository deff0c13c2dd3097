"""The price catalog: CSV -> Offers, and availability refresh from provider APIs."""
from providers.catalog.availability import (
    AvailabilityReport,
    AwsAvailability,
    GcpAvailability,
    available_only,
    refresh_availability,
)
from providers.catalog.loader import CatalogLoad, load_catalog_csv, load_default_catalog

__all__ = [
    "AvailabilityReport",
    "AwsAvailability",
    "CatalogLoad",
    "GcpAvailability",
    "available_only",
    "load_catalog_csv",
    "load_default_catalog",
    "refresh_availability",
]

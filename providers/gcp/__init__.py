"""GCP Compute Engine provider."""
from providers.gcp.provider import GcpProvider, instance_name, label_value, request_uuid

__all__ = ["GcpProvider", "instance_name", "label_value", "request_uuid"]

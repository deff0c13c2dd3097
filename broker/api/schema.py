"""OpenAPI extensions so the schema documents our own authentication, spec fields and error responses."""
from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "broker.tenancy.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "WhaleZen API token (wz_...)."}


# --- Error responses -----------------------------------------------------------------------------------------
# Every operation documents the errors it can answer, so clients (and the schema-driven fuzz test,
# tests/broker/test_api_fuzz.py) can rely on the document for non-2xx bodies too.

class ErrorDetailSerializer(serializers.Serializer):
    """DRF's error body for authentication, permission, not-found and throttling errors."""

    detail = serializers.CharField()


FIELD_ERRORS_SCHEMA = {
    "type": "object",
    "minProperties": 1,
    "description": "Each key names a bad field (`body` for an unreadable body, `non_field_errors` for the "
                   "whole object); each value lists the reasons, or nests the errors of a sub-object or list "
                   "item. A refused job operation adds `code`.",
    "additionalProperties": {
        "anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "object"}, {"type": "string"}],
    },
}
FIELD_ERRORS = OpenApiResponse(FIELD_ERRORS_SCHEMA, description="Bad input: each bad field with its reasons.")
CONFLICT = OpenApiResponse(FIELD_ERRORS_SCHEMA, description="Illegal state change (e.g. cancelling a finished "
                                                            "job): `state` and `code`.")
THROTTLED = OpenApiResponse(
    {"anyOf": [{"type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"]},
               FIELD_ERRORS_SCHEMA]},
    description="Too many submissions for this token, or too many pending jobs for the tenant.",
)


class WhaleZenAutoSchema(AutoSchema):
    """Adds the error responses every API operation can give to what the view documents itself.

    401: no, invalid, expired or revoked token. 403: not a tenant member, a viewer / read-only token
    writing, or a member changing another user's object. 404: an object that does not exist or belongs to another tenant, or a page past the end.
    400: bad request body or filter values.
    """

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        errors = {
            "401": OpenApiResponse(ErrorDetailSerializer, description="Missing, invalid, expired or revoked token."),
            "403": OpenApiResponse(ErrorDetailSerializer, description="Not allowed for this role or token scope, "
                                   "or (members) another user's job or token."),
        }
        if "{" in self.path or (self._is_list_view() and self._get_paginator() is not None):
            errors["404"] = OpenApiResponse(ErrorDetailSerializer,
                                            description="No such object for this tenant, or no such page.")
        has_body = self.method in ("POST", "PUT", "PATCH") and self.get_request_serializer() is not None
        if has_body or self._get_filter_parameters():
            errors["400"] = FIELD_ERRORS
        for code, response in errors.items():
            if code not in responses:
                responses[code] = self._get_response_for_code(response, code, direction=direction)
        return responses

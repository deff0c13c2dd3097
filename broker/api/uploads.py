"""/api/v1/uploads/: a team's uploaded archives (what `whalezen submit` sends of local folders).

POST takes the raw tar.gz as the body (`Content-Type: application/gzip`). This route alone reads its
body as a stream: its parser hands the stream to broker/jobs/uploads.py, which copies it to disk in
chunks with its own limit (WHALEZEN_MAX_UPLOAD_BYTES), so neither the API's JSON body limit
(WHALEZEN_MAX_BODY_BYTES) nor Django's DATA_UPLOAD_MAX_MEMORY_SIZE (which only guards `request.body`,
never read here) applies, and no other route accepts a big body.
"""
from __future__ import annotations

import re

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.exceptions import APIException, NotFound, UnsupportedMediaType, ValidationError
from rest_framework.parsers import BaseParser
from rest_framework.request import Request
from rest_framework.response import Response

from broker.api.base import TenantScopedMixin
from broker.api.fields import StrictSerializer
from broker.api.schema import FIELD_ERRORS, ErrorDetailSerializer, WhaleZenAutoSchema
from broker.jobs import uploads
from broker.jobs.models import Upload, UploadKind


class GzipStreamParser(BaseParser):
    """The body stays a stream (None when empty): the view streams it to disk with the size limit."""

    media_type = "application/gzip"

    def parse(self, stream, media_type=None, parser_context=None):
        return stream


class XGzipStreamParser(GzipStreamParser):
    media_type = "application/x-gzip"


class UploadSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    expires_at = serializers.SerializerMethodField(
        help_text="When it is deleted unless an unfinished job names it then.")

    class Meta:
        model = Upload
        fields = ["id", "kind", "sha256", "size_bytes", "unpacked_bytes", "members", "owner", "created_at",
                  "expires_at"]
        read_only_fields = fields

    def get_expires_at(self, upload: Upload) -> str:
        return serializers.DateTimeField().to_representation(uploads.upload_expires_at(upload))


class UploadQuerySerializer(StrictSerializer):
    kind = serializers.ChoiceField(choices=UploadKind.values, required=False, default=UploadKind.TREE,
                                   help_text="tree: a folder's archive (default); file: one file.")


class _Refused(APIException):
    def __init__(self, detail: str, status_code: int) -> None:
        super().__init__(detail)
        self.status_code = status_code


def _raise(err: uploads.UploadError):
    if err.status == 400:
        raise ValidationError({err.field: [err.message]})
    raise _Refused(err.message, err.status)


def _content_length(request: Request) -> int | None:
    text = str(request.META.get("CONTENT_LENGTH") or "")
    return int(text) if text.isascii() and text.isdigit() else None


class UploadViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                    viewsets.GenericViewSet):
    """Members upload and delete their own; admins delete any of the team's; every member lists them."""

    queryset = Upload.objects.select_related("owner").order_by("-created_at", "-id")
    serializer_class = UploadSerializer
    # Any id routes here (a malformed one is simply not found): auth is checked before the lookup.
    lookup_value_regex = "[^/.]+"
    schema = WhaleZenAutoSchema()
    owner_field = "owner"
    parser_classes = [GzipStreamParser, XGzipStreamParser]

    def get_object(self):
        # Ids are 32 hex characters: anything else (a NUL, which PostgreSQL refuses in a query) is
        # simply not found, after authentication, without a database round trip.
        if not re.fullmatch(r"[0-9a-f]{32}", str(self.kwargs.get(self.lookup_field, ""))):
            raise NotFound()
        return super().get_object()

    @extend_schema(
        request={"application/gzip": OpenApiTypes.BINARY},
        responses={201: UploadSerializer, 200: UploadSerializer, 400: FIELD_ERRORS,
                   409: OpenApiResponse(ErrorDetailSerializer, description="The team holds as many uploads or "
                                                                           "bytes as it may."),
                   415: OpenApiResponse(ErrorDetailSerializer, description="Not sent as application/gzip.")},
        parameters=[UploadQuerySerializer,
                    OpenApiParameter("X-Content-SHA256", str, OpenApiParameter.HEADER, required=False,
                                     description="The body's SHA-256 (hex); a body that differs is refused.")],
        description="Upload a tar.gz (the raw body). 201 with its id, to name as `upload:<id>` in a job's "
                    "`files`; 200 when this user already uploaded the same archive (same id, expiry restarted).")
    def create(self, request: Request) -> Response:
        query = UploadQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        body = request.data  # the stream (GzipStreamParser); {} for an empty body or one without a type
        length = _content_length(request)
        if not hasattr(body, "read"):
            if length:
                raise UnsupportedMediaType(request.content_type or "none",
                                           detail="Send the archive with Content-Type: application/gzip.")
            body = None
        try:
            upload, created = uploads.upload_receive(
                tenant=self.ctx.tenant, owner=request.user, stream=body, content_length=length,
                declared_sha256=request.META.get("HTTP_X_CONTENT_SHA256"), kind=query.validated_data["kind"])
        except uploads.UploadError as err:
            _raise(err)
        upload = self.get_queryset().get(pk=upload.pk)
        return Response(UploadSerializer(upload).data,
                        status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(responses={204: None, 409: OpenApiResponse(ErrorDetailSerializer,
                                                             description="An unfinished job names it.")})
    def destroy(self, request: Request, *args, **kwargs) -> Response:
        return super().destroy(request, *args, **kwargs)

    def perform_destroy(self, instance: Upload) -> None:
        try:
            uploads.upload_delete(upload=instance)
        except uploads.UploadError as err:
            _raise(err)

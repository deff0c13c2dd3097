"""/api/v1/tokens/: a user's API tokens. The secret is returned once, at creation."""
from __future__ import annotations

from datetime import timedelta

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from broker.api.base import TenantScopedMixin
from broker.api.fields import StrictCharField, StrictIntegerField, StrictSerializer
from broker.api.schema import WhaleZenAutoSchema
from broker.tenancy import services
from broker.tenancy.models import ApiToken, TokenScope
from django.utils import timezone


class TokenSerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="user.username", read_only=True)
    active = serializers.BooleanField(source="is_active", read_only=True)

    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "user", "scopes", "created_at", "expires_at", "last_used_at",
                  "revoked_at", "active"]
        read_only_fields = fields


class TokenCreateSerializer(StrictSerializer):
    name = StrictCharField(max_length=100)
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=TokenScope.values), required=False,
                                   min_length=1)
    expires_in_days = StrictIntegerField(required=False, min_value=1, max_value=3650)


class TokenCreatedSerializer(TokenSerializer):
    token = serializers.CharField(read_only=True, help_text="The secret. Shown only in this response.")

    class Meta(TokenSerializer.Meta):
        fields = TokenSerializer.Meta.fields + ["token"]


class TokenViewSet(TenantScopedMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                   viewsets.GenericViewSet):
    """Members see and revoke their own tokens; tenant admins see and revoke all of the tenant's."""

    queryset = ApiToken.objects.select_related("user").order_by("-created_at")
    serializer_class = TokenSerializer
    schema = WhaleZenAutoSchema()
    lookup_value_regex = "[0-9]+"  # ASCII digits only: `\d` and int() also take "²" or "٣"
    owner_field = "user"  # members revoke only their own tokens (they do not even see the others')

    def scope(self, queryset):
        queryset = super().scope(queryset)
        return queryset if self.ctx.is_admin else queryset.filter(user=self.request.user)

    @extend_schema(request=TokenCreateSerializer, responses={201: TokenCreatedSerializer})
    def create(self, request: Request) -> Response:
        body = TokenCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        scopes = body.validated_data.get("scopes") or [TokenScope.READ, TokenScope.WRITE]
        presenting = self.ctx.token
        if presenting is not None and not set(scopes) <= set(presenting.scopes):
            raise serializers.ValidationError({"scopes": ["A token cannot create a token with more scopes than itself."]})
        days = body.validated_data.get("expires_in_days")
        created = services.api_token_create(
            tenant=self.ctx.tenant, user=request.user, name=body.validated_data["name"], scopes=scopes,
            expires_at=timezone.now() + timedelta(days=days) if days else None,
        )
        data = TokenSerializer(created.token).data | {"token": created.secret}
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: TokenSerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        token = services.api_token_revoke(token=self.get_object())
        return Response(TokenSerializer(token).data)

    def perform_destroy(self, instance: ApiToken) -> None:
        services.api_token_revoke(token=instance)

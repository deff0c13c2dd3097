"""DRF authentication for agents: `Authorization: Bearer <node token>` identifies a node."""
from __future__ import annotations

from rest_framework import authentication, exceptions, permissions
from rest_framework.request import Request

from broker.agents.selectors import node_for_token
from broker.agents.services import given_up_reason, node_give_up
from broker.inventory.models import Node


class NodeTokenAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request: Request):
        header = authentication.get_authorization_header(request).decode("latin-1").split()
        if not header or header[0].lower() != "bearer":
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <node token>'.")
        node = node_for_token(header[1])
        if node is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked node token.")
        given_up = given_up_reason(node_state=node.state, instance_state=node.instance_state)
        if given_up is not None:
            # Checked on every call rather than only where the broker gives up (lost-node sweep,
            # termination, reconciler...): whichever path got there, the token stops working here.
            node_give_up(node=node, reason=given_up)
            raise exceptions.AuthenticationFailed("Invalid or revoked node token.")
        return None, node  # no user: request.auth is the Node

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="agent"'  # makes DRF answer 401, not 403


class IsNodeAgent(permissions.BasePermission):
    message = "A node token is required."

    def has_permission(self, request: Request, view) -> bool:
        return isinstance(request.auth, Node)

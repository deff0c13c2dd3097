"""The Django admin, where platform admins manage tenants, users, quotas, pools, GPU models and rates."""
from __future__ import annotations

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.urls import reverse

from broker.inventory.models import Pool
from broker.tenancy import tokens

from .test_api_tenancy import submit


def test_every_admin_page_renders(acme, client):
    submit(acme)
    superuser = get_user_model().objects.create_superuser("root", "root@example.com", "x" * 16)
    client.force_login(superuser)
    for model, model_admin in admin.site._registry.items():
        meta = model._meta
        changelist = client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist"))
        assert changelist.status_code == 200, meta.label
        if model_admin.has_add_permission(changelist.wsgi_request):
            add = client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_add"))
            assert add.status_code == 200, meta.label
        first = model.objects.first()
        if first is not None:
            change = client.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_change", args=[first.pk]))
            assert change.status_code == 200, meta.label
            assert "secret_hash" not in change.content.decode() and "token_hash" not in change.content.decode()


def test_admin_issues_a_pool_join_token_once(acme, client):
    superuser = get_user_model().objects.create_superuser("root", "root@example.com", "x" * 16)
    client.force_login(superuser)
    resp = client.post(reverse("admin:inventory_pool_changelist"),
                       {"action": "issue_join_token", "_selected_action": [acme.pool.pk]}, follow=True)
    assert resp.status_code == 200
    shown = [str(m) for m in resp.context["messages"]]
    token = shown[0].rsplit(" ", 1)[-1]
    pool = Pool.objects.get(pk=acme.pool.pk)
    assert tokens.matches(token, pool.join_token_hash)

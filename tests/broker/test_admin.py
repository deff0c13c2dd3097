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


FAST_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # the real one takes ~0.3 s a check


def login(client, username: str, password: str):
    return client.post(reverse("admin:login"), {"username": username, "password": password, "next": "/admin/"})


def test_staff_without_superuser_is_refused_even_with_view_job(acme, globex, client, settings):
    """Issue 8, item 14: the admin is not tenant-scoped, so it is for superusers only."""
    from django.contrib.auth.models import Permission

    settings.PASSWORD_HASHERS = FAST_HASHERS
    submit(acme, name="acme-secret-job")
    submit(globex, name="globex-secret-job")
    staff = get_user_model().objects.create_user("ops-staff", password="right-password-1", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_job"))
    client.force_login(staff)
    for url in (reverse("admin:index"), reverse("admin:jobs_job_changelist")):
        resp = client.get(url)
        assert resp.status_code == 302 and resp["Location"].startswith(reverse("admin:login")), url
        assert b"secret-job" not in resp.content
    # Logging in through the form does not let them in either.
    client.logout()
    resp = login(client, "ops-staff", "right-password-1")
    assert resp.status_code == 200 and b"Please enter the correct" in resp.content
    assert client.get(reverse("admin:jobs_job_changelist")).status_code == 302


def test_superuser_logs_in_through_the_form(acme, client, settings):
    settings.PASSWORD_HASHERS = FAST_HASHERS
    submit(acme, name="visible-to-operators")
    get_user_model().objects.create_superuser("root", "root@example.com", "right-password-1")
    resp = login(client, "root", "right-password-1")
    assert resp.status_code == 302 and resp["Location"] == "/admin/"
    page = client.get(reverse("admin:jobs_job_changelist"))
    assert page.status_code == 200 and b"visible-to-operators" in page.content


def test_repeated_failed_logins_lock_the_account_out(db, client, settings):
    """Six wrong passwords for one username from one address: the fifth failure locks the pair out
    (429), and so is every try after it, the right password included; the session stays anonymous;
    another username is unaffected."""
    settings.PASSWORD_HASHERS = FAST_HASHERS
    User = get_user_model()
    User.objects.create_superuser("root", "root@example.com", "right-password-1")
    User.objects.create_superuser("other", "other@example.com", "right-password-2")
    answers = [login(client, "root", "wrong-password") for _ in range(6)]
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 429, 429]
    assert all(b"Please enter the correct" in a.content for a in answers[:4])
    locked = login(client, "root", "right-password-1")
    assert locked.status_code == 429 and b"locked" in locked.content.lower()
    assert client.get(reverse("admin:index")).status_code == 302  # still not logged in
    assert login(client, "other", "right-password-2").status_code == 302  # per username + IP


def test_a_successful_login_resets_the_failure_count(db, client, settings):
    settings.PASSWORD_HASHERS = FAST_HASHERS
    get_user_model().objects.create_superuser("root", "root@example.com", "right-password-1")
    for _ in range(4):
        login(client, "root", "wrong-password")
    assert login(client, "root", "right-password-1").status_code == 302
    client.logout()
    for _ in range(4):
        assert login(client, "root", "wrong-password").status_code == 200
    assert login(client, "root", "right-password-1").status_code == 302

"""`manage.py kubernetes_pool_add --tenant platform --pool gpu-k8s --kubeconfig env:KUBECONFIG ...`

Adds (or updates) a pool of kind `kubernetes`: an existing cluster whose GPU nodes the bridge
(`python -m agent kubernetes`, docs/kubernetes.md) registers as the pool's nodes. The pool stores where
the kubeconfig is (a path, `env:NAME` or `in-cluster`), never its content. Issues the pool's join token
into --token-file (mode 0600) and prints the bridge's command line. Share the pool with teams as any
other (`manage.py pool_share`).
"""
from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from broker.inventory.labels import label_key_problem, label_value_problem
from broker.inventory.models import Pool, PoolKind
from broker.inventory.services import pool_join_token_issue
from broker.tenancy.models import Tenant

_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


class Command(BaseCommand):
    help = "Add a Kubernetes cluster as a pool, issue its join token and print the bridge's command line."

    def add_arguments(self, parser):
        parser.add_argument("--tenant", required=True, help="the owner's slug (for a shared cluster, the platform's)")
        parser.add_argument("--pool", required=True, help="pool name")
        parser.add_argument("--kubeconfig", required=True, metavar="REF",
                            help="where the bridge finds the kubeconfig: a path, env:NAME or in-cluster (stored; the "
                                 "file's content is not)")
        parser.add_argument("--context", default="", help="kubeconfig context (default: its current one)")
        parser.add_argument("--namespace", default="default", help="where the jobs' Pods go")
        parser.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE")
        parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                            help="a label every node of the cluster gets, e.g. fabric=infiniband "
                                 "(multi-node jobs need a fast fabric)")
        parser.add_argument("--toleration", action="append", default=[], metavar="JSON")
        parser.add_argument("--default-image", default="python:3.11-slim",
                            help="image of jobs that name none (a Pod needs one)")
        parser.add_argument("--rate", default=None, help="internal $/GPU-hour teams are billed on this cluster")
        parser.add_argument("--token-file", type=Path, required=True,
                            help="write the join token here (0600); the bridge reads it with --join-token-file")
        parser.add_argument("--server", default="http://127.0.0.1:8000", help="the broker URL the bridge uses")

    def handle(self, *args, tenant: str, pool: str, kubeconfig: str, context: str, namespace: str,
               node_selector: list[str], label: list[str], toleration: list[str], default_image: str,
               rate: str | None,
               token_file: Path, server: str, **options):
        owner = Tenant.objects.filter(slug=tenant).first()
        if owner is None:
            raise CommandError(f"no tenant {tenant!r}")
        if not (kubeconfig == "in-cluster" or kubeconfig.startswith("env:") or os.path.isabs(kubeconfig)):
            raise CommandError("--kubeconfig: an absolute path, env:NAME or in-cluster")
        selector = _label_pairs(node_selector, "--node-selector")
        labels = _label_pairs(label, "--label")
        tolerations = []
        for item in toleration:
            try:
                value = json.loads(item)
            except ValueError:
                value = None
            if not isinstance(value, dict) or not set(value) <= _TOLERATION_KEYS:
                raise CommandError(f"--toleration {item!r}: a JSON object of {sorted(_TOLERATION_KEYS)}")
            tolerations.append(value)
        config = {"kubeconfig": kubeconfig, "context": context, "namespace": namespace, "node_selector": selector,
                  "labels": labels, "tolerations": tolerations, "default_image": default_image}
        with transaction.atomic():
            target, created = Pool.objects.get_or_create(tenant=owner, name=pool,
                                                         defaults={"kind": PoolKind.KUBERNETES})
            if target.kind != PoolKind.KUBERNETES:
                raise CommandError(f"pool {tenant}/{pool} exists and is a {target.get_kind_display()} pool")
            target.provider_config = config
            if rate is not None:
                target.gpu_hour_rate_usd = rate
            target.full_clean()
            target.save()
            token = pool_join_token_issue(pool=target)
        token_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        argv = ["python", "-m", "agent", "kubernetes", "--server", server, "--join-token-file", str(token_file),
                "--kubeconfig", kubeconfig, "--namespace", namespace, "--bridge-id", re.sub(r"[^A-Za-z0-9_.-]", "-", f"{tenant}-{pool}")[:63].strip("-_."),
                "--default-image", default_image]
        if context:
            argv += ["--context", context]
        for key, value in selector.items():
            argv += ["--node-selector", f"{key}={value}"]
        for key, value in labels.items():
            argv += ["--label", f"{key}={value}"]
        for item in tolerations:
            argv += ["--toleration", json.dumps(item)]
        self.stdout.write(f"{'Added' if created else 'Updated'} Kubernetes pool {tenant}/{pool}; join token in "
                          f"{token_file}. Run the bridge where the kubeconfig is:\n  {shlex.join(argv)}")


def _label_pairs(items: list[str], option: str) -> dict[str, str]:
    """`KEY=VALUE` items in the Kubernetes label syntax, refused by item with what is wrong."""
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        why = label_key_problem(key) if sep else "expected KEY=VALUE"
        why = why or label_value_problem(value)
        if why:
            raise CommandError(f"{option} {item!r}: {why}")
        pairs[key] = value
    return pairs

"""`manage.py billing_rebuild [--check] [--from YYYY-MM-DD] [--to YYYY-MM-DD] [--json]`: recompute every
final usage line from allocations and cloud instances (at their fixed prices) and compare with the stored
usage records: missing, differing and extra records. Without --check, missing records are written (stored
records are never changed: they are append-only). Exits 1 when --check finds a disagreement."""
from __future__ import annotations

import json
from datetime import date

from django.core.management.base import BaseCommand, CommandError

from broker.billing.services import rebuild


def _day(raw: str | None) -> date | None:
    if raw is None:
        return None
    try:
        return date.fromisoformat(raw)
    except ValueError:
        raise CommandError(f"{raw[:20]!r} is not a date (YYYY-MM-DD).") from None


class Command(BaseCommand):
    help = "Rebuild usage records from allocations and instances, and report where they disagree."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--check", action="store_true", help="only compare; write nothing")
        parser.add_argument("--from", dest="start", help="first day (inclusive)")
        parser.add_argument("--to", dest="end", help="last day (exclusive)")
        parser.add_argument("--json", action="store_true", help="print the report as JSON")

    def handle(self, *args, check: bool, start: str | None, end: str | None, **options) -> None:
        report = rebuild(start=_day(start), end=_day(end), check_only=check)
        body = {"checked": report.checked, "missing": report.missing, "differing": report.differing,
                "extra": report.extra, "inserted": report.inserted, "agrees": report.agrees}
        if options["json"]:
            self.stdout.write(_dumps(body))
        else:
            self.stdout.write(f"{report.checked} stored record(s) checked: {len(report.missing)} missing, "
                              f"{len(report.differing)} differing, {len(report.extra)} extra"
                              + (f"; {report.inserted} written" if not check else ""))
            for kind in ("missing", "differing", "extra"):
                for key in body[kind][:50]:
                    self.stdout.write(f"  {kind}: {key}")
        if check and not report.agrees:
            raise SystemExit(1)


def _dumps(body: dict) -> str:
    return json.dumps(body, indent=2)

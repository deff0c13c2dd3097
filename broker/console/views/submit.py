"""Submit a job: by form (concrete GPUs or compute units) or by pasting a spec, with a live quote.

Both ways end where POST /api/v1/jobs/ ends (broker/api/jobs.py JobViewSet.create): the spec is
validated by `JobSpecSerializer` with the GPU catalogue, then `services.job_submit` creates the job.
The submit throttle is the API's (`JobSubmitThrottle`, per user for a session, shared with the API's
session calls); the quote is billing's `quote()` behind the API's `QuoteThrottle`, as QuoteView does.
"""
from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST
from rest_framework.throttling import SimpleRateThrottle

from broker.api.jobs import EXAMPLE_SPEC
from broker.api.parsers import BodyError
from rest_framework.exceptions import ValidationError

from broker.api.throttles import JobSubmitThrottle
from broker.billing.api import QuoteThrottle
from broker.billing.quotes import quote
from broker.console.access import console_page
from broker.console.forms import (PasteForm, SubmitForm, attach_errors, flat_errors, form_field_for, form_spec,
                                  parse_pasted)
from broker.jobs import selectors, services
from broker.jobs.services import JobError
from broker.jobs import intake
from broker.jobs.spec import GpuCatalog
from broker.jobs.states import JobState

QUOTE_OPTIONS_SHOWN = 5
QUOTE_NAME = "quote"  # stands in for a name not typed yet: a quote does not need one


def _validate(spec: Any, catalog: GpuCatalog, tenant, *, blocking: bool = True
              ) -> tuple[intake.Submission | None, Any]:
    """The API's reading of a spec in any format it takes (broker/jobs/intake.py); with `blocking`,
    what would block a real submission (an env value to supply) is an error too."""
    try:
        submission = intake.submission_parse(spec, tenant=tenant, catalog=catalog)
        if blocking:
            intake.submission_refuse_problems(submission)
    except ValidationError as exc:
        return None, exc.detail
    return submission, None


def _throttled(request: HttpRequest, throttle: SimpleRateThrottle) -> str:
    """"" when the API's throttle lets this request through, else the API's words for a 429."""
    if throttle.allow_request(request, None):
        return ""
    wait = throttle.wait()
    return ("Request was throttled." + (f" Expected available in {int(wait + 0.999)} seconds." if wait else ""))


def _yaml_example() -> str:
    import yaml

    return yaml.safe_dump(EXAMPLE_SPEC, sort_keys=False, default_flow_style=None, width=100)


def _page(request: HttpRequest, *, form: SubmitForm, paste: PasteForm, mode: str, paste_errors=(),
          status: int = 200) -> HttpResponse:
    catalog_models = selectors.gpu_catalog().names
    return render(request, "console/submit.html", {
        "nav": "submit", "form": form, "paste": paste, "mode": mode, "paste_errors": list(paste_errors),
        "gpu_models": catalog_models, "example": _yaml_example(), "can_write": request.console.can_write,
        "priority_names": ["low", "normal", "high", "critical"],
    }, status=status)


def _pasted_spec(paste: PasteForm) -> tuple[Any, list[tuple[str, str]]]:
    paste.is_valid()
    try:
        return parse_pasted(paste.cleaned_data.get("spec") or ""), []
    except BodyError as exc:  # the API's 400 {"body": [reason]}
        return None, [("body", str(exc.detail))]


@console_page
def submit_page(request: HttpRequest) -> HttpResponse:
    catalog = selectors.gpu_catalog()
    mode = "paste" if (request.POST.get("mode") or request.GET.get("mode")) == "paste" else "form"
    posted = request.method == "POST"
    form = SubmitForm(request.POST if posted and mode == "form" else None, gpu_model_names=catalog.names)
    paste = PasteForm(request.POST if posted and mode == "paste" else None)
    if not posted:
        return _page(request, form=form, paste=paste, mode=mode)

    refused = _throttled(request, JobSubmitThrottle())  # counted before validation, as DRF does
    if refused:
        form.is_valid()
        paste.is_valid()
        if mode == "form":
            form.add_error(None, refused)
        return _page(request, form=form, paste=paste, mode=mode, paste_errors=[("", refused)], status=429)

    if mode == "form":
        spec = form_spec(form)
        paste_errors: list[tuple[str, str]] = []
    else:
        spec, paste_errors = _pasted_spec(paste)
    if spec is None:
        return _page(request, form=form, paste=paste, mode=mode, paste_errors=paste_errors, status=400)
    submission, errors = _validate(spec, catalog, request.console.tenant)
    if errors is not None:
        if mode == "form":
            attach_errors(form, errors)
        return _page(request, form=form, paste=paste, mode=mode, paste_errors=flat_errors(errors), status=400)
    try:
        job = services.job_submit(tenant=request.console.tenant, owner=request.user, validated=submission.validated)
    except JobError as exc:  # the team's quota or pending-job limit
        detail = {exc.field: [str(exc)]}
        if mode == "form":
            attach_errors(form, detail)
        return _page(request, form=form, paste=paste, mode=mode, paste_errors=flat_errors(detail),
                     status=429 if exc.code == "throttled" else 400)
    messages.success(request, f"Job {job.pk} ({job.name}) submitted: it is {JobState.PENDING.label.lower()} "
                              "until the next scheduling cycle places it.")
    for warning in submission.warnings:
        messages.warning(request, f"{warning.field}: {warning.message}")
    return redirect("console:job", pk=job.pk)


def _labelled(errors: Any, form: SubmitForm | None) -> list[tuple[str, str]]:
    """Errors for the quote fragment: by the form field's label where one shows the value."""
    out = []
    for path, message in flat_errors(errors):
        field = form_field_for(path) if form is not None else None
        label = str(form.fields[field].label or field.replace("_", " ")) if field else path
        out.append((label, message))
    return out


@console_page
@require_POST
def quote_fragment(request: HttpRequest) -> HttpResponse:
    """The live quote: what the submit form (or the pasted spec) would cost, and where, right now."""
    def fragment(status: int = 200, **context: Any) -> HttpResponse:
        # A 400 (or 429) is swapped in like a price (base.html's htmx responseHandling), so the last
        # price never stays on screen beside a form that no longer gets it.
        return render(request, "console/partials/quote.html", context, status=status)

    refused = _throttled(request, QuoteThrottle())
    if refused:
        return fragment(429, errors=[("", refused)])
    catalog = selectors.gpu_catalog()
    form = None
    if request.POST.get("mode") == "paste":
        spec, body_errors = _pasted_spec(PasteForm(request.POST))
        if spec is None:
            return fragment(400, errors=body_errors)
    else:
        form = SubmitForm(request.POST, gpu_model_names=catalog.names)
        spec = form_spec(form)
        if spec is None:
            return fragment(400, errors=[(str(form.fields[name].label) if name in form.fields else "", e)
                                         for name, errs in form.errors.items() for e in errs])
        spec["name"] = spec.get("name") or QUOTE_NAME
    submission, errors = _validate(spec, catalog, request.console.tenant, blocking=False)
    if errors is not None:
        return fragment(400, errors=_labelled(errors, form))
    # The preview of a pasted file: how it was read, and what a submission would still refuse.
    result = quote(tenant=request.console.tenant, validated=submission.validated, user=request.user.get_username())
    return fragment(options=result["options"][:QUOTE_OPTIONS_SHOWN], more=max(0, len(result["options"]) -
                    QUOTE_OPTIONS_SHOWN), unplaceable=result["unplaceable"], job=result["job"],
                    spec_format=submission.format, warnings=submission.warnings, problems=submission.problems)

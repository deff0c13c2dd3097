"""In a real browser, what a user does with the console: submit by form, watch the job change state
without reloading, read why a job waits, cancel, migrate, download the costs CSV; and a user of another
team sees none of it. The scheduler runs in-process between steps (no worker runs under the live
server); everything else goes through the pages. Every page is saved as a screenshot."""
from __future__ import annotations

import re

from broker.jobs.models import Job, Migration
from broker.jobs.services import job_transition
from broker.jobs.states import JobState
from broker.scheduler.services import scheduling_cycle_run


def _submit(session, *, name: str, gpus: int, checkpoint: str = "") -> int:
    page = session.page
    page.goto("/submit/")
    page.get_by_label("Name", exact=True).fill(name)
    page.get_by_label("Command", exact=True).fill("python train.py --epochs 3")
    page.get_by_label("GPUs per node").fill(str(gpus))
    page.get_by_label("GPU models").select_option("A100-80GB")
    if checkpoint:
        page.get_by_label("Checkpoint URI").fill(checkpoint)
    page.locator("form").filter(has=page.get_by_label("Name", exact=True)).get_by_role(
        "button", name="Submit job").click()
    page.wait_for_url(re.compile(r".*/jobs/\d+/$"))
    return int(re.search(r"/jobs/(\d+)/$", page.url).group(1))


def _state_shown(page, state: str, timeout_ms: int = 15_000) -> None:
    """Wait until the page (refreshed by htmx polling, never reloaded here) shows the state."""
    page.locator(f".state-{state.lower()}").first.wait_for(timeout=timeout_ms)


def test_submit_watch_explain_cancel_migrate_and_pay(open_session, passwords, acme, globex, settings):
    session = open_session()
    session.login("acme-admin")
    page = session.page

    # A bad field first: the error is next to it, in the API's words, and nothing is created.
    page.goto("/submit/")
    page.get_by_label("Name", exact=True).fill("bad gpus")
    page.get_by_label("Command", exact=True).fill("python train.py")
    page.get_by_label("GPUs per node").fill("0")
    page.get_by_label("GPUs per node").blur()
    # The live quote answers 400 with the reason, and the page shows it (a 4xx is swapped in).
    page.locator(".quote").get_by_text("Not quotable yet").wait_for()
    page.locator("form").filter(has=page.get_by_label("Name", exact=True)).get_by_role(
        "button", name="Submit job").click()
    assert page.locator("[aria-invalid=true]").count() >= 1
    session.shot("submit-error")
    assert not Job.objects.filter(name="bad gpus").exists()

    # Submitted by form: the job page shows it PENDING, then PLACED once the scheduler ran.
    job_id = _submit(session, name="bert-ft", gpus=2, checkpoint="s3://acme-ckpt/bert")
    job = Job.objects.get(pk=job_id)
    assert job.tenant_id == acme.tenant.pk and job.gpu_count == 2 and job.gpu_models == ["A100-80GB"]
    _state_shown(page, JobState.PENDING)
    too_big = _submit(session, name="too-big", gpus=16)
    scheduling_cycle_run(tenant=acme.tenant)
    page.goto(f"/jobs/{job_id}/")
    _state_shown(page, JobState.PLACED)

    # The job too big for any node says why it waits: the engine's code and its sentence.
    page.goto(f"/jobs/{too_big}/")
    waiting = Job.objects.get(pk=too_big)
    assert waiting.state == JobState.PENDING and waiting.pending_reason_code
    page.get_by_text(waiting.pending_reason_code).first.wait_for()
    session.shot("job-pending-reason")

    # The running job changes state on the open page, without a reload.
    page.goto(f"/jobs/{job_id}/")
    job.refresh_from_db()
    job = job_transition(job=job, to=JobState.STARTING)
    job_transition(job=job, to=JobState.RUNNING)
    _state_shown(page, JobState.RUNNING)
    session.shot("job-running")

    # Migrate from the page: a move is recorded and shown.
    page.get_by_role("button", name="Migrate").click()
    page.get_by_text("REQUESTED").first.wait_for()
    assert Migration.objects.filter(job_id=job_id).count() == 1

    # Cancel the waiting one from its page (the browser asks first).
    page.goto(f"/jobs/{too_big}/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel job").click()
    _state_shown(page, JobState.CANCELLED)
    assert Job.objects.get(pk=too_big).state == JobState.CANCELLED

    # Every other page, looked at; the costs CSV downloads.
    for path, name in [("/", "dashboard-busy"), ("/jobs/", "jobs"), ("/nodes/", "nodes"),
                       ("/costs/", "costs"), ("/team/", "team"), ("/submit/", "submit")]:
        response = page.goto(path)
        assert response.status == 200, path
        session.shot(name)
    page.goto("/costs/")
    with page.expect_download() as download:
        page.get_by_role("link", name=re.compile("CSV", re.I)).first.click()
    csv_text = open(download.value.path()).read()
    assert csv_text.splitlines()[0].count(",") >= 2
    assert session.outside_requests == [] and session.console_errors == []

    # Another team's admin sees none of it.
    other = open_session()
    other.login("globex-admin")
    other.page.goto("/jobs/")
    listed = other.page.locator("main").inner_text()
    assert "bert-ft" not in listed and "too-big" not in listed
    for path in (f"/jobs/{job_id}/", f"/jobs/{too_big}/"):
        assert other.page.goto(path).status == 404
    other.page.goto("/nodes/")
    assert "acme-a100" not in other.page.locator("main").inner_text()


def test_a_pasted_skypilot_task_is_previewed_then_submitted(open_session, passwords, acme):
    session = open_session()
    session.login("acme-member")
    page = session.page
    page.goto("/submit/?mode=paste")
    task = ("name: pasted-task\nresources:\n  accelerators: {A100-80GB:2, H100:8}\n  disk_size: 256\n"
            "envs:\n  HF_TOKEN: null\nrun: python train.py\n")
    page.get_by_label("Spec (YAML or JSON)").fill(task)
    page.get_by_label("Spec (YAML or JSON)").blur()
    preview = page.locator(".quote")
    preview.get_by_text("Read as a SkyPilot task file").wait_for()
    assert "envs.HF_TOKEN" in preview.inner_text() and "resources.disk_size" in preview.inner_text()
    session.shot("submit-skypilot-preview")
    page.get_by_label("Spec (YAML or JSON)").fill(task.replace("null", "hf_x"))
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    assert Job.objects.get(name="pasted-task").gpu_alternatives == {"A100-80GB": 2, "H100-80GB": 8}
    assert session.outside_requests == [] and session.console_errors == []


def test_a_viewer_reads_but_has_nothing_to_press(open_session, passwords, acme):
    session = open_session()
    session.login("acme-viewer")
    session.page.goto("/submit/")
    assert session.page.get_by_role("button", name="Submit job").count() == 0
    session.shot("submit-viewer")

"""The `whalezen` CLI against a live broker over real HTTP: output shapes (`--json`), exit codes, the
login file, tenancy, and the waits (`submit --wait`, `events --follow`) ending when the job does."""
from __future__ import annotations

import json
import stat
import subprocess
import time
from pathlib import Path

import pytest
from django.db import OperationalError
from django.urls import Resolver404, resolve

from bench.procs import free_port
from broker.inventory.models import Gpu
from broker.jobs.models import Job
from broker.jobs.services import GpuRequest, allocation_commit, event_append, job_cancel, job_transition
from broker.jobs.states import JobState
from broker.tenancy.services import api_token_create
from tests.broker.test_api_tenancy import submit
from whalezen import cli

from .conftest import WHALEZEN, Wz

JOB_KEYS = {"id", "name", "state", "priority", "preemptible", "owner", "spec", "demand", "pending_reason",
            "allocations", "created_at", "updated_at", "started_at", "finished_at"}
SPEC_YAML = """\
name: cli-train
command: [python, train.py]
resources:
  gpus: 2
  gpu_models: [A100-80GB]
"""


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def wait_until(predicate, what: str, limit_s: float = 15.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def beside_the_server(write, limit_s: float = 5.0):
    """Run a database write from the test thread while the CLI under test may be polling the live
    server. On SQLite the live server's threads share this thread's connection (pytest-django's
    in-memory test database), and a statement they have open makes a savepoint here fail with
    "cannot open savepoint - SQL statements in progress"; nothing was written, so it is tried again.
    PostgreSQL gives every thread its own connection and never gets here."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            return write()
        except OperationalError as exc:
            if "statements in progress" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def run_job(job: Job, node) -> Job:
    """PENDING -> PLACED -> STARTING -> RUNNING, as the scheduler and an agent would."""
    allocation_commit(job=job, requests=[GpuRequest(node=node, gpu_indices=(0,))])
    job.refresh_from_db()
    job = job_transition(job=job, to=JobState.STARTING)
    return job_transition(job=job, to=JobState.RUNNING)


# -- login -----------------------------------------------------------------------------------------
def test_login_verifies_the_token_and_stores_it_with_mode_0600(live_server, acme, home):
    wz = Wz(home, None, None)
    result = wz("login", live_server.url, "--token", acme.token_secret, "--json")
    assert result.code == cli.EXIT_OK, result.err
    body = result.json
    assert body["url"] == live_server.url and body["team"] == "acme" and body["user"] == "acme-admin"
    path = Path(home["XDG_CONFIG_HOME"]) / "whalezen" / "config.json"
    assert body["config"] == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == {"url": live_server.url, "token": acme.token_secret}

    # The other commands use it with nothing in the environment.
    listed = wz("ls", "--json")
    assert listed.code == cli.EXIT_OK and listed.json == []
    # WHALEZEN_TOKEN overrides the stored token.
    refused = wz("ls", WHALEZEN_TOKEN="wz_00000000_wrong")
    assert refused.code == cli.EXIT_AUTH
    # A stored token is never sent to another server (WHALEZEN_URL elsewhere, no WHALEZEN_TOKEN).
    elsewhere = wz("ls", WHALEZEN_URL=f"http://127.0.0.1:{free_port()}")
    assert elsewhere.code == cli.EXIT_AUTH and "no token for" in elsewhere.err

    assert wz("logout").code == cli.EXIT_OK and not path.exists()
    assert wz("ls").code == cli.EXIT_AUTH


def test_login_with_a_wrong_token_stores_nothing(live_server, acme, home):
    wz = Wz(home, None, None)
    result = wz("login", live_server.url, "--token", "wz_deadbeef_notatoken")
    assert result.code == cli.EXIT_AUTH
    assert "refused this token" in one_line(result.err) and "nothing was stored" in result.err
    assert not (Path(home["XDG_CONFIG_HOME"]) / "whalezen" / "config.json").exists()


def test_login_reads_the_token_from_stdin(live_server, acme, home):
    done = subprocess.run([str(WHALEZEN), "login", live_server.url, "--token-stdin"], input=acme.token_secret + "\n",
                          env=Wz(home, None, None).environment(), capture_output=True, text=True, timeout=30)
    assert done.returncode == cli.EXIT_OK, done.stderr
    assert "Logged in to" in done.stdout and "as acme-admin (team acme)" in done.stdout
    assert acme.token_secret not in done.stdout + done.stderr


# -- auth and reachability -------------------------------------------------------------------------
def test_wrong_token_is_exit_3_with_one_line(wz):
    result = wz("ls", WHALEZEN_TOKEN="wz_00000000_wrong")
    assert result.code == cli.EXIT_AUTH
    line = one_line(result.err)
    assert line.startswith("whalezen: the server refused the token") and "whalezen login" in line
    as_json = wz("ls", "--json", WHALEZEN_TOKEN="wz_00000000_wrong")
    assert as_json.code == cli.EXIT_AUTH
    assert as_json.json == {"error": {"message": line.removeprefix("whalezen: "), "exit_code": 3, "status": 401}}


def test_not_logged_in_is_exit_3(home):
    result = Wz(home, None, None)("ls")
    assert result.code == cli.EXIT_AUTH and "not logged in" in one_line(result.err)


def test_unreachable_server_is_exit_4_quickly(home):
    wz = Wz(home, f"http://127.0.0.1:{free_port()}", "wz_00000000_x")
    started = time.monotonic()
    result = wz("ls")
    assert result.code == cli.EXIT_UNREACHABLE
    assert "cannot reach http://127.0.0.1:" in one_line(result.err) and "connection refused" in result.err
    assert time.monotonic() - started < 5
    assert wz("ls", "--json").json["error"]["exit_code"] == cli.EXIT_UNREACHABLE


# -- submit, ls, show, cancel ----------------------------------------------------------------------
def test_submit_ls_show_cancel_round_trip(wz, acme, spec_file):
    path = spec_file(SPEC_YAML)
    submitted = wz("submit", path)
    assert submitted.code == cli.EXIT_OK, submitted.err
    job_id = int(submitted.out.strip())  # only the id on stdout: `ID=$(whalezen submit f.yaml)`
    job = Job.objects.get(pk=job_id)
    assert job.tenant == acme.tenant and job.name == "cli-train" and job.gpu_count == 2

    listed = wz("ls", "--json")
    assert listed.code == 0 and [j["id"] for j in listed.json] == [job_id]
    assert set(listed.json[0]) == JOB_KEYS
    assert wz("--json", "ls").json == listed.json  # the common options go before or after the command
    table = wz("ls")
    assert table.out.splitlines()[0].split()[:3] == ["ID", "NAME", "STATE"]
    assert table.out.splitlines()[1].split()[:3] == [str(job_id), "cli-train", "PENDING"]
    assert "2xA100-80GB" in table.out and "NOT_YET_SCHEDULED" in table.out
    assert wz("ls", "--state", "RUNNING", "--json").json == []
    assert [j["id"] for j in wz("ls", "--state", "pending,running", "--json").json] == [job_id]

    shown = wz("show", str(job_id), "--json")
    assert shown.code == 0 and set(shown.json) == JOB_KEYS and shown.json["state"] == "PENDING"
    assert shown.json["demand"]["total_gpus"] == 2
    human = wz("show", str(job_id))
    assert "cli-train" in human.out and "python train.py" in human.out and "NOT_YET_SCHEDULED" in human.out

    explained = wz("explain", str(job_id), "--json")
    assert explained.json == {"id": job_id, "state": "PENDING", "pending_reason": {
        "code": "NOT_YET_SCHEDULED", "message": "Waiting for the next scheduling cycle.", "data": {}}}
    assert wz("explain", str(job_id)).out.startswith(f"job {job_id} waits: NOT_YET_SCHEDULED")

    cancelled = wz("cancel", str(job_id), "--json")
    assert cancelled.code == 0 and cancelled.json["state"] == "CANCELLED"
    assert Job.objects.get(pk=job_id).state == JobState.CANCELLED
    again = wz("cancel", str(job_id))
    assert again.code == cli.EXIT_API and one_line(again.err).startswith(f"whalezen: job {job_id}: ")

    events = wz("events", str(job_id), "--json")
    assert events.code == 0
    assert [e["reason_code"] for e in events.json][-1] == "USER_CANCELLED"
    assert set(events.json[0]) == {"id", "created_at", "kind", "reason_code", "message", "data"}
    assert "USER_CANCELLED" in wz("events", str(job_id)).out
    not_waiting = wz("explain", str(job_id))
    assert not_waiting.out.strip() == f"job {job_id} is CANCELLED: not waiting"


def test_submit_json_from_stdin_and_json_output(wz, live_server):
    spec = {"name": "from-stdin", "command": ["true"], "resources": {"gpus": 1}}
    done = subprocess.run([str(WHALEZEN), "submit", "-", "--json"], input=json.dumps(spec), env=wz.environment(),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    # The job, with how the server read the spec and what it has to say about its fields.
    assert set(body) == JOB_KEYS | {"format", "warnings"} and body["name"] == "from-stdin"
    assert body["state"] == "PENDING" and body["format"] == "whalezen" and body["warnings"] == []


def test_bad_spec_is_exit_2_naming_the_fields(wz, spec_file):
    path = spec_file("name: bad\ncommand: [x]\nresources:\n  gpus: 100\nbogus: 1\n")
    result = wz("submit", path)
    assert result.code == cli.EXIT_USAGE
    line = one_line(result.err)
    assert line.startswith(f"whalezen: bad spec {path}: ")
    assert "resources.gpus: " in line and "bogus: Unknown field." in line
    as_json = wz("submit", path, "--json")
    assert as_json.code == cli.EXIT_USAGE
    error = as_json.json["error"]
    assert error["status"] == 400 and error["exit_code"] == 2
    assert set(error["fields"]) == {"resources.gpus", "bogus"} and error["fields"]["bogus"] == ["Unknown field."]
    assert not Job.objects.exists()


# -- tenancy and roles -----------------------------------------------------------------------------
def test_another_teams_job_is_not_found_everywhere(wz, globex):
    theirs = submit(globex, name="secret-plan")
    for command in ("show", "explain", "events", "logs", "cancel", "checkpoint", "migrate"):
        result = wz(command, str(theirs.pk))
        assert result.code == cli.EXIT_NOT_FOUND, (command, result.err)
        assert one_line(result.err) == f"whalezen: job {theirs.pk} not found"
        assert "secret-plan" not in result.out + result.err
    assert wz("show", str(theirs.pk), "--json").json["error"] == {
        "message": f"job {theirs.pk} not found", "exit_code": 5, "status": 404}
    theirs.refresh_from_db()
    assert theirs.state == JobState.PENDING
    assert wz("ls", "--json").json == []


def test_a_viewer_may_read_but_not_cancel(wz, acme):
    job = submit(acme, name="admins-job")
    viewer_token = api_token_create(tenant=acme.tenant, user=acme.viewer, name="cli").secret
    assert wz("show", str(job.pk), WHALEZEN_TOKEN=viewer_token).code == 0
    refused = wz("cancel", str(job.pk), WHALEZEN_TOKEN=viewer_token)
    assert refused.code == cli.EXIT_AUTH and one_line(refused.err).startswith("whalezen: not allowed: ")
    job.refresh_from_db()
    assert job.state == JobState.PENDING


# -- checkpoint, migrate, logs, nodes, quota -------------------------------------------------------
def test_checkpoint_and_migrate_of_a_pending_job_say_why_not(wz, acme):
    job = submit(acme, name="waiting", checkpoint={"uri": "s3://ckpt-bucket/cli"})
    for argv in (["checkpoint", str(job.pk)], ["migrate", str(job.pk), "--pool", "onprem"]):
        result = wz(*argv)
        assert result.code == cli.EXIT_API, result.err
        assert one_line(result.err).startswith(f"whalezen: job {job.pk}: ")


def test_checkpoint_and_migrate_of_a_running_job(wz, acme):
    job = run_job(submit(acme, name="moving", checkpoint={"uri": "s3://ckpt-bucket/cli"}), acme.nodes[0])
    result = wz("checkpoint", str(job.pk), "--json")
    assert result.code == 0 and result.json["state"] == "CHECKPOINTING"
    job.refresh_from_db()
    job_transition(job=job, to=JobState.RUNNING)
    moved = wz("migrate", str(job.pk), "--node", acme.nodes[1].name, "--json")
    assert moved.code == 0, moved.err
    assert {"id", "cause", "state", "source", "target"} <= set(moved.json)
    assert moved.json["cause"] == "REQUESTED" and moved.json["target"] == acme.nodes[1].name


def test_logs_print_the_output_tail_the_agent_reported(wz, acme):
    job = submit(acme, name="talker")
    assert wz("logs", str(job.pk)).code == 0  # nothing yet: a note, exit 0
    event_append(job=job, kind="agent", reason_code="AGENT_EXITED", message="n: exited",
                 data={"state": "exited", "output_tail": "epoch 3 loss 0.12\ndone\n"})
    result = wz("logs", str(job.pk))
    assert result.code == 0 and result.out == "epoch 3 loss 0.12\ndone\n"
    assert wz("logs", str(job.pk), "--json").json == {"id": job.pk, "output": "epoch 3 loss 0.12\ndone\n"}


def test_nodes_pools_quota_tokens(wz, acme):
    nodes = wz("nodes", "--json")
    assert nodes.code == 0
    assert sorted(n["name"] for n in nodes.json) == ["acme-a100-0", "acme-a100-1"]
    assert {"name", "pool", "state", "gpus"} <= set(nodes.json[0]) and len(nodes.json[0]["gpus"]) == 8
    table = wz("nodes")
    assert "acme-a100-0" in table.out and "8xA100-80GB" in table.out and "8/8" in table.out
    pools = wz("pools", "--json")
    assert [p["name"] for p in pools.json] == ["onprem"]
    quota = wz("quota", "--json")
    assert quota.code == 0 and quota.json["tenant"] == "acme" and "max_gpus" in quota.json
    assert "max_gpus" in wz("quota").out
    created = wz("tokens", "create", "ci", "--scope", "read", "--json")
    assert created.code == 0 and created.json["scopes"] == ["read"] and created.json["token"].startswith("wz_")
    listed = wz("tokens", "--json")
    assert "ci" in [t["name"] for t in listed.json]
    read_only = created.json["token"]
    refused = wz("submit", "/dev/null", WHALEZEN_TOKEN=read_only)
    assert refused.code == cli.EXIT_USAGE  # an empty file never reaches the server
    revoked = wz("tokens", "revoke", str(created.json["id"]), "--json")
    assert revoked.code == 0 and revoked.json["active"] is False
    assert wz("ls", WHALEZEN_TOKEN=read_only).code == cli.EXIT_AUTH


def test_nodes_count_a_gpu_held_outside_whalezen_as_taken(wz, acme):
    # What the Kubernetes bridge reports for a GPU another team's pod requests: not free, though no job holds it.
    Gpu.objects.filter(node=acme.nodes[0], index=7).update(held_outside=True)
    rows = {line.split()[0]: line for line in wz("nodes").out.splitlines()[1:]}
    assert " 7/8 " in rows[acme.nodes[0].name] and " 8/8 " in rows[acme.nodes[1].name]


# -- billing routes (issue 13): present or clearly absent ------------------------------------------
def _has_route(path: str) -> bool:
    try:
        resolve(path)
    except Resolver404:
        return False
    return True


def test_billing_commands_work_or_say_this_server_has_none(wz, spec_file):
    costs = wz("costs", "--group-by", "gpu_model", "--json")
    quote = wz("quote", spec_file(SPEC_YAML), "--json")
    if _has_route("/api/v1/costs/"):
        assert costs.code == 0, costs.err
        assert isinstance(costs.json.get("results", costs.json.get("rows")), list)
        assert wz("costs", "--group-by", "gpu_model", "--csv").code == 0
    else:
        assert costs.code == cli.EXIT_API
        assert one_line(costs.err).startswith("whalezen: this server has no costs API")
    if _has_route("/api/v1/quotes/"):
        assert quote.code == 0, quote.err
    else:
        assert quote.code == cli.EXIT_API and "this server has no quotes API" in one_line(quote.err)
    statements, budget = wz("statements", "--json"), wz("budget", "--json")
    if _has_route("/api/v1/statements/"):
        assert statements.code == 0 and isinstance(statements.json, list), statements.err
    else:
        assert statements.code == cli.EXIT_API and "this server has no statements API" in statements.err
    if _has_route("/api/v1/quotes/") and _has_route("/api/v1/costs/") and _has_route("/api/v1/budget/"):
        # The tables people read: every billing command answers, nothing left as raw JSON.
        quoted = wz("quote", spec_file(SPEC_YAML))
        assert quoted.code == 0 and quoted.out.split()[0] == "WHERE" and "node acme-a100-" in quoted.out, quoted.err
        for argv in (["costs", "--group-by", "gpu_model,user"], ["statements"], ["budget"], ["savings"]):
            human = wz(*argv)
            assert human.code == 0 and not human.out.lstrip().startswith("{"), (argv, human.err)
        past = wz("statements", "2020-01")
        assert past.code == cli.EXIT_NOT_FOUND and one_line(past.err) == "whalezen: statement 2020-01 not found"
    savings = wz("savings", "--json")
    if _has_route("/api/v1/costs/savings/"):
        assert savings.code == 0 and isinstance(savings.json["jobs"], list), savings.err
    else:
        assert savings.code == cli.EXIT_API and "this server has no savings API" in savings.err
    if _has_route("/api/v1/budget/"):
        assert budget.code == 0 and budget.json["team"] == "acme", budget.err
    else:
        assert budget.code == cli.EXIT_API and "this server has no budget API" in budget.err


def test_a_platform_admin_reads_every_teams_costs_and_a_team_admin_cannot(live_server, acme, globex, home, wz):
    acme.admin.is_superuser = True  # acme's admin runs the platform too
    acme.admin.save(update_fields=["is_superuser"])
    platform = wz("costs", "--team", "all", "--group-by", "team", "--json")
    assert platform.code == cli.EXIT_OK and platform.json["scope"] == "platform", platform.err
    assert wz("statements", "--team", "globex", "--json").code == cli.EXIT_OK
    refused = Wz(home, live_server.url, globex.token_secret)("costs", "--team", "acme")
    assert refused.code != cli.EXIT_OK and "Only platform admins" in one_line(refused.err)
    unknown = wz("costs", "--team", "no-such-team")
    assert unknown.code == cli.EXIT_USAGE and "team" in one_line(unknown.err), unknown.err


# -- waiting ---------------------------------------------------------------------------------------
def _new_job(tenant, name: str) -> Job:
    return wait_until(lambda: Job.objects.filter(tenant=tenant, name=name).first(), f"job {name} to be submitted")


def test_submit_wait_shows_progress_until_the_job_runs(wz, acme, spec_file):
    proc = wz.process("submit", spec_file(SPEC_YAML.replace("cli-train", "waiter")), "--wait", "--interval", "0.2",
                      "--timeout", "30")
    try:
        job = _new_job(acme.tenant, "waiter")
        time.sleep(0.5)  # a few polls while PENDING
        run_job(job, acme.nodes[0])
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == cli.EXIT_OK, err
    assert out.strip() == str(job.pk)
    assert f"job {job.pk} PENDING: NOT_YET_SCHEDULED: Waiting for the next scheduling cycle." in err
    assert f"job {job.pk} RUNNING on acme-a100-0[0]" in err


def test_submit_wait_exit_codes_when_the_job_is_cancelled_or_the_wait_times_out(wz, acme, spec_file):
    path = spec_file(SPEC_YAML)
    started = time.monotonic()
    timed_out = wz("submit", path, "--wait", "--timeout", "0.5", "--interval", "0.1")
    assert timed_out.code == cli.EXIT_TIMEOUT and time.monotonic() - started < 5
    assert "gave up waiting" in timed_out.err.splitlines()[-1]

    proc = wz.process("submit", spec_file(SPEC_YAML.replace("cli-train", "doomed")), "--wait", "--json",
                      "--interval", "0.2", "--timeout", "30")
    try:
        job = _new_job(acme.tenant, "doomed")
        beside_the_server(lambda: job_cancel(job=job))
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == cli.EXIT_JOB_FAILED, err
    assert json.loads(out)["state"] == "CANCELLED"  # --json: one document, the final job


def test_events_follow_ends_when_the_job_ends(wz, acme):
    job = submit(acme, name="followed")
    proc = wz.process("events", str(job.pk), "--follow", "--interval", "0.2", "--timeout", "30")
    try:
        time.sleep(0.6)
        job = run_job(job, acme.nodes[0])
        time.sleep(0.4)
        job_transition(job=job, to=JobState.SUCCEEDED, reason_code="AGENT_EXITED", message="exit 0")
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == cli.EXIT_OK, err
    assert f"job {job.pk} ended: SUCCEEDED" in err
    lines = out.splitlines()
    assert len(lines) == Job.objects.get(pk=job.pk).events.count()  # every event once, in order
    assert "AGENT_EXITED" in lines[-1]


def test_events_follow_json_lines_and_timeout(wz, acme):
    job = submit(acme, name="stuck")
    result = wz("events", str(job.pk), "--follow", "--json", "--timeout", "0.3", "--interval", "0.1")
    assert result.code == cli.EXIT_TIMEOUT
    lines = result.out.splitlines()
    assert lines and all(json.loads(line)["id"] for line in lines[:-1])  # JSON Lines, then the error object
    assert json.loads(lines[-1])["error"]["exit_code"] == cli.EXIT_TIMEOUT


def test_a_kubernetes_manifest_is_submitted_and_a_refused_field_is_exit_2(wz, spec_file):
    manifest = ("apiVersion: batch/v1\nkind: Job\nmetadata: {name: train}\n"
                "spec: {template: {spec: {restartPolicy: Never, containers: [{name: t, image: 'pytorch/pytorch:2.4',"
                " command: [python, train.py], resources: {limits: {nvidia.com/gpu: 2}}}]}}}\n")
    result = wz("submit", spec_file(manifest))
    assert result.code == cli.EXIT_OK, result.err
    job = wz("show", result.out.strip(), "--json").json
    assert job["name"] == "train" and job["demand"]["gpus_per_node"] == 2 and job["spec"]["format"] == "kubernetes"
    refused = wz("submit", spec_file(manifest.replace("restartPolicy: Never,", "volumes: [{name: d}],")))
    assert refused.code == cli.EXIT_USAGE
    assert "spec.template.spec.volumes" in one_line(refused.err)


def test_dry_run_shows_the_demand_and_what_still_blocks_it(wz, spec_file):
    task = ("resources: {accelerators: {A100-80GB:2, H100:8}, cpus: 8+}\n"
            "envs: {HF_TOKEN: null, EPOCHS: 3}\nrun: python train.py --epochs $EPOCHS\n")
    blocked = wz("submit", "--dry-run", "--json", spec_file(task))
    assert blocked.code == cli.EXIT_USAGE  # HF_TOKEN must be given at submit time
    assert blocked.json["format"] == "skypilot" and blocked.json["demand"]["gpu_models"] == ["A100-80GB", "H100-80GB"]
    assert [p["field"] for p in blocked.json["problems"]] == ["envs.HF_TOKEN"]
    filled = wz("submit", "--dry-run", "--env", "HF_TOKEN=x", spec_file(task))
    assert filled.code == cli.EXIT_OK, filled.err
    assert "warning: resources.accelerators" in filled.err  # H100 is in no pool of acme's
    assert not wz("ls", "--json").json  # nothing was created


# -- the client from Python ------------------------------------------------------------------------
def test_the_python_client(live_server, acme, globex, monkeypatch):
    from whalezen import BadRequest, Client, NotFound

    monkeypatch.setenv("WHALEZEN_URL", live_server.url + "/api/v1/")
    monkeypatch.setenv("WHALEZEN_TOKEN", acme.token_secret)
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent")
    wz = Client.from_login(timeout_s=10)
    assert wz.url == live_server.url
    job = wz.submit({"name": "py", "command": ["true"], "resources": {"gpus": 1}})
    assert wz.job(job["id"])["state"] == "PENDING"
    assert wz.explain(job["id"])["code"] == "NOT_YET_SCHEDULED"
    assert [j["id"] for j in wz.iter_jobs(state=["PENDING"])] == [job["id"]]
    with pytest.raises(BadRequest) as caught:
        wz.submit({"name": "py", "resources": {"gpus": 0}, "extra": 1})
    assert caught.value.status == 400 and set(caught.value.fields) >= {"resources.gpus", "extra"}
    with pytest.raises(NotFound):
        wz.job(submit(globex).pk)
    wz.cancel(job["id"])
    events = list(wz.iter_events(job["id"]))
    assert events[-1]["reason_code"] == "USER_CANCELLED"
    assert list(wz.iter_events(job["id"], skip=len(events))) == []
    assert [e["id"] for e in wz.iter_events(job["id"], skip=1)] == [e["id"] for e in events[1:]]
    assert {n["name"] for n in wz.nodes()} == {"acme-a100-0", "acme-a100-1"}
    assert wz.quota()["tenant"] == "acme"


def test_on_a_terminal_the_wait_is_one_line_redrawn(wz, spec_file):
    import os
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([str(WHALEZEN), "submit", spec_file(SPEC_YAML), "--wait", "--timeout", "1",
                                 "--interval", "0.2"], env=wz.environment(), stdout=subprocess.PIPE, stderr=slave,
                                stdin=subprocess.DEVNULL, text=True)
        os.close(slave)
        out, _ = proc.communicate(timeout=20)
        screen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the other side is closed: everything has been read
                break
            if not chunk:
                break
            screen += chunk
    finally:
        os.close(master)
    assert proc.returncode == cli.EXIT_TIMEOUT
    text = screen.decode()
    frames = text.split("\r\x1b[K")
    assert len(frames) >= 4  # redrawn in place, not a line per poll
    assert any(f.startswith(("| job", "/ job", "- job", "\\ job")) and "PENDING" in f for f in frames)
    assert "NOT_YET_SCHEDULED" in text and frames[-1].startswith("whalezen: job ")  # the status line cleared

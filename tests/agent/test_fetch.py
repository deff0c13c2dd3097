"""A job's files fetched before its command: s3 through moto's server, gs through a fake GCS JSON
API (tests/agent/fake_gcs.py), destinations kept under HOME, failures that stop the job with a
reason, and real agent-run jobs (host and image) whose command reads what was fetched."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.fetch_dest import FetchError, human_size, resolve_destination, tree_path
from agent.jobfiles import FETCH_SCRIPT, MANIFEST_FILE
from agent.jobs import Assignment, AssignmentInvalid, JobRunner
from agent.runtimes import detect
from tests.agent import runtime_standin
from tests.agent.fake_gcs import FakeGcs
from tests.agent.jobscripts import PY
from tests.agent.test_jobs import wait_for

AWS_TEST_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                "AWS_EC2_METADATA_DISABLED": "true"}
# Reads the files the job was promised and exits 0 only when they hold what the bucket held.
READS_FILES = [PY, "-c", (
    "import os, sys\n"
    "home = os.environ['HOME']\n"
    "config = open(os.path.join(home, 'data', 'config.yaml')).read()\n"
    "shard = open(os.path.join(home, 'corpus', 'shards', '0001.txt')).read()\n"
    "open('ran', 'w').write('yes')\n"
    "sys.exit(0 if (config, shard) == ('lr: 0.1\\n', 'tokens\\n') else 3)\n"
)]
MARK_RAN = [PY, "-c", "open('ran', 'w').write('yes')"]


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = _s3(endpoint)
    client.create_bucket(Bucket="team-data")
    for key, body in {"configs/config.yaml": b"lr: 0.1\n", "corpus/shards/0001.txt": b"tokens\n",
                      "corpus/shards/0002.txt": b"more tokens\n", "corpus/README": b"x" * 3_400_000,
                      "corpus/empty-folder/": b"", "hostile/../../escape.txt": b"gotcha"}.items():
        client.put_object(Bucket="team-data", Key=key, Body=body)
    client.put_object(Bucket="team-data", Key="public/readme.txt", Body=b"open data\n", ACL="public-read")
    try:
        yield endpoint
    finally:
        server.stop()


def _s3(endpoint: str):
    import boto3

    return boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                 region_name="us-east-1").client("s3", endpoint_url=endpoint)


@pytest.fixture
def gcs():
    fake = FakeGcs(page_size=2, token="ya29.test-token")
    fake.buckets["team-gcs"] = {"configs/config.yaml": b"lr: 0.1\n", "corpus/shards/0001.txt": b"tokens\n",
                                "corpus/shards/0002.txt": b"more\n", "corpus/shards/0003.txt": b"even more\n"}
    yield fake
    fake.stop()


def run_fetch(home: Path, files: list[dict], command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """agent/fetch.py as the agent starts it (`python -I`), in `home`, with only `env`."""
    manifest = home / MANIFEST_FILE
    manifest.write_text(json.dumps({"server": "http://127.0.0.1:9", "home": str(home), "files": files}))
    return subprocess.run([sys.executable, "-I", str(FETCH_SCRIPT), str(manifest), "--", *command], cwd=home,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(home), **env}, capture_output=True, text=True,
                          timeout=120)


# -- s3 ------------------------------------------------------------------------------------------
def test_an_s3_key_becomes_one_file_and_a_prefix_a_tree(tmp_path, s3_endpoint):
    env = {**AWS_TEST_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    done = run_fetch(tmp_path, [{"source": "s3://team-data/configs/config.yaml", "destination": "~/data/config.yaml"},
                                {"source": "s3://team-data/corpus/", "destination": "corpus"}],
                     [PY, "-c", "print('job ran')"], env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "data" / "config.yaml").read_text() == "lr: 0.1\n"
    assert (tmp_path / "corpus" / "shards" / "0002.txt").read_text() == "more tokens\n"
    assert (tmp_path / "corpus" / "empty-folder").is_dir()
    assert done.stdout.splitlines() == [
        "whalezen: fetched s3://team-data/configs/config.yaml -> ~/data/config.yaml (1 file, 8 B)",
        "whalezen: fetched s3://team-data/corpus/ -> corpus (3 files, 3.4 MB)",
        "job ran",  # the job's own command, after the files
    ]


def test_an_s3_name_without_its_own_object_is_the_folder_under_it(tmp_path, s3_endpoint):
    env = {**AWS_TEST_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    done = run_fetch(tmp_path, [{"source": "s3://team-data/corpus/shards", "destination": "~/shards"},
                                {"source": "s3://team-data/configs/config.yaml", "destination": "~/conf/"}],
                     MARK_RAN, env)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["0001.txt", "0002.txt"]
    assert (tmp_path / "conf" / "config.yaml").read_text() == "lr: 0.1\n"  # "into this folder"


def test_an_s3_fetch_without_any_credentials_goes_unsigned(tmp_path, s3_endpoint):
    env = {k: v for k, v in AWS_TEST_ENV.items() if not k.startswith("AWS_ACCESS") and "SECRET" not in k}
    done = run_fetch(tmp_path, [{"source": "s3://team-data/public/readme.txt", "destination": "readme.txt"}],
                     MARK_RAN, {**env, "AWS_ENDPOINT_URL": s3_endpoint})
    assert done.returncode == 0, done.stderr  # a public object needs no credentials
    assert (tmp_path / "readme.txt").read_text() == "open data\n"
    done = run_fetch(tmp_path, [{"source": "s3://team-data/configs/config.yaml", "destination": "c.yaml"}],
                     MARK_RAN, {**env, "AWS_ENDPOINT_URL": s3_endpoint})
    assert done.returncode == 125 and "access denied" in done.stderr  # a private one does


def test_a_missing_object_fails_with_exit_125_and_the_command_never_runs(tmp_path, s3_endpoint):
    env = {**AWS_TEST_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    done = run_fetch(tmp_path, [{"source": "s3://team-data/configs/config.yaml", "destination": "ok.yaml"},
                                {"source": "s3://team-data/no/such.bin", "destination": "~/x"}], MARK_RAN, env)
    assert done.returncode == 125
    assert done.stderr.strip() == ("whalezen: fetching files failed: s3://team-data/no/such.bin: no object "
                                   "'no/such.bin' in bucket 'team-data', and nothing under 'no/such.bin/'")
    assert not (tmp_path / "ran").exists()
    done = run_fetch(tmp_path, [{"source": "s3://no-such-bucket/x", "destination": "x"}], MARK_RAN, env)
    assert done.returncode == 125 and "s3://no-such-bucket/x: no such bucket" in done.stderr
    assert not (tmp_path / "ran").exists()


def test_a_bucket_key_that_climbs_out_of_the_tree_is_refused(tmp_path, s3_endpoint):
    env = {**AWS_TEST_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    (tmp_path / "home").mkdir()
    done = run_fetch(tmp_path / "home", [{"source": "s3://team-data/hostile/", "destination": "h"}], MARK_RAN, env)
    assert done.returncode == 125 and "has no safe file name" in done.stderr
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "home" / "ran").exists()


# -- gs ------------------------------------------------------------------------------------------
def test_gs_object_and_prefix_through_the_json_api_with_the_token(tmp_path, gcs):
    env = {"STORAGE_EMULATOR_HOST": gcs.endpoint, "GOOGLE_OAUTH_ACCESS_TOKEN": "ya29.test-token"}
    done = run_fetch(tmp_path, [{"source": "gs://team-gcs/configs/config.yaml", "destination": "~/config.yaml"},
                                {"source": "gs://team-gcs/corpus", "destination": "~/corpus"}], MARK_RAN, env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "config.yaml").read_text() == "lr: 0.1\n"
    assert (tmp_path / "corpus" / "shards" / "0003.txt").read_text() == "even more\n"  # past the first page
    assert "whalezen: fetched gs://team-gcs/corpus -> ~/corpus (3 files, 22 B)" in done.stdout
    assert (tmp_path / "ran").exists()
    assert {auth for _, auth in gcs.requests} == {"Bearer ya29.test-token"}


def test_gs_failures_say_what_and_stop_the_job(tmp_path, gcs):
    env = {"STORAGE_EMULATOR_HOST": gcs.endpoint, "GOOGLE_OAUTH_ACCESS_TOKEN": "ya29.test-token"}
    done = run_fetch(tmp_path, [{"source": "gs://team-gcs/nothing-here", "destination": "x"}], MARK_RAN, env)
    assert done.returncode == 125
    assert "gs://team-gcs/nothing-here: no object 'nothing-here' in bucket 'team-gcs'" in done.stderr
    done = run_fetch(tmp_path, [{"source": "gs://other-bucket/a", "destination": "x"}], MARK_RAN, env)
    assert done.returncode == 125 and "The specified bucket does not exist." in done.stderr
    done = run_fetch(tmp_path, [{"source": "gs://team-gcs/configs/config.yaml", "destination": "x"}], MARK_RAN,
                     {"STORAGE_EMULATOR_HOST": gcs.endpoint})  # no token
    assert done.returncode == 125 and "HTTP 401" in done.stderr
    assert not (tmp_path / "ran").exists() and not (tmp_path / "x").exists()


def test_an_upload_is_fetched_through_the_same_step(tmp_path):
    # The download itself is agent/fetch_upload.py's (tests/agent/test_fetch_upload.py); here: it is
    # wired in, and its failure stops the job with its reason like any other source.
    done = run_fetch(tmp_path, [{"source": "upload:" + "a" * 32, "destination": "~/sky_workdir"}], MARK_RAN, {})
    assert done.returncode == 125
    assert done.stderr.strip() == (f"whalezen: fetching files failed: upload:{'a' * 32}: the assignment carries no "
                                   "download token for it")
    assert not (tmp_path / "ran").exists()


# -- destinations --------------------------------------------------------------------------------
def test_destinations_resolve_under_home(tmp_path):
    assert resolve_destination("~/data/x.bin", tmp_path) == tmp_path / "data" / "x.bin"
    assert resolve_destination("data/./x.bin", tmp_path) == tmp_path / "data" / "x.bin"
    assert resolve_destination("~", tmp_path) == tmp_path
    assert resolve_destination(str(tmp_path / "whalezen-mounts" / "0"), tmp_path) == tmp_path / "whalezen-mounts" / "0"
    for bad in ("../x", "~/a/../../x", "/etc/passwd", "~root/.ssh", ""):
        with pytest.raises(FetchError):
            resolve_destination(bad, tmp_path)
    with pytest.raises(FetchError):
        tree_path(tmp_path, "a/../../b", tmp_path)


def test_a_symbolic_link_out_of_home_is_refused_and_nothing_is_written_there(tmp_path, s3_endpoint):
    home, outside = tmp_path / "home", tmp_path / "outside"
    home.mkdir()
    outside.mkdir()
    (home / "link").symlink_to(outside)
    env = {**AWS_TEST_ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    done = run_fetch(home, [{"source": "s3://team-data/configs/config.yaml", "destination": "~/link/config.yaml"}],
                     MARK_RAN, env)
    assert done.returncode == 125 and "outside the job's home" in done.stderr
    assert list(outside.iterdir()) == [] and not (home / "ran").exists()


def test_sizes_read_as_people_write_them():
    assert [human_size(n) for n in (0, 999, 1000, 3_400_000, 12_300_000_000)] == ["0 B", "999 B", "1.0 kB", "3.4 MB",
                                                                                 "12.3 GB"]


# -- the assignment ------------------------------------------------------------------------------
def _assignment(**overrides) -> Assignment:
    data = {"id": "f1", "job_id": "j1", "epoch": 1, "action": "start", "gpu_indices": [0], "command": READS_FILES,
            "files": [{"source": "s3://team-data/configs/config.yaml", "destination": "~/data/config.yaml"},
                      {"source": "s3://team-data/corpus", "destination": "corpus"}]}
    data.update(overrides)
    return Assignment.from_json(data)


@pytest.mark.parametrize("files, message", [
    ("s3://b/k", "files must be a list"),
    ([{"source": "http://example.com/x", "destination": "x"}], "files[0].source must be"),
    ([{"source": "upload:XYZ", "destination": "x"}], "files[0].source must be"),
    ([{"source": "s3://bucket/k", "destination": "/data"}], "absolute path is for jobs with an image"),
    ([{"source": "s3://bucket/k", "destination": "~/../x"}], "must not contain '..'"),
    ([{"source": "s3://bucket/k", "destination": 5}], "files[0].destination must be"),
    ([{"source": "s3://bucket/k", "destination": "a"}, {"source": "gs://bucket/k", "destination": "~/a"}],
     "same destination twice"),
    ([{"source": "s3://bucket/k", "destination": "x"}] * 65, "at most 64"),
])
def test_bad_files_in_an_assignment_are_refused(files, message):
    with pytest.raises(AssignmentInvalid, match=message.replace("[", r"\[").replace("]", r"\]")):
        _assignment(files=files)


def test_image_jobs_may_not_mount_over_the_system():
    with pytest.raises(AssignmentInvalid, match="would hide"):
        _assignment(image="ubuntu:22.04", files=[{"source": "s3://bucket/k", "destination": "/usr/"}])


# -- real jobs run by the agent ------------------------------------------------------------------
def test_an_agent_run_job_reads_its_fetched_files_and_exits_0(open_dir, s3_endpoint):
    runner = JobRunner(open_dir / "work", base_env={"PATH": "/usr/bin:/bin", "AWS_ENDPOINT_URL": s3_endpoint,
                                                    **AWS_TEST_ENV})
    job = runner.start(_assignment(), node_id="n1")
    (exit_,) = wait_for(runner.poll, what="job exit", limit_s=60)
    assert (exit_.state, exit_.exit_code) == ("exited", 0), exit_.output_tail
    assert "whalezen: fetched s3://team-data/corpus -> corpus (3 files, 3.4 MB)" in exit_.output_tail
    fetched = job.workdir / "corpus" / "shards" / "0001.txt"
    assert os.stat(fetched).st_uid == runner.job_user.uid  # fetched by the job user, not the agent
    manifest = job.workdir / MANIFEST_FILE
    assert os.stat(manifest).st_mode & 0o777 == 0o600 and os.stat(manifest).st_uid == runner.job_user.uid


def test_an_agent_run_job_whose_files_cannot_be_fetched_fails_with_the_reason(open_dir, s3_endpoint):
    runner = JobRunner(open_dir / "work", base_env={"PATH": "/usr/bin:/bin", "AWS_ENDPOINT_URL": s3_endpoint,
                                                    **AWS_TEST_ENV})
    job = runner.start(_assignment(files=[{"source": "s3://team-data/gone.bin", "destination": "gone.bin"}]),
                       node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit", limit_s=60)
    assert (exit_.state, exit_.exit_code) == ("failed", 125)
    assert exit_.message == ("fetching the job's files failed: s3://team-data/gone.bin: no object 'gone.bin' in "
                             "bucket 'team-data', and nothing under 'gone.bin/'")
    assert not (job.workdir / "ran").exists()


def test_an_image_job_gets_its_files_on_the_host_first_and_absolute_ones_mounted(open_dir, s3_endpoint):
    standin = runtime_standin.install(open_dir / "runtime", "docker")
    runner = JobRunner(open_dir / "work", base_env={"PATH": os.environ["PATH"], "AWS_ENDPOINT_URL": s3_endpoint,
                                                    **AWS_TEST_ENV},
                       runtimes=detect("docker", path=str(standin.bin_dir)))
    files = [{"source": "s3://team-data/configs/config.yaml", "destination": "~/data/config.yaml"},
             {"source": "s3://team-data/corpus/", "destination": "corpus"},
             {"source": "s3://team-data/corpus/shards/", "destination": "/datasets/shards"}]
    job = runner.start(_assignment(image="ubuntu:22.04", files=files), node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit", limit_s=60)
    assert (exit_.state, exit_.exit_code) == ("exited", 0), exit_.output_tail
    assert "whalezen: fetched s3://team-data/corpus/shards/ -> /datasets/shards (2 files, 19 B)" in exit_.output_tail
    (run,) = standin.records("run")
    mount = job.workdir / "whalezen-mounts" / "2"
    assert run["argv"][run["argv"].index(f"{mount}:/datasets/shards") - 1] == "--volume"
    assert run["uid"] == 0  # docker's client is the agent's; the files are still the job user's
    assert os.stat(mount / "0001.txt").st_uid == runner.job_user.uid


def test_an_image_job_whose_files_fail_is_not_blamed_on_the_runtime(open_dir, s3_endpoint):
    standin = runtime_standin.install(open_dir / "runtime", "docker")
    runner = JobRunner(open_dir / "work", base_env={"PATH": os.environ["PATH"], "AWS_ENDPOINT_URL": s3_endpoint,
                                                    **AWS_TEST_ENV},
                       runtimes=detect("docker", path=str(standin.bin_dir)))
    runner.start(_assignment(image="ubuntu:22.04", files=[{"source": "s3://team-data/gone/", "destination": "/g"}]),
                 node_id=None)
    (exit_,) = wait_for(runner.poll, what="job exit", limit_s=60)
    assert exit_.exit_code == 125 and exit_.message.startswith("fetching the job's files failed: s3://team-data/gone/")
    assert standin.records("run") == []  # the container never started


def test_the_agent_loop_runs_a_job_with_files_and_refuses_bad_ones(open_dir, broker, clock, s3_endpoint):
    from tests.agent.test_loop import make_agent, pump, start_assignment, states

    creds = {"AWS_ENDPOINT_URL": s3_endpoint, **AWS_TEST_ENV}  # the job's own env (its secrets, say)
    good = start_assignment(command=READS_FILES, env=creds, files=[
        {"source": "s3://team-data/configs/config.yaml", "destination": "~/data/config.yaml"},
        {"source": "s3://team-data/corpus/", "destination": "~/corpus"}])
    bad = start_assignment(id="a2", job_id="j2", gpu_indices=[0],
                           files=[{"source": "s3://team-data/x", "destination": "/etc/cron.d/x"}])
    broker.state.assignments = [good, bad]
    agent = make_agent(open_dir, broker, clock)
    pump(agent, clock, lambda: len(states(broker, "a1")) == 2 and states(broker, "a2"), what="exits", limit_s=60)
    assert states(broker, "a1") == ["running", "exited"]
    (refused,) = broker.statuses_for("a2")
    assert refused["state"] == "refused" and "absolute path is for jobs with an image" in refused["message"]
    manifest = json.loads((agent.runner.workdir_of("a1") / MANIFEST_FILE).read_text())
    assert manifest["server"] == broker.url  # where upload: sources are fetched from


def test_gs_uses_the_vm_service_account_from_the_metadata_server(monkeypatch):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from agent import fetch_gs

    class Metadata(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            ok = self.path == fetch_gs.METADATA_TOKEN_PATH and self.headers.get("Metadata-Flavor") == "Google"
            body = json.dumps({"access_token": "ya29.vm", "expires_in": 3599}).encode() if ok else b"{}"
            self.send_response(200 if ok else 403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv("GOOGLE_OAUTH_ACCESS_TOKEN", raising=False)
        monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{server.server_address[1]}")
        monkeypatch.setattr(fetch_gs, "_adc_token", lambda: None)  # a node without google-auth
        assert fetch_gs._token(emulator=False) == "ya29.vm"
        monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", "ya29.explicit")
        assert fetch_gs._token(emulator=False) == "ya29.explicit"  # an explicit token wins
    finally:
        server.shutdown()
        server.server_close()

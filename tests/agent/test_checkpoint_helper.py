"""The job author's checkpoint helper (agent/checkpoint): what a training script would notice.

Real files under tmp_path; S3 through one moto server on 127.0.0.1 (no test reaches the internet).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from agent import checkpoint
from agent.checkpoint import Checkpointer, UnsafeName, list_checkpoints, prune, restore_from, verify
from agent.checkpoint.manifest import MANIFEST_NAME, check_name, step_dir_name
from agent.jobs import CHECKPOINT_REQUEST_FILE
from tests.providers.conftest import moto_endpoint  # noqa: F401 (fixture: one moto server, a bucket per test)

REPO = Path(__file__).resolve().parents[2]


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture
def s3_uri(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch):
    """A fresh bucket; the helper finds moto through AWS_ENDPOINT_URL, as a job's env would say."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    client = boto3.client("s3", region_name="us-east-1", endpoint_url=moto_endpoint)
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/jobs/j1", client, bucket


@pytest.fixture
def job_env(tmp_path: Path) -> dict[str, str]:
    """The env the agent gives a job (agent/jobs.py job_environment), with a local checkpoint URI."""
    work = tmp_path / "work"
    work.mkdir()
    return {
        "WHALEZEN_CHECKPOINT_URI": str(tmp_path / "ckpt"),
        "WHALEZEN_WORK_DIR": str(work),
        "WHALEZEN_CHECKPOINT_REQUEST_FILE": str(work / CHECKPOINT_REQUEST_FILE),
        "WHALEZEN_JOB_ID": "job-7",
        "WHALEZEN_EPOCH": "3",
    }


@pytest.fixture
def restore_sigusr1() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, previous)


def agent_requests(env: dict[str, str], request_id: str) -> None:
    """What the agent does (agent/jobs.py _write_request): the JSON file, replaced by rename."""
    path = Path(env["WHALEZEN_CHECKPOINT_REQUEST_FILE"])
    tmp = path.with_name(".checkpoint-request.tmp")
    request = {"request_id": request_id, "assignment_id": "a1", "job_id": env["WHALEZEN_JOB_ID"],
               "checkpoint_uri": env["WHALEZEN_CHECKPOINT_URI"], "requested_at": 1.5}
    tmp.write_text(json.dumps(request))
    os.replace(tmp, path)


def flip_first_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))


# -- local: save, restore, newest wins ---------------------------------------------------------------


def test_save_then_restore_one_blob(job_env):
    ckpt = Checkpointer(env=job_env)
    result = ckpt.save(5, b"weights-v5")
    assert result.uri == str(Path(job_env["WHALEZEN_CHECKPOINT_URI"]) / "step-000000000005")

    restored = Checkpointer(env=job_env).restore()
    assert restored is not None
    assert (restored.step, restored.data) == (5, b"weights-v5")
    assert restored.manifest.job_id == "job-7" and restored.manifest.epoch == 3


def test_save_then_restore_several_files_from_bytes_and_paths(job_env, tmp_path):
    optimizer = tmp_path / "optim.bin"
    optimizer.write_bytes(os.urandom(3 * 1024 * 1024 + 7))  # several copy chunks
    ckpt = Checkpointer(env=job_env)
    ckpt.save(12, {"model.pt": b"model", "shards/rank-0.pt": b"shard0"}, files={"optimizer.pt": optimizer},
              extra={"loss": 0.25})

    restored = ckpt.restore()
    assert restored.names == ["model.pt", "optimizer.pt", "shards/rank-0.pt"]
    assert restored.read_bytes("model.pt") == b"model"
    assert restored.read_bytes("shards/rank-0.pt") == b"shard0"
    assert restored.path("optimizer.pt").read_bytes() == optimizer.read_bytes()
    assert restored.manifest.extra == {"loss": 0.25}
    with pytest.raises(KeyError):
        restored.read_bytes("not-saved.pt")


def test_newest_checkpoint_wins_and_listing_is_oldest_first(job_env):
    ckpt = Checkpointer(env=job_env)
    for step in (3, 10, 7):
        ckpt.save(step, f"state-{step}".encode())
    assert ckpt.restore().data == b"state-10"
    assert [info.step for info in list_checkpoints(job_env["WHALEZEN_CHECKPOINT_URI"])] == [3, 7, 10]


def test_no_checkpoint_yet_restores_none(job_env):
    assert Checkpointer(env=job_env).restore() is None


def test_restore_accepts_a_file_uri(tmp_path):
    Checkpointer(uri=str(tmp_path / "c d"), env={}).save(1, b"x")
    restored = restore_from(f"file://{tmp_path}/c%20d")
    assert restored is not None and restored.data == b"x"
    assert verify(f"file://{tmp_path}/c%20d/step-000000000001").ok


# -- torn and corrupt checkpoints ------------------------------------------------------------------


def test_torn_write_without_manifest_is_skipped_for_the_previous_one(job_env):
    ckpt = Checkpointer(env=job_env)
    ckpt.save(1, b"good")
    torn = ckpt.save(2, b"torn")
    (Path(torn.uri) / MANIFEST_NAME).unlink()  # the process died before the manifest landed

    restored = ckpt.restore()
    assert (restored.step, restored.data) == (1, b"good")
    assert [s.uri for s in restored.skipped] == [torn.uri]
    result = verify(torn.uri)
    assert not result.ok and "manifest.json missing" in result.problems[0]
    assert [(i.step, i.has_manifest) for i in ckpt.list()] == [(1, True), (2, False)]


def test_one_flipped_byte_is_skipped_and_verify_names_the_file(job_env):
    ckpt = Checkpointer(env=job_env)
    ckpt.save(1, {"model.pt": b"good model", "optim.pt": b"good optim"})
    bad = ckpt.save(2, {"model.pt": b"next model", "optim.pt": b"next optim"})
    flip_first_byte(Path(bad.uri) / "optim.pt")

    assert ckpt.restore().read_bytes("model.pt") == b"good model"
    result = verify(bad.uri)
    assert not result.ok
    assert len(result.problems) == 1 and result.problems[0].startswith("optim.pt: sha256")
    assert verify(ckpt.list()[0].uri).ok


def test_a_truncated_or_deleted_file_is_named_too(job_env):
    ckpt = Checkpointer(env=job_env)
    bad = ckpt.save(4, {"a.bin": b"12345", "b.bin": b"678"})
    Path(bad.uri, "a.bin").write_bytes(b"123")
    Path(bad.uri, "b.bin").unlink()
    assert verify(bad.uri).problems == ("a.bin: size 3 bytes, manifest says 5", "b.bin: missing")
    assert ckpt.restore() is None


def test_a_crash_while_writing_files_leaves_no_manifest(job_env, monkeypatch):
    ckpt = Checkpointer(env=job_env)
    ckpt.save(1, b"good")
    real_put = type(ckpt.storage).put

    def dies_on_second_file(self, rel, source):
        if rel.endswith("b.bin"):
            raise OSError(28, "No space left on device")
        return real_put(self, rel, source)

    monkeypatch.setattr(type(ckpt.storage), "put", dies_on_second_file)
    with pytest.raises(OSError):
        ckpt.save(2, {"a.bin": b"a", "b.bin": b"b"})
    monkeypatch.undo()
    assert [(i.step, i.has_manifest) for i in ckpt.list()] == [(1, True), (2, False)]
    assert ckpt.restore().data == b"good"
    notice = json.loads((Path(job_env["WHALEZEN_WORK_DIR"]) / checkpoint.NOTICE_FILE_NAME).read_text())
    assert notice["step"] == 1  # the agent was never told about the half-written one


def test_resaving_a_step_replaces_it_whole(job_env):
    ckpt = Checkpointer(env=job_env)
    ckpt.save(9, {"old.pt": b"old"})
    ckpt.save(9, {"new.pt": b"new"})
    restored = ckpt.restore()
    assert restored.names == ["new.pt"] and restored.read_bytes("new.pt") == b"new"


# -- prune ----------------------------------------------------------------------------------------


def test_prune_keeps_the_newest_two_verified(job_env):
    ckpt = Checkpointer(env=job_env)
    for step in (1, 2, 3, 4, 5):
        ckpt.save(step, f"s{step}".encode())
    flip_first_byte(Path(ckpt.list()[-1].uri) / "data")  # step 5 is corrupt: not one of the two kept
    torn = ckpt.save(6, b"s6")
    (Path(torn.uri) / MANIFEST_NAME).unlink()  # looks like a checkpoint being written: left alone

    result = ckpt.prune(keep=2)
    assert result.kept == (4, 3) and result.deleted == (1, 2)
    assert [i.step for i in ckpt.list()] == [3, 4, 5, 6]
    assert ckpt.restore().step == 4


def test_prune_deletes_nothing_without_enough_verified_ones(job_env):
    ckpt = Checkpointer(env=job_env)
    ckpt.save(1, b"only")
    assert prune(job_env["WHALEZEN_CHECKPOINT_URI"], keep=2).deleted == ()
    with pytest.raises(ValueError, match="keep must be at least 1"):
        ckpt.prune(keep=0)
    assert [i.step for i in ckpt.list()] == [1]


# -- requests: SIGUSR1 and the request file --------------------------------------------------------


def test_sigusr1_makes_a_checkpoint_due_and_save_answers_it(job_env, restore_sigusr1):
    ckpt = Checkpointer(env=job_env, handle_signal=True)
    assert ckpt.requested() is None and not ckpt.due(0)

    agent_requests(job_env, "req-1")
    os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before the next bytecode
    request = ckpt.requested()
    assert request is not None and (request.request_id, request.via) == ("req-1", "signal")
    assert ckpt.due(1)

    result = ckpt.save(1, b"on request")
    assert result.request_id == "req-1"
    assert ckpt.restore().manifest.request_id == "req-1"
    assert ckpt.requested() is None and not ckpt.due(2)


def test_a_bare_sigusr1_without_a_file_still_asks_for_one(job_env, restore_sigusr1):
    ckpt = Checkpointer(env=job_env, handle_signal=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert ckpt.requested() == checkpoint.Request(request_id=None, via="signal")
    assert ckpt.save(1, b"x").request_id is None
    assert ckpt.requested() is None


def test_the_handler_that_was_there_before_still_runs(job_env, restore_sigusr1):
    seen = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    ckpt = Checkpointer(env=job_env, handle_signal=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert seen == [signal.SIGUSR1] and ckpt.requested() is not None


def test_request_file_alone_is_seen_by_polling(job_env):
    ckpt = Checkpointer(env=job_env)  # no signal handler: the agent reports file_only
    agent_requests(job_env, "req-A")
    request = ckpt.requested()
    assert (request.request_id, request.via, request.requested_at) == ("req-A", "file", 1.5)
    assert ckpt.save(3, b"x").request_id == "req-A"
    assert ckpt.requested() is None

    agent_requests(job_env, "req-B")  # the next request is a new id in the same file
    assert ckpt.requested().request_id == "req-B"


def test_an_answered_request_stays_answered_after_a_periodic_save_and_a_restart(job_env):
    ckpt = Checkpointer(env=job_env)
    agent_requests(job_env, "req-A")
    ckpt.save(1, b"answers A")
    assert ckpt.save(2, b"periodic").request_id is None

    restarted = Checkpointer(env=job_env)  # the same process started again in the same work dir
    assert restarted.requested() is None


def test_due_on_interval_steps_and_seconds(job_env):
    now = [100.0]
    by_steps = Checkpointer(env=job_env, interval_steps=10)
    assert not by_steps.due(0) and not by_steps.due(9) and by_steps.due(10)
    by_steps.save(10, b"x")
    assert not by_steps.due(19) and by_steps.due(20)

    by_time = Checkpointer(env=job_env, interval_seconds=60, clock=lambda: now[0])
    assert not by_time.due(0)
    now[0] += 60
    assert by_time.due(1)
    by_time.save(1, b"x")
    assert not by_time.due(2)


def test_the_request_file_name_is_the_agents():
    assert checkpoint.REQUEST_FILE_NAME == CHECKPOINT_REQUEST_FILE


# -- the notice for the agent ----------------------------------------------------------------------


def test_written_notice_tells_the_agent_what_was_written(job_env):
    ckpt = Checkpointer(env=job_env)
    agent_requests(job_env, "req-9")
    result = ckpt.save(42, b"state")

    notice_path = Path(job_env["WHALEZEN_WORK_DIR"]) / "whalezen-checkpoint-written.json"
    assert result.notice_path == notice_path
    notice = json.loads(notice_path.read_text())
    manifest_bytes = (Path(result.uri) / MANIFEST_NAME).read_bytes()
    assert notice["request_id"] == "req-9"
    assert notice["step"] == 42
    assert notice["uri"] == result.uri == str(Path(job_env["WHALEZEN_CHECKPOINT_URI"]) / "step-000000000042")
    assert notice["manifest_sha256"] == hashlib.sha256(manifest_bytes).hexdigest() == result.manifest_sha256
    assert isinstance(notice["written_at"], float)
    manifest = json.loads(manifest_bytes)
    identity = (manifest["format"], manifest["job_id"], manifest["epoch"], manifest["step"])
    assert identity == (1, "job-7", 3, 42)
    assert manifest["files"] == [{"name": "data", "size": 5, "sha256": hashlib.sha256(b"state").hexdigest()}]
    assert not [p.name for p in Path(job_env["WHALEZEN_WORK_DIR"]).iterdir() if p.name.startswith(".wz-tmp")]


def test_outside_whalezen_there_is_no_notice(tmp_path):
    result = Checkpointer(uri=str(tmp_path / "c"), env={}).save(1, b"x")
    assert result.notice_path is None and verify(result.uri).ok


# -- path tricks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b", "a\x00b", "", "a//b", "./a",
                                  "a\\b", MANIFEST_NAME])
def test_unsafe_names_are_refused_before_anything_is_written(job_env, name):
    ckpt = Checkpointer(env=job_env)
    with pytest.raises(UnsafeName):
        ckpt.save(1, {"fine.pt": b"x", name: b"y"})
    assert ckpt.list() == []
    assert not (Path(job_env["WHALEZEN_CHECKPOINT_URI"]).parent / "escape").exists()


def test_a_manifest_naming_a_path_outside_is_never_restored(job_env, tmp_path):
    ckpt = Checkpointer(env=job_env)
    ckpt.save(1, b"good")
    evil = ckpt.save(2, b"evil")
    (tmp_path / "secret").write_bytes(b"secret")
    manifest = json.loads((Path(evil.uri) / MANIFEST_NAME).read_text())
    manifest["files"] = [{"name": "../../secret", "size": 6, "sha256": hashlib.sha256(b"secret").hexdigest()}]
    (Path(evil.uri) / MANIFEST_NAME).write_text(json.dumps(manifest))

    assert ckpt.restore().step == 1
    assert "'..' segment" in verify(evil.uri).problems[0]
    with pytest.raises(UnsafeName):
        ckpt.restore().read_bytes("../../secret")


def test_a_symlink_in_a_checkpoint_is_not_followed(job_env, tmp_path):
    ckpt = Checkpointer(env=job_env)
    result = ckpt.save(1, {"model.pt": b"secret"})
    (tmp_path / "secret").write_bytes(b"secret")
    target = Path(result.uri) / "model.pt"
    target.unlink()
    target.symlink_to(tmp_path / "secret")  # same bytes, but not the checkpoint's own file
    assert verify(result.uri).problems == ("model.pt: missing",)
    assert ckpt.restore() is None


def test_check_name_accepts_plain_nested_names():
    assert check_name("model/shard-0.pt") == "model/shard-0.pt"
    with pytest.raises(ValueError):
        step_dir_name(-1)


# -- S3 --------------------------------------------------------------------------------------------


def test_s3_save_restore_verify(s3_uri, job_env, tmp_path):
    uri, client, bucket = s3_uri
    env = {**job_env, "WHALEZEN_CHECKPOINT_URI": uri}
    big = tmp_path / "optim.bin"
    big.write_bytes(os.urandom(2 * 1024 * 1024 + 3))
    ckpt = Checkpointer(env=env)
    ckpt.save(1, {"model.pt": b"m1"}, files=[big])
    result = ckpt.save(2, {"model.pt": b"m2", "sub/x.pt": b"x2"}, files=[big])
    assert result.uri == f"{uri}/step-000000000002"
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert "jobs/j1/step-000000000002/manifest.json" in keys

    assert verify(result.uri).ok
    with ckpt.restore(into=tmp_path / "dl") as restored:
        assert restored.step == 2
        assert restored.read_bytes("model.pt") == b"m2" and restored.read_bytes("sub/x.pt") == b"x2"
        assert restored.path("optim.bin").read_bytes() == big.read_bytes()
        assert tmp_path / "dl" in restored.directory.parents  # downloaded where it was told
        directory = restored.directory
    assert not directory.exists()  # cleaned up on leaving the with-block
    notice = json.loads((Path(env["WHALEZEN_WORK_DIR"]) / checkpoint.NOTICE_FILE_NAME).read_text())
    assert notice["uri"] == result.uri


def test_s3_flipped_byte_and_torn_write_fall_back(s3_uri, job_env, tmp_path):
    uri, client, bucket = s3_uri
    ckpt = Checkpointer(env={**job_env, "WHALEZEN_CHECKPOINT_URI": uri})
    ckpt.save(1, {"model.pt": b"good"})
    ckpt.save(2, {"model.pt": b"flip"})
    ckpt.save(3, {"model.pt": b"torn"})
    key = "jobs/j1/step-000000000002/model.pt"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[0] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    client.delete_object(Bucket=bucket, Key="jobs/j1/step-000000000003/manifest.json")

    problems = verify(f"{uri}/step-000000000002").problems
    assert len(problems) == 1 and problems[0].startswith("model.pt: sha256")
    restored = ckpt.restore(into=tmp_path)
    assert (restored.step, restored.read_bytes("model.pt")) == (1, b"good")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("whalezen-restore-")] == [
        restored.directory.name]  # the failed downloads were removed
    restored.cleanup()


def test_s3_prune_keeps_two(s3_uri):
    uri, client, bucket = s3_uri
    ckpt = Checkpointer(uri=uri, env={})
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"model.pt": f"m{step}".encode(), "opt.pt": b"o"})
    assert prune(uri, keep=2).deleted == (1, 2)
    assert [i.step for i in list_checkpoints(uri)] == [3, 4]
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert not [k for k in keys if "step-000000000001" in k or "step-000000000002" in k]


def test_s3_restore_never_writes_outside_its_folder(s3_uri, tmp_path):
    uri, client, bucket = s3_uri
    ckpt = Checkpointer(uri=uri, env={})
    ckpt.save(1, {"model.pt": b"x"})
    client.put_object(Bucket=bucket, Key="jobs/j1/step-000000000001/../../../pwned", Body=b"x")
    manifest_key = "jobs/j1/step-000000000001/manifest.json"
    manifest = json.loads(client.get_object(Bucket=bucket, Key=manifest_key)["Body"].read())
    evil = {"name": "../../../pwned", "size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    manifest["files"].append(evil)
    client.put_object(Bucket=bucket, Key=manifest_key, Body=json.dumps(manifest))
    into = tmp_path / "restore-here"
    into.mkdir()
    assert ckpt.restore(into=into) is None
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["restore-here"]


# -- what a job process sees -----------------------------------------------------------------------


def test_local_use_needs_no_boto3_and_no_django(tmp_path):
    code = (
        "import sys\n"
        "sys.modules['boto3'] = None  # as on a node without it: importing it raises ImportError\n"
        "from agent import checkpoint\n"
        f"c = checkpoint.Checkpointer(uri={str(tmp_path)!r}, env={{}})\n"
        "c.save(1, b'x'); assert c.restore().data == b'x'\n"
        "assert not [m for m in sys.modules if m.startswith(('django', 'broker', 'botocore'))], sys.modules\n"
        "try:\n"
        "    checkpoint.Checkpointer(uri='s3://b/p', env={}).save(1, b'x')\n"
        "except ImportError as err:\n"
        "    print('ImportError:', err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "s3:// checkpoints need boto3" in out.stdout


def test_toy_example_restores_where_it_stopped(tmp_path):
    """Run as a job would: the system Python, another cwd, no PYTHONPATH (the script finds the helper)."""
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    env = {"PATH": "/usr/bin:/bin", "WHALEZEN_CHECKPOINT_URI": str(tmp_path / "ckpt"),
           "WHALEZEN_WORK_DIR": str(tmp_path)}
    argv = [python, "-I", str(REPO / "examples" / "train_toy.py"), "--step-seconds", "0"]
    first = subprocess.run([*argv, "--steps", "5"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=30)
    assert first.returncode == 0, first.stderr
    assert "step 4 loss" in first.stdout and "restored from" not in first.stdout
    second = subprocess.run([*argv, "--steps", "8"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=30)
    assert second.returncode == 0, second.stderr
    lines = second.stdout.splitlines()
    assert lines[0] == "restored from step 4" and lines[1].startswith("step 5 loss ")
    assert [i.step for i in list_checkpoints(str(tmp_path / "ckpt"))] == [4, 7]


def test_the_toys_fault_drill_tears_one_checkpoint_and_a_restart_skips_it(tmp_path):
    """--tear-checkpoint-at-step: the checkpoint fails verification (its data no longer matches its
    manifest), and a restart does not restore it."""
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    env = {"PATH": "/usr/bin:/bin", "WHALEZEN_CHECKPOINT_URI": str(tmp_path / "ckpt")}
    argv = [python, "-I", str(REPO / "examples" / "train_toy.py"), "--step-seconds", "0"]
    first = subprocess.run([*argv, "--steps", "5", "--tear-checkpoint-at-step", "4"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=30)
    assert first.returncode == 0, first.stderr
    assert "checkpoint step 4 torn on purpose" in first.stdout
    torn = next(i for i in list_checkpoints(str(tmp_path / "ckpt")) if i.step == 4)
    result = verify(torn.uri)
    assert not result.ok and any("sha256" in p for p in result.problems), result
    again = subprocess.run([*argv, "--steps", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert again.returncode == 0 and "restored from" not in again.stdout, again.stdout


# -- restoring what the broker committed (WHALEZEN_RESTORE_FROM) -------------------------------------


def test_the_committed_checkpoint_is_restored_even_when_newer_ones_verify(job_env):
    ckpt = Checkpointer(env=job_env)
    for step in (10, 20, 30):
        ckpt.save(step, f"state-{step}".encode())
    committed = ckpt.list()[1].uri  # step 20; 30 was written but the broker never committed it

    restored = Checkpointer(env={**job_env, "WHALEZEN_RESTORE_FROM": committed}).restore()
    assert (restored.step, restored.data, restored.uri) == (20, b"state-20", committed)


def test_nothing_committed_means_start_from_scratch(job_env):
    Checkpointer(env=job_env).save(5, b"left by another copy of the job")
    assert Checkpointer(env={**job_env, "WHALEZEN_RESTORE_FROM": ""}).restore() is None


def test_a_committed_checkpoint_corrupted_since_falls_back_to_a_lower_step_and_says_so(job_env, capfd):
    ckpt = Checkpointer(env=job_env)
    for step in (10, 20, 30):
        ckpt.save(step, f"state-{step}".encode())
    committed = ckpt.list()[1].uri
    flip_first_byte(Path(committed) / "data")

    restored = Checkpointer(env={**job_env, "WHALEZEN_RESTORE_FROM": committed}).restore()
    assert (restored.step, restored.data) == (10, b"state-10")  # never 30, which was not committed
    assert restored.skipped[0].uri == committed
    err = capfd.readouterr().err
    assert committed in err and restored.uri in err and "fails verification" in err


def test_no_lower_checkpoint_left_restores_none_with_a_warning(job_env, capfd):
    ckpt = Checkpointer(env=job_env)
    ckpt.save(20, b"committed")
    ckpt.save(30, b"never committed")
    committed = ckpt.list()[0].uri
    (Path(committed) / MANIFEST_NAME).unlink()

    assert checkpoint.Checkpointer(env={**job_env, "WHALEZEN_RESTORE_FROM": committed}).restore() is None
    err = capfd.readouterr().err
    assert committed in err and "starting from scratch" in err


def test_module_restore_honours_the_variable(job_env, monkeypatch):
    ckpt = Checkpointer(env=job_env)
    ckpt.save(1, b"one")
    ckpt.save(2, b"two")
    monkeypatch.setenv("WHALEZEN_RESTORE_FROM", ckpt.list()[0].uri)
    assert checkpoint.restore(job_env["WHALEZEN_CHECKPOINT_URI"]).data == b"one"
    monkeypatch.setenv("WHALEZEN_RESTORE_FROM", "")
    assert checkpoint.restore(job_env["WHALEZEN_CHECKPOINT_URI"]) is None


@pytest.mark.parametrize("restore_from", ["committed", ""])
def test_under_a_broker_prune_deletes_nothing(job_env, restore_from):
    """The broker commits each checkpoint some time after its write (it re-reads it first) and
    deletes old ones itself: the job, which cannot see what is committed yet, must not. (It used to
    keep its newest two, and deleted the only one a move had committed while verification lagged.)"""
    ckpt = Checkpointer(env=job_env)
    for step in (1, 2, 3, 4):
        ckpt.save(step, b"x")
    said = ckpt.list()[0].uri if restore_from == "committed" else ""
    managed = Checkpointer(env={**job_env, "WHALEZEN_RESTORE_FROM": said})
    assert managed.broker_prunes and managed.prune(keep=2).deleted == ()
    assert [i.step for i in ckpt.list()] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="keep must be at least 1"):
        managed.prune(keep=0)


def test_s3_committed_checkpoint_and_its_fallback(s3_uri, job_env, tmp_path, capfd):
    uri, client, bucket = s3_uri
    ckpt = Checkpointer(env={**job_env, "WHALEZEN_CHECKPOINT_URI": uri})
    for step in (1, 2, 3):
        ckpt.save(step, {"model.pt": f"m{step}".encode()})
    env = {**job_env, "WHALEZEN_CHECKPOINT_URI": uri, "WHALEZEN_RESTORE_FROM": f"{uri}/step-000000000002"}
    with Checkpointer(env=env).restore(into=tmp_path / "dl") as restored:
        assert (restored.step, restored.read_bytes("model.pt")) == (2, b"m2")

    client.put_object(Bucket=bucket, Key="jobs/j1/step-000000000002/model.pt", Body=b"mX")
    with Checkpointer(env=env).restore(into=tmp_path / "dl") as restored:
        assert (restored.step, restored.read_bytes("model.pt")) == (1, b"m1")
    assert f"{uri}/step-000000000002" in capfd.readouterr().err



def test_a_work_dir_the_job_cannot_write_loses_the_notice_not_the_run(tmp_path, capfd, monkeypatch):
    """E.g. a work dir under a folder the job user cannot traverse: the save still succeeds and says why
    the broker will not hear of it, instead of killing the training run."""
    from agent.checkpoint import Checkpointer, checkpointer, verify

    (tmp_path / "work").mkdir()
    saver = Checkpointer(str(tmp_path / "ckpt"), env={"WHALEZEN_WORK_DIR": str(tmp_path / "work")})

    def refused(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpointer, "write_atomic", refused)
    result = saver.save(3, b"state")
    assert result.notice_path is None and verify(result.uri).ok
    assert "step 3 saved, but the agent cannot be told" in capfd.readouterr().err

"""`whalezen submit` of a SkyPilot task with a local workdir and file_mounts: packed (ignore files
honoured), uploaded, and the submitted job names the uploads; a dry run sends nothing; too big is
exit 2 before anything is sent."""
from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from broker.jobs.models import Job, Upload
from broker.jobs.uploads import blob_path
from whalezen import cli
from whalezen.uploads import LocalSource, ignore_rules, ignored, pack

TASK = """\
name: uploaded
resources:
  accelerators: A100-80GB:1
workdir: ./proj
file_mounts:
  ~/conf/train.yaml: ./train.yaml
run: python train.py --config ~/conf/train.yaml
"""


@pytest.fixture(autouse=True)
def upload_dir(settings, tmp_path):
    settings.WHALEZEN_UPLOAD_DIR = tmp_path / "uploads"


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A task folder: proj/ (with .git, a .skyignore, things it leaves out), train.yaml, task.yaml; the
    current directory, as SkyPilot resolves relative paths from where it is called."""
    root = tmp_path / "work"
    proj = root / "proj"
    (proj / ".git").mkdir(parents=True)
    (proj / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (proj / "train.py").write_text("print('training')\n")
    (proj / "lib").mkdir()
    (proj / "lib" / "model.py").write_text("X = 1\n")
    (proj / "data").mkdir()
    (proj / "data" / "huge.bin").write_bytes(b"\0" * 1000)
    (proj / "epoch1.ckpt").write_bytes(b"ckpt")
    (proj / ".skyignore").write_text("# not sent\n*.ckpt\n/data/\n")
    (proj / ".gitignore").write_text("lib/\n")  # a .skyignore wins: lib/ is sent
    (root / "train.yaml").write_text("lr: 0.1\n")
    (root / "task.yaml").write_text(TASK)
    monkeypatch.chdir(root)
    return root


def names_in(upload: Upload) -> list[str]:
    with tarfile.open(blob_path(upload), "r:gz") as tar:
        return sorted(m.name for m in tar.getmembers() if m.isfile())


def test_submit_uploads_the_workdir_and_file_mounts_and_names_them(wz, acme, project):
    result = wz("submit", "task.yaml")
    assert result.code == cli.EXIT_OK, result.err
    job = Job.objects.get(pk=int(result.out.strip()))
    files = {f["destination"]: f["source"] for f in job.spec["files"]}
    assert set(files) == {"~/sky_workdir", "~/conf/train.yaml"}
    workdir = Upload.objects.get(id=files["~/sky_workdir"].removeprefix("upload:"))
    config = Upload.objects.get(id=files["~/conf/train.yaml"].removeprefix("upload:"))
    assert workdir.tenant == acme.tenant and workdir.kind == "tree" and config.kind == "file"
    assert names_in(workdir) == [".gitignore", ".skyignore", "lib/model.py", "train.py"]
    assert names_in(config) == ["train.yaml"]
    assert "uploaded workdir ./proj: 4 files" in result.err
    # Submitting the same task again sends the same archives: the same uploads, no copies.
    again = wz("submit", "task.yaml")
    assert again.code == cli.EXIT_OK, again.err
    assert Upload.objects.count() == 2


def test_a_dry_run_uploads_nothing_and_says_what_it_would(wz, project):
    result = wz("submit", "task.yaml", "--dry-run")
    assert result.code == cli.EXIT_OK, result.err
    assert "would upload workdir ./proj: 4 files" in result.err
    assert "would upload file_mounts[~/conf/train.yaml] ./train.yaml: 1 file" in result.err
    assert "problem:" not in result.err
    assert Upload.objects.count() == 0 and Job.objects.count() == 0
    as_json = wz("submit", "task.yaml", "--dry-run", "--json")
    assert [u["field"] for u in as_json.json["uploads"]] == ["workdir", "file_mounts[~/conf/train.yaml]"]
    assert as_json.json["problems"] == []


def test_a_workdir_over_the_limit_is_exit_2_before_anything_is_sent(wz, project):
    (project / "proj" / "weights.bin").write_bytes(os.urandom(50_000))
    result = wz("submit", "task.yaml", WHALEZEN_MAX_UPLOAD_BYTES="20000")
    assert result.code == cli.EXIT_USAGE
    assert "workdir: ./proj packs to more than 20.0 KB" in result.err and ".skyignore" in result.err
    assert Upload.objects.count() == 0 and Job.objects.count() == 0


def test_a_missing_local_source_is_exit_2(wz, project):
    (project / "train.yaml").unlink()
    result = wz("submit", "task.yaml")
    assert result.code == cli.EXIT_USAGE and "./train.yaml does not exist" in result.err
    assert Upload.objects.count() == 0 and Job.objects.count() == 0


# -- packing, offline ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path, is_dir, expected", [
    ("a.ckpt", False, True), ("deep/down/b.ckpt", False, True), ("data", True, True),
    ("sub/data", True, False), ("data", False, False), ("build/x/out.o", False, True),
    ("keep.ckpt", False, False), ("docs/readme.md", False, False),
])
def test_ignore_patterns_follow_gitignore_syntax(path, is_dir, expected):
    rules = ignore_rules("*.ckpt\n!keep.ckpt\n/data/\nbuild/**/*.o\n")
    assert ignored(path, is_dir=is_dir, rules=rules) is expected


def test_links_to_files_are_sent_as_files_and_links_to_folders_left_out(tmp_path):
    root = tmp_path / "proj"
    root.mkdir()
    (tmp_path / "real.txt").write_text("real")
    (root / "real-link.txt").symlink_to(tmp_path / "real.txt")
    (root / "loop").symlink_to(root)
    packed = pack(LocalSource("workdir", "proj", root))
    try:
        with tarfile.open(packed.archive, "r:gz") as tar:
            members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {"real-link.txt"} and members["real-link.txt"].isfile()
        assert packed.skipped == ["loop (a link to a folder)"]
    finally:
        packed.discard()
    assert not packed.archive.exists()

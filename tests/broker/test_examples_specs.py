"""Every spec in examples/ is accepted as it is written (through the dry run), in the format it claims,
with nothing that would block its submission beyond what its comments say to supply."""
from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
URL = "/api/v1/jobs/?dry_run=1"


@pytest.mark.parametrize("name, fmt, problems", [
    ("job-native.yaml", "whalezen", []),
    ("job-kubernetes-style.json", "whalezen", []),
    ("skypilot-task.yaml", "skypilot", ["envs.RUN_NAME"]),  # --env RUN_NAME=... at submit time
    ("kubernetes-job.yaml", "kubernetes", []),
    ("skypilot-gang.yaml", "skypilot", ["envs.EXAMPLES"]),  # --env EXAMPLES=$PWD/examples
])
def test_each_example_is_read_as_its_format(acme, name, fmt, problems):
    text = (EXAMPLES / name).read_text()
    content_type = "application/json" if name.endswith(".json") else "application/yaml"
    resp = acme.client.post(URL, data=text, content_type=content_type)
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["format"] == fmt and body["demand"]["total_gpus"] >= 1
    assert [p["field"] for p in body["problems"]] == problems


def test_the_toy_training_job_is_accepted_with_this_checkout_filled_in(acme, settings, tmp_path):
    settings.WHALEZEN_CHECKPOINT_ROOTS = [str(tmp_path)]
    text = (EXAMPLES / "train_toy.yaml").read_text().replace("@WHALEZEN@/var/checkpoints", str(tmp_path))
    text = text.replace("@WHALEZEN@", str(EXAMPLES.parent)).replace("@RUN@", "toy-1")
    resp = acme.client.post(URL, data=text, content_type="application/yaml")
    assert resp.status_code == 200, resp.content
    assert resp.json()["problems"] == []

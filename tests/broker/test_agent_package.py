"""The broker serves its own node agent, and what it serves runs on a node without the repository."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

from providers.bootstrap import agent_boot_script


def test_agent_tarball_is_self_contained_and_runs(client, tmp_path):
    resp = client.get("/agent/package.tar.gz")
    assert resp.status_code == 200 and resp["Content-Type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(resp.content), mode="r:gz") as tar:
        names = tar.getnames()
        assert "agent/__main__.py" in names and "agent/requirements.txt" in names
        assert not any("__pycache__" in n for n in names)
        tar.extractall(tmp_path, filter="data")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE")}
    probe = subprocess.run([sys.executable, "-m", "agent", "probe", "--fake-gpus", "2xT4"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    report = json.loads(probe.stdout)
    assert len(report["inventory"]["gpus"]) == 2
    assert client.get("/agent/package.tar.gz").content == resp.content, "reproducible bytes"


def test_cloud_boot_script_installs_the_agent_from_the_broker():
    script = agent_boot_script(server_url="https://broker.example.com", join_token="wzi_x_y", node_name="n1")
    assert "https://broker.example.com/agent/package.tar.gz" in script
    assert "pip install --quiet -r /opt/whalezen/agent/requirements.txt" in script
    assert "WorkingDirectory=/opt/whalezen" in script
    assert "wzi_x_y" not in script.split("agent.env")[0], "the token only lands in the root-only env file"

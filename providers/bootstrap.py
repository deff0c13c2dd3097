"""The boot script a cloud node runs (AWS user-data, GCP startup-script): install the node
agent and keep it running under systemd, so it survives reboots and agent crashes."""
from __future__ import annotations

# The broker serves the agent it speaks to (GET /agent/package.tar.gz): no package index needed, and
# the node always runs the protocol version of its broker. `{server_url}` is filled in.
AGENT_HOME = "/opt/whalezen"
DEFAULT_AGENT_INSTALL = (
    f"install -d {AGENT_HOME} && curl -fsSL --retry 10 --retry-connrefused "
    f'"{{server_url}}/agent/package.tar.gz" | tar -xz -C {AGENT_HOME} && '
    f"python3 -m pip install --quiet -r {AGENT_HOME}/agent/requirements.txt"
)


def agent_boot_script(
    *,
    server_url: str,
    join_token: str,
    node_name: str,
    install_command: str = DEFAULT_AGENT_INSTALL,
    python: str = "python3",
) -> str:
    """A bash script that installs the agent and starts `python -m agent --server URL --name NAME`
    as a systemd service. The join token only lets a node register (the agent then gets its own
    node token); it sits in a root-only file that the agent reads (`--join-token-file`) and deletes
    once registered: never on a command line `ps` can show, nor in the agent's environment, which
    stays readable in /proc for the agent's whole life. Jobs run as the unprivileged user
    `whalezen-job`, created here (docs/agent.md, "Jobs cannot read the agent's secrets")."""
    for label, value in (("server_url", server_url), ("join_token", join_token), ("node_name", node_name)):
        # Values go into an env file verbatim: a newline or quote would let them inject lines.
        if not value or any(c in value for c in "\n\r\"'`$\\"):
            raise ValueError(f"{label} is empty or contains characters not allowed in a boot script")
    install = install_command.replace("{server_url}", server_url)
    return f"""#!/bin/bash
set -euo pipefail
{install}
install -d -m 0700 /etc/whalezen
umask 077
cat > /etc/whalezen/agent.env <<'WZEOF'
WHALEZEN_SERVER={server_url}
WHALEZEN_NODE_NAME={node_name}
WZEOF
cat > /etc/whalezen/join-token <<'WZEOF'
{join_token}
WZEOF
id -u whalezen-job >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin whalezen-job \
|| echo "whalezen: cannot create the whalezen-job user; jobs will run as nobody" >&2
cat > /etc/systemd/system/whalezen-agent.service <<'WZEOF'
[Unit]
Description=WhaleZen node agent
After=network-online.target
Wants=network-online.target
[Service]
EnvironmentFile=/etc/whalezen/agent.env
WorkingDirectory={AGENT_HOME}
ExecStart=/bin/sh -c 'exec {python} -m agent --server "$WHALEZEN_SERVER" --name "$WHALEZEN_NODE_NAME" --state-dir /var/lib/whalezen-agent --join-token-file /etc/whalezen/join-token --delete-join-token-file'
Restart=always
RestartSec=5
[Install]
WantedBy=multi-user.target
WZEOF
systemctl daemon-reload
systemctl enable --now whalezen-agent.service
"""

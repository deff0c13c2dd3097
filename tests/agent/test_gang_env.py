"""A gang's part gets its rank, its peers and rank 0's address (agent/gang.py, docs/agent.md
"Multi-node jobs"); a bad gang is refused; the job's own env cannot forge any of it."""
from __future__ import annotations

import json

import pytest

from agent.cli import main
from agent.jobs import Assignment, AssignmentInvalid, JobRunner, job_environment
from tests.agent import jobscripts
from tests.agent.test_jobs import wait_for
from tests.agent.test_loop import make_agent, start_assignment

GANG = {"rank": 1, "node_addresses": ["10.0.0.7", "gpu-b.dc1.example"], "gpus_per_node": 2,
        "master_port": 12345}


def gang_assignment(gang=None, **overrides) -> Assignment:
    data = {"id": "a1", "job_id": "j1", "epoch": 3, "action": "start", "gpu_indices": [2, 5],
            "command": jobscripts.WRITE_ENV, "env": {}, "gang": GANG if gang is None else gang}
    data.update(overrides)
    return Assignment.from_json(data)


def test_a_part_of_a_two_node_gang_gets_its_rank_peers_and_master(open_dir):
    runner = JobRunner(open_dir, base_env={"PATH": "/usr/bin:/bin"})
    job = runner.start(gang_assignment(), node_id="n1")
    (exit_,) = wait_for(runner.poll, what="job exit")
    assert exit_.state == "exited"
    env = json.loads((job.workdir / "env.json").read_text())  # what the real process saw
    assert env["WHALEZEN_NODE_RANK"] == "1" and env["WHALEZEN_NUM_NODES"] == "2"
    assert env["WHALEZEN_NODE_IPS"] == "10.0.0.7\ngpu-b.dc1.example"  # one per line, rank order
    assert env["WHALEZEN_NUM_GPUS_PER_NODE"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.7", "12345")  # rank 0's node
    assert not [k for k in env if k.startswith("SKYPILOT_")]  # not submitted as a SkyPilot task


def test_a_skypilot_task_also_gets_the_names_its_run_script_reads(open_dir):
    env = job_environment(gang_assignment({**GANG, "rank": 0, "skypilot_env": True}), workdir=open_dir,
                          node_id=None, base_env={})
    assert env["SKYPILOT_NODE_RANK"] == env["WHALEZEN_NODE_RANK"] == "0"
    assert env["SKYPILOT_NUM_NODES"] == "2" and env["SKYPILOT_NUM_GPUS_PER_NODE"] == "2"
    assert env["SKYPILOT_NODE_IPS"].splitlines() == ["10.0.0.7", "gpu-b.dc1.example"]


def test_a_single_node_job_is_a_gang_of_one(open_dir):
    gang = {"rank": 0, "node_addresses": ["192.168.1.20"], "gpus_per_node": 8, "master_port": 10042}
    env = job_environment(gang_assignment(gang), workdir=open_dir, node_id=None, base_env={})
    assert (env["WHALEZEN_NODE_RANK"], env["WHALEZEN_NUM_NODES"], env["WHALEZEN_NODE_IPS"]) == ("0", "1",
                                                                                                "192.168.1.20")
    assert env["MASTER_ADDR"] == "192.168.1.20" and env["MASTER_PORT"] == "10042"


def test_the_jobs_env_and_the_agents_own_env_cannot_forge_the_gang(open_dir):
    forged = {"WHALEZEN_NODE_RANK": "0", "MASTER_ADDR": "evil.example", "MASTER_PORT": "1", "SKYPILOT_NODE_RANK": "0",
              "WHALEZEN_NODE_IPS": "evil.example", "OK": "yes"}
    env = job_environment(gang_assignment(env=forged), workdir=open_dir, node_id=None,
                          base_env={"MASTER_ADDR": "agent-host", "SKYPILOT_NUM_NODES": "9", "PATH": "/bin"})
    assert env["WHALEZEN_NODE_RANK"] == "1" and env["MASTER_ADDR"] == "10.0.0.7" and env["MASTER_PORT"] == "12345"
    assert env["WHALEZEN_NODE_IPS"] == "10.0.0.7\ngpu-b.dc1.example"
    assert "SKYPILOT_NODE_RANK" not in env and "SKYPILOT_NUM_NODES" not in env  # not a SkyPilot task
    assert env["OK"] == "yes" and env["PATH"] == "/bin"


def test_without_a_gang_from_the_broker_no_gang_variable_is_set(open_dir):
    a = Assignment.from_json({"id": "a1", "job_id": "j1", "epoch": 1, "command": ["true"],
                              "env": {"MASTER_ADDR": "x"}})
    env = job_environment(a, workdir=open_dir, node_id=None, base_env={"MASTER_PORT": "1"})
    assert not {"MASTER_ADDR", "MASTER_PORT", "WHALEZEN_NODE_RANK"} & set(env)


@pytest.mark.parametrize(("gang", "fragment"), [
    ("rank 1", "gang must be an object"),
    ({**GANG, "rank": 2}, "gang.rank must be a whole number from 0 to 1"),
    ({**GANG, "rank": -1}, "gang.rank"),
    ({**GANG, "rank": True}, "gang.rank"),
    ({**GANG, "rank": "1"}, "gang.rank"),
    ({**GANG, "node_addresses": []}, "gang.node_addresses must list"),
    ({**GANG, "node_addresses": "10.0.0.7"}, "gang.node_addresses must list"),
    # A newline would add a peer to WHALEZEN_NODE_IPS; a space or a port is no address.
    ({**GANG, "node_addresses": ["10.0.0.7", "10.0.0.8\n10.6.6.6"]}, "gang.node_addresses[1] must be an IP"),
    ({**GANG, "node_addresses": ["10.0.0.7:29500", "b"]}, "gang.node_addresses[0] must be an IP"),
    ({**GANG, "node_addresses": ["10.0.0.999", "b"]}, "gang.node_addresses[0] must be an IP"),
    ({**GANG, "node_addresses": ["a b", "b"]}, "gang.node_addresses[0]"),
    ({**GANG, "node_addresses": [None, "b"]}, "gang.node_addresses[0] must be a non-empty string"),
    ({**GANG, "master_port": 80}, "gang.master_port must be a port number from 1024 to 65535"),
    ({**GANG, "master_port": 70000}, "gang.master_port"),
    ({**GANG, "gpus_per_node": -1}, "gang.gpus_per_node"),
    ({**GANG, "skypilot_env": "yes"}, "gang.skypilot_env must be true or false"),
])
def test_a_bad_gang_is_refused_as_an_invalid_assignment(gang, fragment):
    with pytest.raises(AssignmentInvalid) as err:
        gang_assignment(gang)
    assert fragment in str(err.value)


def test_the_agent_refuses_a_bad_gang_and_starts_nothing(open_dir, broker, clock):
    broker.state.assignments = [start_assignment(gang={**GANG, "rank": 5})]
    agent = make_agent(open_dir, broker, clock)
    agent.step()
    (refusal,) = broker.statuses_for("a1")
    assert (refusal["state"], refusal["reason"]) == ("refused", "invalid")
    assert "gang.rank" in refusal["message"]
    assert agent.runner.running == {}


def test_the_advertised_address_is_sent_at_registration(open_dir, broker, clock):
    agent = make_agent(open_dir, broker, clock, advertise_address="10.1.2.3")
    agent.step()
    assert broker.state.registrations[0]["address"] == "10.1.2.3"
    other = make_agent(open_dir / "b", broker, clock)
    other.step()
    assert "address" not in broker.state.registrations[1]  # the broker takes the request's address


@pytest.mark.parametrize("address", ["10.0.0.1:22", "node a", "http://x", "under_score.example"])
def test_a_bad_advertise_address_is_a_usage_error(open_dir, address, capsys):
    code = main(["--server", "http://127.0.0.1:9", "--join-token", "x", "--fake-gpus", "1xT4",
                 "--state-dir", str(open_dir / "s"), "--advertise-address", address])
    assert code == 2
    assert "--advertise-address" in capsys.readouterr().err

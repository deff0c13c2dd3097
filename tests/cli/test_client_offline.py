"""The client and CLI against small fake servers (no database): what a server without billing says,
server errors, timeouts, which requests are retried, and that the package imports nothing of broker/."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from whalezen import Client, cli, errors
from whalezen.errors import describe_body, flatten_field_errors

from .conftest import REPO, Wz


class FakeApi:
    """Answers every request with `answer(method, path) -> (status, body, headers)`; records requests."""

    def __init__(self, answer):
        self.answer, self.requests = answer, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                fake.requests.append((self.command, self.path, self.headers.get("Authorization")))
                status, body, headers = fake.answer(self.command, self.path)
                raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", headers.pop("Content-Type", "application/json"))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = do_PATCH = _any

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    servers = []

    def start(answer):
        server = FakeApi(answer)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def not_found(method, path):
    return 404, {"detail": "Not found."}, {}


def test_a_server_without_billing_says_so(fake, home, tmp_path):
    api = fake(not_found)
    wz = Wz(home, api.url, "wz_00000000_t")
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "q", "command": ["x"], "resources": {"gpus": 1}}))
    for argv, feature in [(["costs", "--group-by", "team,day"], "costs"), (["costs", "--csv"], "costs"),
                          (["quote", str(spec)], "quotes"), (["statements"], "statements"),
                          (["statements", "2026-11"], "statements"), (["budget"], "budget"),
                          (["budget", "--set", "100"], "budget"),
                          (["savings", "--from", "2026-11-01"], "savings")]:
        result = wz(*argv)
        assert result.code == cli.EXIT_API, argv
        line = result.err.strip()
        assert line.startswith(f"whalezen: this server has no {feature} API") and "\n" not in line
    assert ("GET", "/api/v1/costs/?group_by=team%2Cday", "Bearer wz_00000000_t") in api.requests
    with pytest.raises(errors.NotSupported) as caught:
        Client(api.url, "t").costs(group_by=["team", "gpu_model"])
    assert isinstance(caught.value, errors.NotFound) and caught.value.feature == "costs"


def test_costs_csv_and_table_when_the_server_has_them(fake, home):
    rows = [{"gpu_model": "A100-80GB", "gpu_hours": 12.5, "cost": "31.25", "idle_cost": "0.00",
             "avg_gpu_utilisation": 0.8}]

    def answer(method, path):
        if path.startswith("/api/v1/costs/") and "format=csv" in path:
            return 200, "gpu_model,gpu_hours,cost\nA100-80GB,12.5,31.25\n", {"Content-Type": "text/csv"}
        if path.startswith("/api/v1/costs/"):
            return 200, {"results": rows, "total": {"cost": "31.25"}}, {}
        return not_found(method, path)

    wz = Wz(home, fake(answer).url, "wz_00000000_t")
    csv = wz("costs", "--group-by", "gpu_model", "--csv")
    assert csv.code == 0 and csv.out == "gpu_model,gpu_hours,cost\nA100-80GB,12.5,31.25\n"
    table = wz("costs", "--group-by", "gpu_model")
    assert table.out.splitlines()[0].split() == ["GPU_MODEL", "GPU_HOURS", "COST", "IDLE_COST", "AVG_GPU_UTILISATION"]
    assert "A100-80GB" in table.out and "total: cost 31.25" in table.out
    assert wz("costs", "--json").json["results"] == rows


def test_server_errors_reads_are_retried_posts_never(fake, home, tmp_path):
    api = fake(lambda m, p: (503, {"detail": "Database busy."}, {"X-Request-ID": "req-42"}))
    wz = Wz(home, api.url, "wz_00000000_t")
    result = wz("ls")
    assert result.code == cli.EXIT_API
    assert result.err.strip() == "whalezen: server error (HTTP 503, request id req-42): Database busy."
    assert [m for m, _, _ in api.requests] == ["GET"] * 3  # one try and two retries
    api.requests.clear()
    spec = tmp_path / "job.yaml"
    spec.write_text("name: a\ncommand: [x]\nresources: {gpus: 1}\n")
    assert wz("submit", str(spec)).code == cli.EXIT_API
    assert wz("cancel", "7").code == cli.EXIT_API
    assert [m for m, _, _ in api.requests] == ["POST", "POST"]  # each sent once


def test_an_html_error_page_is_not_quoted(fake, home):
    page = "<!DOCTYPE html>\n<html><body><h1>Bad Gateway</h1>\n" + "x" * 5000 + "</body></html>"
    api = fake(lambda m, p: (502, page, {"Content-Type": "text/html"}))
    result = Wz(home, api.url, "wz_00000000_t")("show", "1", "--request-timeout", "2")
    assert result.code == cli.EXIT_API and result.err == "whalezen: server error (HTTP 502)\n"


def test_a_redirect_elsewhere_is_not_followed_with_the_token(fake, home):
    elsewhere = fake(lambda m, p: (200, [], {}))
    api = fake(lambda m, p: (302, "", {"Location": elsewhere.url + p, "Content-Type": "text/plain"}))
    result = Wz(home, api.url, "wz_00000000_secret")("ls")
    assert result.code == cli.EXIT_API
    assert result.err.startswith(f"whalezen: HTTP 302: the server redirects to {elsewhere.url}/api/v1/jobs/")
    assert elsewhere.requests == []  # the token never left for another host


def test_a_login_file_readable_by_others_is_warned_about(fake, home):
    import os

    from whalezen import config

    api = fake(lambda m, p: (200, {"count": 0, "next": None, "previous": None, "results": []}, {}))
    path = config.save(api.url, "wz_00000000_t", home)
    wz = Wz(home, None, None)
    assert "warning" not in wz("ls").err
    os.chmod(path, 0o644)
    warned = wz("ls")
    assert warned.code == 0 and f"warning: {path} is readable by other users: chmod 600 {path}" in warned.err


@pytest.mark.parametrize("text, reason", [
    ("name: a\nresources: &r {gpus: 1}\ncopy: *r\n", "line 2, column 12: YAML anchors and aliases are not accepted"),
    ("a:\n" + "".join("  " * i + " b:\n" for i in range(1, 40)), "nested deeper than 32 levels"),
    ("name: a\ncommand: [x\n", "not valid YAML: line 3"),
    ("- name: a\n", "a spec is a mapping of fields"),
    ("name: a\n---\nname: b\n", "more than one YAML document"),
    ("a: !!python/object/apply:os.system [true]\n", "not valid YAML"),
    ('{"a":' * 40 + "1" + "}" * 40, "nested deeper than 32 levels"),
    ('{"name": "a", "priority": NaN}', "numbers must be finite"),
    ("", "it is empty"),
])
def test_specs_the_cli_refuses_before_sending(fake, home, spec_file, text, reason):
    api = fake(not_found)
    wz = Wz(home, api.url, "wz_00000000_t")
    path = spec_file(text)
    for command in ("submit", "quote"):
        result = wz(command, path)
        assert result.code == cli.EXIT_USAGE
        assert one_line(result.err).startswith(f"whalezen: bad spec {path}: ") and reason in result.err
    assert api.requests == []  # refused here, before anything was sent


def test_a_missing_spec_file_is_exit_2(home, tmp_path):
    wz = Wz(home, "http://127.0.0.1:9", "wz_00000000_t")
    result = wz("submit", str(tmp_path / "nope.yaml"))
    assert result.code == cli.EXIT_USAGE and "cannot read it" in one_line(result.err)


def test_usage_errors_are_exit_2(home):
    wz = Wz(home, "http://127.0.0.1:9", "wz_00000000_t")
    assert wz("show", "abc").code == cli.EXIT_USAGE
    assert wz("show", "٣").code == cli.EXIT_USAGE  # ids are ASCII digits
    assert wz("frobnicate").code == cli.EXIT_USAGE
    assert wz().code == cli.EXIT_USAGE
    help_ = wz("--help")
    assert help_.code == 0 and "exit codes:" in help_.out and "WHALEZEN_TOKEN" in help_.out


def test_throttled_and_conflict_messages(fake, home):
    def answer(method, path):
        if method == "POST":
            return 409, {"detail": ["Cannot go from SUCCEEDED to CANCELLED."], "code": "illegal_transition"}, {}
        return 429, {"detail": "Request was throttled."}, {"Retry-After": "12"}

    wz = Wz(home, fake(answer).url, "wz_00000000_t")
    throttled = wz("ls")
    assert throttled.code == cli.EXIT_API and "retry in 12 s" in throttled.err
    conflict = wz("cancel", "3")
    assert conflict.code == cli.EXIT_API
    assert conflict.err.strip() == "whalezen: job 3: Cannot go from SUCCEEDED to CANCELLED."


def test_a_server_that_does_not_answer_times_out_as_unreachable(home):
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections (the kernel does) but never answers
    try:
        wz = Wz(home, f"http://127.0.0.1:{listener.getsockname()[1]}", "wz_00000000_t")
        started = time.monotonic()
        result = wz("show", "1", "--request-timeout", "1")
        assert result.code == cli.EXIT_UNREACHABLE
        assert result.err == "whalezen: http://127.0.0.1:%d did not answer within 1 s\n" % listener.getsockname()[1]
        assert time.monotonic() - started < 2.5  # not asked again: three tries would take 3.9 s
    finally:
        listener.close()


def test_bad_urls_are_usage_errors(home):
    assert Wz(home, "ftp://x", "t")("ls").code == cli.EXIT_USAGE
    assert Wz(home, None, None)("login", "not a url", "--token", "t").code == cli.EXIT_USAGE
    with pytest.raises(ValueError):
        Client("http://127.0.0.1:1", "t").job("1/../../tokens")  # ids never become paths


def test_url_normalisation():
    from whalezen.client import normalise_url

    assert normalise_url("http://h:8000/") == "http://h:8000"
    assert normalise_url("http://h:8000/api/v1/") == "http://h:8000"
    assert normalise_url("https://h/prefix/") == "https://h/prefix"


def test_field_errors_are_flattened():
    body = {"resources": {"gpus": ["Too many."], "limits": {"nvidia.com/gpu": ["Bad."]}},
            "command": {"1": ["Not a string."]}, "env": [{}, {"k": ["Bad key."]}], "name": ["Required."]}
    assert flatten_field_errors(body) == {"resources.gpus": ["Too many."], "resources.limits.nvidia.com/gpu": ["Bad."],
                                          "command.1": ["Not a string."], "env.1.k": ["Bad key."],
                                          "name": ["Required."]}
    assert describe_body({"detail": "Not found."}) == "Not found."
    assert describe_body({"detail": ["Illegal."], "code": "conflict"}) == "Illegal."
    assert describe_body({"body": ["YAML anchors and aliases are not accepted."]}) == \
        "body: YAML anchors and aliases are not accepted."


def test_the_package_imports_nothing_of_the_broker():
    code = ("import sys, whalezen, whalezen.cli, whalezen.client, whalezen.specfile, whalezen.config\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('broker', 'django', 'rest_framework', 'scheduling', 'providers', 'agent'))\n"
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    for path in (REPO / "whalezen").glob("*.py"):
        text = path.read_text()
        assert "import broker" not in text and "from broker" not in text, path


def test_the_console_script_is_installed():
    from .conftest import WHALEZEN

    done = subprocess.run([str(WHALEZEN), "--version"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip().startswith("whalezen ")
    module = subprocess.run([sys.executable, "-m", "whalezen", "--help"], capture_output=True, text=True,
                            timeout=30, cwd="/")
    assert module.returncode == 0 and "exit codes:" in module.stdout

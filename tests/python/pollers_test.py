#!/usr/bin/env python3
"""The cloud preemption pollers against a stub metadata server on 127.0.0.1.

The stub imitates Azure Scheduled Events, AWS IMDSv2 spot instance-action and
GCP instance/preempted, including their required request headers (a request
without them is refused as the real services refuse it: Azure 400, AWS 401,
GCP 403) and the AWS token flow. The pollers run as real subprocesses with a
fake notify command that appends its argv to a file and can be told to fail.
Every wait is on a condition with a deadline (request counts, file contents),
never a fixed sleep. Standard library only; exit code 0 when all pass.
"""
import email.utils
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
POLLERS = os.path.normpath(os.path.join(HERE, "..", "..", "scripts", "pollers"))

AZURE_PATH = "/metadata/scheduledevents"
AZURE_NAME_PATH = "/metadata/instance/compute/name"
AWS_TOKEN_PATH = "/latest/api/token"
AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
GCP_PATH = "/computeMetadata/v1/instance/preempted"
VM_NAME = "vm-self"


def wait_for(condition, timeout=10.0, what="a condition"):
    """Polls `condition` until it returns a true value or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


# --- the stub metadata server ----------------------------------------------------

class StubState:
    """Everything the stub serves and records. `cond` guards it all and is notified on every change."""

    def __init__(self):
        self.cond = threading.Condition()
        self.mode = "ok"            # ok | 500 | garbage | close | hang | noflavor (applies to the poll requests)
        self.azure_events = []
        self.azure_acks = []        # parsed POST bodies
        self.aws_action = None      # dict served by instance-action, or None (404)
        self.aws_tokens = set()
        self.aws_token_puts = 0
        self.gcp_preempted = False
        self.gcp_waiting = 0        # long-poll requests being held right now
        self.accepted = []          # (method, path) of requests that carried the required headers
        self.rejected = []          # (method, path, reason)
        self.released = False       # set at shutdown: held requests end

    def update(self, **changes):
        with self.cond:
            for key, value in changes.items():
                setattr(self, key, value)
            self.cond.notify_all()

    def count(self, path, method="GET"):
        with self.cond:
            return sum(1 for m, p in self.accepted if p == path and m == method)

    def gcp_etag(self):
        return "etag-true" if self.gcp_preempted else "etag-false"


class StubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.dispatch("GET")

    def do_PUT(self):
        self.dispatch("PUT")

    def do_POST(self):
        self.dispatch("POST")

    # --- helpers ---
    @property
    def state(self) -> StubState:
        return self.server.state

    def reply(self, status, body=b"", content_type="text/plain", headers=None):
        if isinstance(body, str):
            body = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def reject(self, method, path, status, reason):
        with self.state.cond:
            self.state.rejected.append((method, path, reason))
        self.reply(status, reason)

    def accept(self, method, path):
        with self.state.cond:
            self.state.accepted.append((method, path))
            self.state.cond.notify_all()

    def failure_mode(self):
        """Applies a failure mode to a poll request. True if it answered (or dropped) the request."""
        mode = self.state.mode
        if mode == "500":
            self.reply(500, "Internal Server Error")
            return True
        if mode == "close":
            self.close_connection = True  # no answer at all: the client sees the connection close
            return True
        if mode == "hang":
            with self.state.cond:
                self.state.cond.wait_for(lambda: self.state.released or self.state.mode != "hang", timeout=10)
            self.close_connection = True
            return True
        return False

    def dispatch(self, method):
        url = urllib.parse.urlsplit(self.path)
        path, query = url.path, urllib.parse.parse_qs(url.query)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if path in (AZURE_PATH, AZURE_NAME_PATH):
            self.azure(method, path, query, body)
        elif path in (AWS_TOKEN_PATH, AWS_ACTION_PATH):
            self.aws(method, path)
        elif path == GCP_PATH:
            self.gcp(method, path, query)
        else:
            self.reply(404, "not found")

    # --- Azure Scheduled Events ---
    def azure(self, method, path, query, body):
        if self.headers.get("Metadata") != "true":
            return self.reject(method, path, 400, '{"error": "Bad request. Required metadata header not specified"}')
        if "api-version" not in query:
            return self.reject(method, path, 400, '{"error": "Bad request. api-version was not specified"}')
        self.accept(method, path)
        if path == AZURE_NAME_PATH:
            return self.reply(200, VM_NAME)
        if method == "POST":
            try:
                document = json.loads(body)
                ids = [item["EventId"] for item in document["StartRequests"]]
            except (ValueError, KeyError, TypeError):
                return self.reply(400, '{"error": "Bad request"}')
            with self.state.cond:
                self.state.azure_acks.append(document)
                self.state.cond.notify_all()
            return self.reply(200, "", headers={"X-Acked": ",".join(ids)})
        if self.failure_mode():
            return None
        if self.state.mode == "garbage":
            return self.reply(200, "<html>this is not the metadata service</html>", "text/html")
        with self.state.cond:
            document = {"DocumentIncarnation": len(self.state.azure_events), "Events": list(self.state.azure_events)}
        return self.reply(200, json.dumps(document), "application/json")

    # --- AWS IMDSv2 ---
    def aws(self, method, path):
        if path == AWS_TOKEN_PATH:
            if method != "PUT":
                return self.reject(method, path, 405, "token must be PUT")
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if not ttl or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self.reject(method, path, 400, "missing or invalid X-aws-ec2-metadata-token-ttl-seconds")
            self.accept(method, path)
            with self.state.cond:
                self.state.aws_token_puts += 1
                token = f"token-{self.state.aws_token_puts}"
                self.state.aws_tokens.add(token)
            return self.reply(200, token, headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl})
        token = self.headers.get("X-aws-ec2-metadata-token")
        with self.state.cond:
            valid = token in self.state.aws_tokens
        if not valid:
            return self.reject(method, path, 401, "Unauthorized")
        self.accept(method, path)
        if self.failure_mode():
            return None
        if self.state.mode == "garbage":
            return self.reply(200, "{this is not json", "text/plain")
        with self.state.cond:
            action = self.state.aws_action
        if action is None:
            return self.reply(404, "<?xml version=\"1.0\"?><html><title>404 - Not Found</title></html>", "text/html")
        return self.reply(200, json.dumps(action), "text/plain")

    # --- GCP metadata server ---
    def gcp(self, method, path, query):
        if self.headers.get("Metadata-Flavor") != "Google":
            return self.reject(method, path, 403, "Missing required header: Metadata-Flavor")
        self.accept(method, path)
        if self.failure_mode():
            return None
        flavor = {"Metadata-Flavor": "Google"}
        if self.state.mode == "garbage":
            return self.reply(200, "MAYBE", headers=dict(flavor, ETag="etag-garbage"))
        if self.state.mode == "noflavor":
            return self.reply(200, "FALSE")
        st = self.state
        with st.cond:
            if query.get("wait_for_change") == ["true"]:
                last = query.get("last_etag", [""])[0]
                timeout = min(float(query.get("timeout_sec", ["30"])[0]), 30.0)
                st.gcp_waiting += 1
                st.cond.notify_all()
                st.cond.wait_for(lambda: st.gcp_etag() != last or st.released, timeout=timeout)
                st.gcp_waiting -= 1
            value, etag = ("TRUE" if st.gcp_preempted else "FALSE"), st.gcp_etag()
        return self.reply(200, value, "application/text", headers=dict(flavor, ETag=etag))


class QuietHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A poller that timed out or was stopped hangs up on a held request: not an error of the stub.
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class StubServer:
    def __init__(self):
        self.state = StubState()
        self.port = 0
        self.httpd = None
        self.start()

    def start(self):
        with self.state.cond:
            self.state.released = False
        self.httpd = QuietHTTPServer(("127.0.0.1", self.port), StubHandler)
        self.httpd.state = self.state
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self):
        self.state.update(released=True)
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


# --- the pollers under test ------------------------------------------------------

FAKE_NOTIFY = """#!{python}
# Fake notify_manager_preempt: appends its arguments to FAKE_NOTIFY_LOG; fails
# the first FAKE_NOTIFY_FAIL_FIRST calls.
import json, os, sys
log = os.environ["FAKE_NOTIFY_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
with open(log) as f:
    calls = sum(1 for _ in f)
if calls <= int(os.environ.get("FAKE_NOTIFY_FAIL_FIRST", "0")):
    print("cannot reach the manager (fake failure)", file=sys.stderr)
    sys.exit(1)
print("manager acknowledged (fake)")
"""

CLOUDS = {
    "azure": {"script": "azure_scheduled_events.py", "poll": ("GET", AZURE_PATH)},
    "aws": {"script": "aws_spot_interruption.py", "poll": ("GET", AWS_ACTION_PATH)},
    "gcp": {"script": "gcp_preemption.py", "poll": ("GET", GCP_PATH)},
}


def azure_event(event_id="A1B2", deadline_s=None, event_type="Preempt", resources=(VM_NAME,), status="Scheduled"):
    return {"EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": list(resources), "EventStatus": status,
            "NotBefore": email.utils.formatdate(deadline_s, usegmt=True) if deadline_s else "",
            "Description": "Spot eviction", "EventSource": "Platform", "DurationInSeconds": -1}


class PollerProcess:
    def __init__(self, test, args, env=None):
        self.stderr_path = os.path.join(test.tmp, f"poller-{len(test.processes)}.err")
        full_env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", FAKE_NOTIFY_LOG=test.notify_log)
        full_env.update(env or {})
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable] + args, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err, env=full_env)
        test.processes.append(self)

    def stderr(self):
        with open(self.stderr_path) as f:
            return f.read()

    def alive(self):
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout=5.0):
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)


class PollerTestBase(unittest.TestCase):
    cloud = None

    def setUp(self):
        self.started = time.monotonic()
        self.tmp_holder = tempfile.TemporaryDirectory(prefix="varuna-pollers-")
        self.tmp = self.tmp_holder.name
        self.processes = []
        self.stub = StubServer()
        self.notify_log = os.path.join(self.tmp, "notify.log")
        self.notify_cmd = os.path.join(self.tmp, "fake_notify")
        with open(self.notify_cmd, "w") as f:
            f.write(FAKE_NOTIFY.format(python=sys.executable))
        os.chmod(self.notify_cmd, 0o755)
        self.connection_file = os.path.join(self.tmp, "run", "job", "10.0.0.5", "connection.json")
        self.write_connection_file(self.connection_file)

    def tearDown(self):
        for p in self.processes:
            if p.alive():
                p.proc.kill()
                p.proc.wait()
        self.stub.stop()
        self.tmp_holder.cleanup()
        print(f"  {self.id().split('.', 1)[1]}: {time.monotonic() - self.started:.2f} s", file=sys.stderr)

    # --- helpers ---
    @staticmethod
    def write_connection_file(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"manager": "127.0.0.1:1", "token": "t0ken", "host": "10.0.0.5", "job": "job"}, f)

    def script(self, cloud=None):
        return os.path.join(POLLERS, CLOUDS[cloud or self.cloud]["script"])

    def poller_args(self, *extra, cloud=None, connection_file=True):
        args = [self.script(cloud), "--endpoint", self.stub.url, "--interval", "0.05", "--timeout", "1",
                "--notify_cmd", self.notify_cmd, "--notify_backoff", "0.05", "--log_level", "debug"]
        if connection_file:
            args += ["--connection_file", self.connection_file]
        return args + list(extra)

    def start(self, *extra, env=None, connection_file=True):
        return PollerProcess(self, self.poller_args(*extra, connection_file=connection_file), env)

    def run_once(self, *extra, env=None):
        p = PollerProcess(self, self.poller_args("--once", *extra), env)
        return p.proc.wait(15), p

    def calls(self):
        if not os.path.exists(self.notify_log):
            return []
        with open(self.notify_log) as f:
            return [json.loads(line) for line in f if line.strip()]

    def polls(self):
        return self.stub.state.count(CLOUDS[self.cloud]["poll"][1], CLOUDS[self.cloud]["poll"][0])

    def wait_polls(self, more, process=None, timeout=10.0):
        target = self.polls() + more
        wait_for(lambda: self.polls() >= target or (process is not None and not process.alive()),
                 timeout, f"{more} more polls")
        if process is not None:
            self.assertTrue(process.alive(), "the poller exited:\n" + process.stderr())

    def wait_calls(self, n, timeout=10.0):
        return wait_for(lambda: len(self.calls()) >= n and self.calls(), timeout, f"{n} notify calls")

    def assert_no_rejections(self):
        self.assertEqual(self.stub.state.rejected, [], "the poller sent requests the real service refuses")

    # --- per cloud: what an event looks like ---
    def set_event(self, deadline_s):
        """Makes an event appear; returns the deadline the notify must carry (None: checked by the caller)."""
        if self.cloud == "azure":
            self.stub.state.update(azure_events=[azure_event(deadline_s=deadline_s)])
            return deadline_s * 1000
        if self.cloud == "aws":
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(deadline_s))
            self.stub.state.update(aws_action={"action": "terminate", "time": stamp})
            return deadline_s * 1000
        self.stub.state.update(gcp_preempted=True)
        return None

    def clear_event(self):
        self.stub.state.update(azure_events=[], aws_action=None, gcp_preempted=False)

    def check_call(self, call, expected_ms, detected_between=None):
        self.assertEqual(call[:2], ["--connection_file", self.connection_file])
        self.assertEqual(call[2], "--deadline_unix_ms")
        self.assertEqual(len(call), 4, call)
        if expected_ms is not None:
            self.assertEqual(int(call[3]), expected_ms)
        else:  # GCP: detection + 30 s
            low, high = detected_between
            self.assertTrue(low + 30000 <= int(call[3]) <= high + 30000,
                            f"deadline {call[3]} not within 30 s of detection [{low}, {high}]")


class CommonCases:
    """Behaviour every poller shares; mixed into one TestCase per cloud."""

    def test_executable_with_shebang(self):
        path = self.script()
        self.assertTrue(os.access(path, os.X_OK), f"{path} is not executable")
        with open(path) as f:
            self.assertEqual(f.readline().strip(), "#!/usr/bin/env python3")

    def test_once_without_event_does_not_notify(self):
        rc, p = self.run_once()
        self.assertEqual(rc, 0, p.stderr())
        self.assertEqual(self.calls(), [])
        self.assertGreaterEqual(self.polls(), 1)
        self.assert_no_rejections()

    def test_once_with_event_notifies(self):
        expected = self.set_event(int(time.time()) + 120)
        low = int(time.time() * 1000)
        rc, p = self.run_once()
        high = int(time.time() * 1000)
        self.assertEqual(rc, 0, p.stderr())
        calls = self.calls()
        self.assertEqual(len(calls), 1, calls)
        self.check_call(calls[0], expected, (low, high))

    def test_once_metadata_error_exits_1(self):
        self.stub.state.update(mode="500")
        rc, p = self.run_once()
        self.assertEqual(rc, 1, p.stderr())
        self.assertIn("HTTP 500", p.stderr())
        self.assertEqual(self.calls(), [])

    def test_event_notified_exactly_once(self):
        p = self.start()
        self.wait_polls(3, p)
        self.assertEqual(self.calls(), [])
        low = int(time.time() * 1000)
        expected = self.set_event(int(time.time()) + 90)
        calls = self.wait_calls(1)
        high = int(time.time() * 1000)
        self.check_call(calls[0], expected, (low, high))
        self.wait_polls(6, p)  # the event persists across polls: no second notify
        self.assertEqual(len(self.calls()), 1, self.calls())
        self.assertIn("PREEMPTION", p.stderr())
        self.assertEqual(p.stop(), 0)
        self.assertIn("stopping on SIGTERM", p.stderr())
        self.assertNotIn("Traceback", p.stderr())
        self.assert_no_rejections()

    def test_endpoint_failures_warn_and_recover(self):
        self.stub.state.update(mode="500")
        p = self.start("--timeout", "0.3")
        self.wait_polls(10, p)
        err = p.stderr()
        self.assertIn("WARNING", err)
        self.assertEqual(err.count("HTTP 500"), 1, "repeated failures must be rate-limited:\n" + err)
        for mode, marker in (("garbage", "malformed" if self.cloud != "gcp" else "expected TRUE or FALSE"),
                             ("close", "RemoteDisconnected"), ("hang", "no answer within")):
            if self.cloud == "azure" and mode == "garbage":
                marker = "not JSON"
            if self.cloud == "aws" and mode == "garbage":
                marker = "expected {"
            self.stub.state.update(mode=mode)
            wait_for(lambda: marker in p.stderr(), 10, f"a warning containing {marker!r} ({mode})")
            self.assertTrue(p.alive(), p.stderr())
        # The service goes away entirely, then comes back on the same port.
        self.stub.stop()
        self.stub.state.update(mode="ok")
        wait_for(lambda: "refused" in p.stderr(), 10, "a connection-refused warning")
        self.assertTrue(p.alive(), p.stderr())
        self.stub.start()
        wait_for(lambda: "answers again" in p.stderr(), 10, "recovery")
        self.assertEqual(self.calls(), [])
        expected = self.set_event(int(time.time()) + 60)
        low = int(time.time() * 1000)
        calls = self.wait_calls(1)
        self.check_call(calls[0], expected, (low - 1000, int(time.time() * 1000)))
        self.wait_polls(5, p)
        self.assertEqual(len(self.calls()), 1)
        self.assertEqual(p.stop(), 0)
        self.assertNotIn("Traceback", p.stderr())

    def test_failing_notify_is_retried_then_not_repeated(self):
        expected = self.set_event(int(time.time()) + 100)
        low = int(time.time() * 1000)
        p = self.start(env={"FAKE_NOTIFY_FAIL_FIRST": "2"})
        calls = self.wait_calls(3)
        self.assertIn("notify attempt 1/5", p.stderr())
        self.assertEqual(calls[0], calls[1])
        self.assertEqual(calls[1], calls[2])
        self.check_call(calls[2], expected, (low, int(time.time() * 1000)))
        wait_for(lambda: "manager notified" in p.stderr(), 5, "the success log line")
        self.wait_polls(5, p)
        self.assertEqual(len(self.calls()), 3)
        self.assertEqual(p.stop(signal.SIGINT), 0)
        self.assertIn("stopping on SIGINT", p.stderr())


class AzureTest(CommonCases, PollerTestBase):
    cloud = "azure"

    def test_stub_refuses_requests_without_headers(self):
        for path in (AZURE_PATH + "?api-version=2020-07-01", AZURE_PATH):
            with self.assertRaises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(self.stub.url + path, timeout=5)
            self.assertEqual(e.exception.code, 400)

    def test_ack_posts_start_request_with_event_id(self):
        deadline = int(time.time()) + 45
        self.stub.state.update(azure_events=[azure_event("Evt-42", deadline)])
        p = self.start("--ack")
        wait_for(lambda: self.stub.state.azure_acks, 10, "the StartRequests POST")
        self.assertEqual(self.stub.state.azure_acks, [{"StartRequests": [{"EventId": "Evt-42"}]}])
        self.assertEqual(len(self.calls()), 1)
        self.wait_polls(5, p)
        self.assertEqual(len(self.stub.state.azure_acks), 1, "acknowledged more than once")
        self.assertIn("acknowledged", p.stderr())
        self.assert_no_rejections()

    def test_no_ack_without_flag(self):
        self.stub.state.update(azure_events=[azure_event("Evt-1", int(time.time()) + 45)])
        p = self.start()
        self.wait_calls(1)
        self.wait_polls(5, p)
        self.assertEqual(self.stub.state.azure_acks, [])

    def test_ack_only_after_successful_notify(self):
        self.stub.state.update(azure_events=[azure_event("Evt-2", int(time.time()) + 45)])
        p = self.start("--ack", "--notify_retries", "1", env={"FAKE_NOTIFY_FAIL_FIRST": "99"})
        wait_for(lambda: "giving up" in p.stderr(), 10, "the give-up log line")
        self.wait_polls(5, p)
        self.assertEqual(len(self.calls()), 2)
        self.assertEqual(self.stub.state.azure_acks, [])

    def test_other_events_and_other_vms_are_ignored(self):
        soon = int(time.time()) + 60
        self.stub.state.update(azure_events=[azure_event("R1", soon, event_type="Reboot"),
                                             azure_event("F1", soon, event_type="Freeze"),
                                             azure_event("P-other", soon, resources=["vm-other"])])
        p = self.start()
        self.wait_polls(5, p)
        self.assertEqual(self.calls(), [])
        self.assertEqual(self.stub.state.count(AZURE_NAME_PATH), 1, "the VM name is asked once")
        self.assertEqual(p.stderr().count("ignoring Preempt event P-other"), 1)
        # Ours appears next to them, then starts (NotBefore becomes blank): still one notify.
        events = self.stub.state.azure_events + [azure_event("P-ours", soon)]
        self.stub.state.update(azure_events=events)
        calls = self.wait_calls(1)
        self.check_call(calls[0], soon * 1000)
        self.stub.state.update(azure_events=events[:-1] + [azure_event("P-ours", None, status="Started")])
        self.wait_polls(5, p)
        self.assertEqual(len(self.calls()), 1)
        # A second, different eviction event is a new event.
        self.stub.state.update(azure_events=[azure_event("P-next", None, resources=[])])
        calls = self.wait_calls(2)
        self.assertEqual(calls[1], ["--connection_file", self.connection_file], "blank NotBefore: no deadline")
        self.assert_no_rejections()

    def test_connection_files_discovered_under_run_root(self):
        run_root = os.path.join(self.tmp, "varuna")
        files = [os.path.join(run_root, "jobA", "10.0.0.5", "connection.json"),
                 os.path.join(run_root, "jobB", "10.0.0.5", "connection.json")]
        for f in files:
            self.write_connection_file(f)
        deadline = int(time.time()) + 30
        self.stub.state.update(azure_events=[azure_event("D1", deadline)])
        p = self.start("--run_root", run_root, connection_file=False)
        calls = self.wait_calls(2)
        self.assertEqual(sorted(c[1] for c in calls), sorted(files))
        self.wait_polls(5, p)
        self.assertEqual(len(self.calls()), 2)

    def test_planted_connection_files_are_ignored(self):
        """Only an agent's own file is acted on: not one owned by another user
        than its folder, a link, or one in a folder others can write to."""
        run_root = os.path.join(self.tmp, "varuna")
        own = os.path.join(run_root, "jobA", "10.0.0.5", "connection.json")
        self.write_connection_file(own)
        foreign = os.path.join(run_root, "jobB", "10.0.0.5", "connection.json")
        self.write_connection_file(foreign)
        os.chown(foreign, 65534, 65534)  # nobody's file in root's folder (the tests run as root)
        linked = os.path.join(run_root, "jobC", "10.0.0.5", "connection.json")
        os.makedirs(os.path.dirname(linked))
        os.symlink(own, linked)
        open_folder = os.path.join(run_root, "jobD", "10.0.0.5", "connection.json")
        self.write_connection_file(open_folder)
        os.chmod(os.path.dirname(open_folder), 0o777)
        self.stub.state.update(azure_events=[azure_event("PL1", int(time.time()) + 30)])
        p = self.start("--run_root", run_root, connection_file=False)
        calls = self.wait_calls(1)
        self.wait_polls(5, p)
        self.assertEqual([c[1] for c in self.calls()], [own])
        self.assertEqual(len(calls), 1)

    def test_no_connection_file_gives_up_after_retries(self):
        self.stub.state.update(azure_events=[azure_event("N1", int(time.time()) + 30)])
        p = PollerProcess(self, self.poller_args("--once", "--run_root", os.path.join(self.tmp, "empty"),
                                                 "--notify_retries", "2", connection_file=False))
        self.assertEqual(p.proc.wait(15), 3, p.stderr())
        self.assertEqual(p.stderr().count("notify attempt"), 3, p.stderr())
        self.assertIn("is a varuna agent running on this host?", p.stderr())
        self.assertIn("giving up", p.stderr())
        self.assertEqual(self.calls(), [])

    def test_failing_notify_gives_up_and_keeps_polling(self):
        self.stub.state.update(azure_events=[azure_event("G1", int(time.time()) + 30)])
        p = self.start("--notify_retries", "2", env={"FAKE_NOTIFY_FAIL_FIRST": "99"})
        wait_for(lambda: "giving up" in p.stderr(), 10, "the give-up log line")
        self.assertEqual(len(self.calls()), 3)
        self.wait_polls(5, p)
        self.assertEqual(len(self.calls()), 3, "an event given up on must not be notified again")
        rc, q = self.run_once("--notify_retries", "1", env={"FAKE_NOTIFY_FAIL_FIRST": "99"})
        self.assertEqual(rc, 3, q.stderr())

    def test_missing_notify_command_is_a_retried_failure(self):
        self.stub.state.update(azure_events=[azure_event("M1", int(time.time()) + 30)])
        args = self.poller_args("--once", "--notify_retries", "1")
        args[args.index("--notify_cmd") + 1] = os.path.join(self.tmp, "does-not-exist")
        p = PollerProcess(self, args)
        self.assertEqual(p.proc.wait(15), 3, p.stderr())
        self.assertIn("cannot run", p.stderr())
        self.assertNotIn("Traceback", p.stderr())


class AwsTest(CommonCases, PollerTestBase):
    cloud = "aws"

    def test_stub_refuses_requests_without_token(self):
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(self.stub.url + AWS_ACTION_PATH, timeout=5)
        self.assertEqual(e.exception.code, 401)
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(self.stub.url + AWS_TOKEN_PATH, method="PUT"), timeout=5)
        self.assertEqual(e.exception.code, 400)

    def test_token_reused_and_renewed_after_401(self):
        p = self.start()
        self.wait_polls(5, p)
        self.assertEqual(self.stub.state.aws_token_puts, 1, "the token must be reused between polls")
        self.stub.state.update(aws_tokens=set())  # the service forgets every token (as after a restart)
        wait_for(lambda: self.stub.state.aws_token_puts >= 2, 10, "a new token")
        self.wait_polls(3, p)
        self.assertEqual(self.stub.state.aws_token_puts, 2)
        self.assertNotIn("WARNING", p.stderr(), "a 401 is handled by renewing the token, silently")
        # IMDSv2 only: the one refused request is the GET with the forgotten token.
        self.assertEqual([r[:2] for r in self.stub.state.rejected], [("GET", AWS_ACTION_PATH)])
        expected = self.set_event(int(time.time()) + 120)
        calls = self.wait_calls(1)
        self.check_call(calls[0], expected)

    def test_stop_and_hibernate_actions_notify(self):
        when = int(time.time()) + 120
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(when))
        self.stub.state.update(aws_action={"action": "hibernate", "time": stamp})
        p = self.start()
        calls = self.wait_calls(1)
        self.check_call(calls[0], when * 1000)
        self.wait_polls(3, p)
        # A new notice (another time) is a new event.
        self.stub.state.update(aws_action={"action": "stop", "time": stamp.replace(".000Z", ".500Z")})
        calls = self.wait_calls(2)
        self.check_call(calls[1], when * 1000 + 500)


class GcpTest(CommonCases, PollerTestBase):
    cloud = "gcp"

    def test_stub_refuses_requests_without_flavor_header(self):
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(self.stub.url + GCP_PATH, timeout=5)
        self.assertEqual(e.exception.code, 403)

    def test_answer_without_flavor_header_is_refused(self):
        self.stub.state.update(mode="noflavor")
        p = self.start()
        wait_for(lambda: "lacks 'Metadata-Flavor: Google'" in p.stderr(), 10, "the warning")
        self.stub.state.update(mode="ok")
        wait_for(lambda: "answers again" in p.stderr(), 10, "recovery")

    def test_wait_for_change_long_poll(self):
        # --interval 2: a notify within 1.5 s of the change can only come from the held request.
        p = self.start("--wait_for_change", "--wait_timeout_s", "20", "--interval", "2")
        wait_for(lambda: self.stub.state.gcp_waiting == 1, 10, "a held long-poll request")
        low = int(time.time() * 1000)
        changed = time.monotonic()
        self.set_event(None)
        calls = self.wait_calls(1, timeout=1.5)
        self.assertLess(time.monotonic() - changed, 1.5)
        self.check_call(calls[0], None, (low, int(time.time() * 1000)))
        # The next long poll is held on the new ETag; SIGTERM ends it promptly.
        wait_for(lambda: self.stub.state.gcp_waiting == 1, 10, "the next held request")
        stopping = time.monotonic()
        self.assertEqual(p.stop(), 0)
        self.assertLess(time.monotonic() - stopping, 2.0)
        self.assertEqual(len(self.calls()), 1)
        self.assert_no_rejections()


if __name__ == "__main__":
    started = time.monotonic()
    program = unittest.main(exit=False, verbosity=1)
    print(f"pollers_test: {time.monotonic() - started:.1f} s", file=sys.stderr)
    sys.exit(0 if program.result.wasSuccessful() else 1)

"""Shared machinery of the cloud preemption pollers (Python 3 standard library only).

A poller runs on every worker VM. It polls its cloud's instance metadata
service; when the VM is about to be taken it runs `notify_manager_preempt`
once per event (and per job on the host), so the manager can checkpoint the
job and morph it onto the remaining machines before the VM disappears.

Each cloud module defines a `Cloud` (how to ask the metadata service, what an
event is) and calls `main(cloud)`. Everything else lives here: options, the
HTTP client, the poll loop, de-duplication, notify retries, rate-limited
warnings and signal handling.

Threading: one thread. SIGTERM/SIGINT only set a flag, except while the loop
is blocked in an HTTP request or a sleep, where they also interrupt it, so the
poller exits within moments; a running notify command is never interrupted.

Exit codes: 0 stopped by a signal, or (--once) polled successfully and
notified any event; 1 (--once) the metadata service did not answer usefully;
2 usage error; 3 (--once) the notify command failed on every attempt.
"""
import argparse
import contextlib
import dataclasses
import glob
import http.client
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

EXIT_OK = 0
EXIT_METADATA_ERROR = 1
EXIT_USAGE = 2
EXIT_NOTIFY_FAILED = 3

DEFAULT_ENDPOINT = "http://169.254.169.254"
DEFAULT_RUN_ROOT = "/tmp/varuna"
MAX_BACKOFF_S = 10.0


class MetadataError(Exception):
    """The metadata service was unreachable, timed out or answered something unreadable.

    `kind` groups similar failures for rate-limited logging ("HTTP 500",
    "timeout", "malformed", ...).
    """

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclasses.dataclass
class PreemptEvent:
    key: str                          # identity: the same event seen on later polls has the same key
    deadline_unix_ms: Optional[int]   # when the VM may be taken; None if the cloud did not say
    description: str                  # for the log
    ack_id: Optional[str] = None      # what to acknowledge (Azure EventId), if the cloud supports it


@dataclasses.dataclass
class HttpResponse:
    status: int
    headers: Dict[str, str]
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class _Stop(BaseException):
    """Raised by the signal handler to abort a blocking request or sleep."""


class MetadataClient:
    """Plain HTTP to the link-local metadata service.

    Proxies are bypassed on purpose: an http_proxy in the environment must
    never see metadata requests (nor could it reach a link-local address).
    """

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, method: str, path: str, headers: Optional[Dict[str, str]] = None,
                body: Optional[bytes] = None, timeout_s: Optional[float] = None) -> HttpResponse:
        """Any HTTP status comes back as a response; no answer at all raises MetadataError."""
        url = self.base_url + path
        req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
        try:
            with self._opener.open(req, timeout=timeout_s or self.timeout_s) as resp:
                return HttpResponse(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
        except urllib.error.HTTPError as e:
            try:
                data = e.read()
            except (OSError, http.client.HTTPException):
                data = b""
            return HttpResponse(e.code, {k.lower(): v for k, v in (e.headers or {}).items()}, data)
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise MetadataError("timeout", f"{method} {url}: no answer within {timeout_s or self.timeout_s:g} s")
            kind = "refused" if isinstance(reason, ConnectionRefusedError) else "unreachable"
            raise MetadataError(kind, f"{method} {url}: {reason}")
        except (socket.timeout, TimeoutError):
            raise MetadataError("timeout", f"{method} {url}: no answer within {timeout_s or self.timeout_s:g} s")
        except (http.client.HTTPException, OSError, ValueError) as e:
            # RemoteDisconnected, BadStatusLine, ConnectionResetError, a bad URL...
            raise MetadataError("broken", f"{method} {url}: {type(e).__name__}: {e}")


class Cloud:
    """One cloud's metadata protocol. Subclasses override the methods below."""

    name = "cloud"
    default_interval_s = 1.0

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def configure(self, args: argparse.Namespace, client: MetadataClient, log: logging.Logger) -> None:
        self.args = args
        self.client = client
        self.log = log

    def poll(self) -> List[PreemptEvent]:
        """The preemption events pending for this VM. Raises MetadataError."""
        raise NotImplementedError

    def poll_again_now(self) -> bool:
        """True to skip the interval once (a long poll just saw a change: hold the next one at once)."""
        return False

    def supports_ack(self) -> bool:
        return False

    def acknowledge(self, event: PreemptEvent) -> None:
        """Tells the cloud it may proceed. Raises MetadataError."""
        raise NotImplementedError


def http_error(response: HttpResponse, what: str) -> MetadataError:
    snippet = response.text().strip().replace("\n", " ")[:200]
    return MetadataError(f"HTTP {response.status}", f"{what}: HTTP {response.status} {snippet!r}")


class WarningLimiter:
    """Logs the first failure of a kind, then at most one line per `every_s` while it repeats."""

    def __init__(self, log: logging.Logger, every_s: float, suffix: str):
        self._log = log
        self._suffix = suffix
        self._every_s = every_s
        self._failures = 0
        self._last_kind: Optional[str] = None
        self._last_logged = 0.0
        self._suppressed = 0

    def failure(self, error: MetadataError) -> None:
        self._failures += 1
        now = time.monotonic()
        if error.kind != self._last_kind or now - self._last_logged >= self._every_s:
            extra = f" ({self._suppressed} similar warnings suppressed)" if self._suppressed else ""
            self._log.warning("metadata service: %s%s%s", error, self._suffix, extra)
            self._last_kind = error.kind
            self._last_logged = now
            self._suppressed = 0
        else:
            self._suppressed += 1

    def success(self) -> None:
        if self._failures:
            self._log.info("metadata service answers again after %d failed polls", self._failures)
        self._failures = 0
        self._last_kind = None
        self._suppressed = 0


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def int_in_range(low: int, high: int):
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low}..{high}, got {text}")
        return value
    return parse


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser(cloud: Cloud, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=DEFAULT_ENDPOINT,
                        help=f"base URL of the metadata service (default {DEFAULT_ENDPOINT})")
    parser.add_argument("--interval", type=positive_float, default=cloud.default_interval_s,
                        help=f"seconds between polls, start to start (default {cloud.default_interval_s:g})")
    parser.add_argument("--timeout", type=positive_float, default=5.0,
                        help="seconds to wait for one metadata answer (default 5)")
    parser.add_argument("--notify_cmd", default="notify_manager_preempt",
                        help="the command that tells the manager (default: notify_manager_preempt on PATH)")
    parser.add_argument("--connection_file", action="append", default=[],
                        help="an agent's connection.json, passed through to the notify command; may repeat. "
                             "Default: every <run_root>/<job>/<host>/connection.json present at notify time")
    parser.add_argument("--run_root", default=DEFAULT_RUN_ROOT,
                        help=f"where agents keep their run folders (default {DEFAULT_RUN_ROOT})")
    parser.add_argument("--notify_retries", type=non_negative_int, default=4,
                        help="retries of a failed notify, with doubling backoff (default 4)")
    parser.add_argument("--notify_backoff", type=positive_float, default=1.0,
                        help="seconds before the first retry (default 1; doubles, at most 10)")
    parser.add_argument("--notify_timeout", type=positive_float, default=30.0,
                        help="seconds one notify command may take (default 30)")
    parser.add_argument("--warn_every", type=float, default=60.0,
                        help="repeat a persisting metadata warning at most this often, in seconds (default 60)")
    parser.add_argument("--once", action="store_true",
                        help="poll once, notify any event, exit (0 ok, 1 metadata error, 3 notify failed)")
    parser.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error"])
    cloud.add_arguments(parser)
    return parser


class Poller:
    def __init__(self, cloud: Cloud, args: argparse.Namespace, log: logging.Logger):
        self.cloud = cloud
        self.args = args
        self.log = log
        self.warnings = WarningLimiter(log, args.warn_every, "" if args.once else "; polling on")
        self.handled: set = set()                       # event keys already notified (or given up on)
        self.pending_acks: Dict[str, List] = {}         # key -> [event, attempts left]
        self.stopping: Optional[int] = None
        self._interruptible = False

    # --- signals ---------------------------------------------------------------
    def _on_signal(self, signum, frame):
        self.stopping = signum
        if self._interruptible:
            raise _Stop()

    @contextlib.contextmanager
    def interruptible(self):
        self._interruptible = True
        try:
            if self.stopping is not None:
                raise _Stop()
            yield
        finally:
            self._interruptible = False

    def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        with self.interruptible():
            time.sleep(seconds)

    # --- notify ----------------------------------------------------------------
    def connection_files(self) -> List[str]:
        if self.args.connection_file:
            return list(self.args.connection_file)
        found = glob.glob(os.path.join(glob.escape(self.args.run_root), "*", "*", "connection.json"))
        return sorted(f for f in found if self._trusted(f))

    def _trusted(self, connection_file: str) -> bool:
        """A discovered connection file is acted on only if it is a regular
        file (not a link) owned by the owner of its folder, which is a real
        folder writable by its owner only: the agent's own (varuna_agent
        makes them so). A file another user planted in a shared run root is
        skipped, with a warning."""
        folder = os.path.dirname(connection_file)
        try:
            st_file, st_folder = os.lstat(connection_file), os.lstat(folder)
        except OSError:
            return False
        why = None
        if not stat.S_ISREG(st_file.st_mode):
            why = "not a regular file"
        elif not stat.S_ISDIR(st_folder.st_mode):
            why = "its folder is not a real folder"
        elif st_file.st_uid != st_folder.st_uid:
            why = f"owned by uid {st_file.st_uid}, its folder by uid {st_folder.st_uid}"
        elif st_folder.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            why = f"its folder is writable by others (mode {stat.S_IMODE(st_folder.st_mode):04o})"
        if why:
            self.log.warning("ignoring %s: %s (not an agent's own file)", connection_file, why)
        return why is None

    def _run_notify(self, connection_file: str, event: PreemptEvent, attempt: int, attempts: int) -> bool:
        cmd = [self.args.notify_cmd, "--connection_file", connection_file]
        if event.deadline_unix_ms is not None:
            cmd += ["--deadline_unix_ms", str(event.deadline_unix_ms)]
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  timeout=self.args.notify_timeout)
        except subprocess.TimeoutExpired:
            outcome = f"no answer within {self.args.notify_timeout:g} s"
        except OSError as e:
            outcome = f"cannot run {self.args.notify_cmd!r}: {e}"
        else:
            output = proc.stdout.decode("utf-8", errors="replace").strip()
            if proc.returncode == 0:
                self.log.info("manager notified via %s%s", connection_file, f": {output}" if output else "")
                return True
            outcome = f"exit code {proc.returncode}" + (f": {output[-500:]}" if output else "")
        self.log.warning("notify attempt %d/%d for %s failed (%s)", attempt, attempts, connection_file, outcome)
        return False

    def notify(self, event: PreemptEvent) -> bool:
        """Runs the notify command for every connection file, retrying failures. True if all succeeded."""
        attempts = self.args.notify_retries + 1
        done: set = set()
        delay = self.args.notify_backoff
        files: List[str] = []
        for attempt in range(1, attempts + 1):
            files = self.connection_files()
            if not files:
                self.log.warning("notify attempt %d/%d: no connection file (looked for %s); is a varuna agent "
                                 "running on this host?", attempt, attempts,
                                 os.path.join(self.args.run_root, "*", "*", "connection.json"))
            for f in files:
                if f not in done and self._run_notify(f, event, attempt, attempts):
                    done.add(f)
            if files and all(f in done for f in files):
                return True
            if attempt < attempts:
                self.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
        self.log.error("giving up notifying the manager of %s after %d attempts (%s); the manager will see the "
                       "host disappear instead", event.description, attempts,
                       ", ".join(f for f in files if f not in done) or "no connection file")
        return False

    # --- events ----------------------------------------------------------------
    def _try_ack(self, key: str) -> None:
        event, left = self.pending_acks[key]
        try:
            with self.interruptible():
                self.cloud.acknowledge(event)
        except MetadataError as e:
            left -= 1
            if left > 0:
                self.log.warning("acknowledging %s failed (%s); retrying on the next poll", event.description, e)
                self.pending_acks[key] = [event, left]
            else:
                self.log.error("acknowledging %s failed (%s); giving up", event.description, e)
                del self.pending_acks[key]
            return
        self.log.info("acknowledged %s: the cloud may now proceed", event.description)
        del self.pending_acks[key]

    def handle(self, event: PreemptEvent) -> bool:
        if event.key in self.handled:
            if event.key in self.pending_acks:
                self._try_ack(event.key)
            return True
        self.handled.add(event.key)
        if event.deadline_unix_ms is not None:
            left_s = event.deadline_unix_ms / 1000.0 - time.time()
            when = (f"deadline {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(event.deadline_unix_ms / 1000))} "
                    f"(in {left_s:.1f} s), deadline_unix_ms {event.deadline_unix_ms}")
        else:
            when = "deadline unknown"
        self.log.warning("PREEMPTION: %s; %s; notifying the manager", event.description, when)
        ok = self.notify(event)
        if ok and self.args.ack and self.cloud.supports_ack() and event.ack_id:
            self.pending_acks[event.key] = [event, self.args.notify_retries + 1]
            self._try_ack(event.key)
        return ok

    # --- loop ------------------------------------------------------------------
    def poll_once(self) -> int:
        try:
            with self.interruptible():
                events = self.cloud.poll()
        except MetadataError as e:
            self.warnings.failure(e)
            return EXIT_METADATA_ERROR
        except Exception as e:  # a response no check above foresaw: keep polling rather than die
            self.log.debug("unexpected error while polling", exc_info=True)
            self.warnings.failure(MetadataError("unexpected", f"unexpected {type(e).__name__}: {e}"))
            return EXIT_METADATA_ERROR
        self.warnings.success()
        status = EXIT_OK
        for event in events:
            if not self.handle(event):
                status = EXIT_NOTIFY_FAILED
        return status

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.log.info("polling %s every %g s%s", self.args.endpoint, self.args.interval,
                      " (once)" if self.args.once else "")
        try:
            while self.stopping is None:
                started = time.monotonic()
                status = self.poll_once()
                if self.args.once:
                    return status
                if not self.cloud.poll_again_now():
                    self.sleep(self.args.interval - (time.monotonic() - started))
        except _Stop:
            pass
        name = signal.Signals(self.stopping).name if self.stopping is not None else "signal"
        self.log.info("stopping on %s", name)
        return EXIT_OK


def main(cloud: Cloud, description: str, argv: Optional[List[str]] = None) -> int:
    parser = build_parser(cloud, description)
    args = parser.parse_args(argv)
    if not hasattr(args, "ack"):
        args.ack = False
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [varuna-poller {cloud.name}] %(message)s")
    log = logging.getLogger(f"varuna.poller.{cloud.name}")
    client = MetadataClient(args.endpoint, args.timeout)
    cloud.configure(args, client, log)
    return Poller(cloud, args, log).run()

#!/usr/bin/env python3
"""GCP preemption poller: tells the varuna manager when this Spot/preemptible VM is being preempted.

Polls the Compute Engine metadata server,
    GET <endpoint>/computeMetadata/v1/instance/preempted      header Metadata-Flavor: Google
which answers "FALSE", and "TRUE" once preemption has begun. Compute Engine
then gives the VM about 30 s (--notice_s) before it stops it, so the deadline
is the time of detection plus that notice. Answers that lack the
"Metadata-Flavor: Google" response header are not from the metadata server
and are refused.

With --wait_for_change the poller long-polls (?wait_for_change=true with the
last ETag): the server holds the request until the value changes or
--wait_timeout_s passes, so the change is seen at once without frequent
requests; --interval then only spaces out the requests (after a change the
next request is sent at once).

On the change it runs, once per job on this host,
    notify_manager_preempt --connection_file <agent>/connection.json --deadline_unix_ms MS
retrying failures with backoff.

    gcp_preemption.py                               # every 1 s, all agents' connection files
    gcp_preemption.py --wait_for_change
"""
import sys
import time
import urllib.parse
from typing import List, Optional

import poller_common as pc

PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
HEADERS = {"Metadata-Flavor": "Google"}


class GcpPreemption(pc.Cloud):
    name = "gcp"
    default_interval_s = 1.0

    def add_arguments(self, parser):
        parser.add_argument("--notice_s", type=pc.positive_float, default=30.0,
                            help="seconds between preemption and the VM's stop (default 30)")
        parser.add_argument("--wait_for_change", action="store_true",
                            help="long-poll the metadata server instead of plain polling")
        parser.add_argument("--wait_timeout_s", type=pc.int_in_range(1, 3600), default=60,
                            help="longest a long-poll request is held by the server (default 60)")

    def configure(self, args, client, log):
        super().configure(args, client, log)
        self.etag: Optional[str] = None
        self.changed = False  # the last long poll returned a new value
        self.deadline_ms: Optional[int] = None

    def poll_again_now(self) -> bool:
        # After a change, the next long poll is held by the server anyway; a
        # server that ignores wait_for_change changes value rarely, so this
        # never turns into a busy loop.
        return self.changed

    def poll(self) -> List[pc.PreemptEvent]:
        path = PREEMPTED_PATH
        timeout = None
        if self.args.wait_for_change and self.etag:
            query = urllib.parse.urlencode({"wait_for_change": "true", "last_etag": self.etag,
                                            "timeout_sec": str(self.args.wait_timeout_s)})
            path = f"{PREEMPTED_PATH}?{query}"
            timeout = self.args.wait_timeout_s + self.args.timeout
        self.changed = False
        response = self.client.request("GET", path, headers=HEADERS, timeout_s=timeout)
        if response.status != 200:
            raise pc.http_error(response, "GET " + PREEMPTED_PATH)
        if response.headers.get("metadata-flavor") != "Google":
            raise pc.MetadataError("not metadata server",
                                   f"GET {PREEMPTED_PATH}: the answer lacks 'Metadata-Flavor: Google' (a proxy or "
                                   f"another server?): {response.text()[:200]!r}")
        value = response.text().strip().upper()
        if value not in ("TRUE", "FALSE"):
            raise pc.MetadataError("malformed", f"GET {PREEMPTED_PATH}: expected TRUE or FALSE, got "
                                                f"{response.text()[:200]!r}")
        etag = response.headers.get("etag") or None
        self.changed = self.args.wait_for_change and self.etag is not None and etag != self.etag
        self.etag = etag
        if value == "FALSE":
            return []
        if self.deadline_ms is None:  # fixed at first detection: later polls must not push it back
            self.deadline_ms = int(time.time() * 1000 + self.args.notice_s * 1000)
        return [pc.PreemptEvent(key="preempted", deadline_unix_ms=self.deadline_ms,
                                description="GCP preemption (instance/preempted is TRUE)")]


if __name__ == "__main__":
    sys.exit(pc.main(GcpPreemption(), __doc__))

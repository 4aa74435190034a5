#!/usr/bin/env python3
"""AWS preemption poller: tells the varuna manager when this Spot instance will be interrupted.

Uses the instance metadata service version 2 (IMDSv2):
    PUT <endpoint>/latest/api/token            header X-aws-ec2-metadata-token-ttl-seconds: <ttl>
    GET <endpoint>/latest/meta-data/spot/instance-action   header X-aws-ec2-metadata-token: <token>
404 means no interruption is scheduled; 200 carries
    {"action": "terminate" | "stop" | "hibernate", "time": "2026-05-01T08:22:00Z"}
about two minutes ahead; "time" is the deadline. The token is reused until
shortly before its TTL ends, and fetched again at once if the service answers
401. (On an instance in a container, the token PUT needs a hop limit of 2.)

For each new (action, time) it runs, once per job on this host,
    notify_manager_preempt --connection_file <agent>/connection.json --deadline_unix_ms MS
retrying failures with backoff.

    aws_spot_interruption.py                        # every 5 s, all agents' connection files
"""
import datetime
import json
import sys
import time
from typing import List, Optional

import poller_common as pc

TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"


def parse_time(text: str) -> int:
    """ISO 8601 UTC ("2026-05-01T08:22:00Z", fractions allowed) -> unix ms. ValueError if malformed."""
    value = text.strip()
    if value.endswith("Z"):
        value = value[:-1] + "+00:00"
    parsed = datetime.datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    return int(parsed.timestamp() * 1000)


class AwsSpotInterruption(pc.Cloud):
    name = "aws"
    default_interval_s = 5.0

    def add_arguments(self, parser):
        parser.add_argument("--token_ttl", type=pc.int_in_range(1, 21600), default=21600,
                            help="IMDSv2 session token lifetime in seconds, 1..21600 (default 21600)")

    def configure(self, args, client, log):
        super().configure(args, client, log)
        self.token: Optional[str] = None
        self.token_expires = 0.0

    def _token(self) -> str:
        # Renew a little early so a token never expires between fetch and use.
        if self.token is None or time.monotonic() >= self.token_expires:
            response = self.client.request("PUT", TOKEN_PATH,
                                           headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.args.token_ttl)})
            token = response.text().strip()
            if response.status != 200 or not token:
                raise pc.http_error(response, "PUT " + TOKEN_PATH)
            self.token = token
            self.token_expires = time.monotonic() + max(1.0, self.args.token_ttl - 60)
        return self.token

    def _get_action(self) -> pc.HttpResponse:
        return self.client.request("GET", ACTION_PATH, headers={"X-aws-ec2-metadata-token": self._token()})

    def poll(self) -> List[pc.PreemptEvent]:
        response = self._get_action()
        if response.status == 401:  # token expired or the service restarted: fetch a new one and ask again
            self.log.debug("IMDSv2 token refused; fetching a new one")
            self.token = None
            response = self._get_action()
        if response.status == 404:
            return []
        if response.status != 200:
            raise pc.http_error(response, "GET " + ACTION_PATH)
        try:
            notice = json.loads(response.body)
            action = notice["action"]
            when = notice["time"]
            if not isinstance(action, str) or not isinstance(when, str):
                raise TypeError("action and time must be strings")
        except (ValueError, KeyError, TypeError) as e:
            raise pc.MetadataError("malformed", f"GET {ACTION_PATH}: expected {{\"action\", \"time\"}} ({e}): "
                                                f"{response.text()[:200]!r}")
        try:
            deadline: Optional[int] = parse_time(when)
        except ValueError:
            self.log.warning("spot instance-action: unreadable time %r; deadline unknown", when)
            deadline = None
        return [pc.PreemptEvent(key=f"{action}@{when}", deadline_unix_ms=deadline,
                                description=f"AWS spot interruption ({action} at {when})")]


if __name__ == "__main__":
    sys.exit(pc.main(AwsSpotInterruption(), __doc__))

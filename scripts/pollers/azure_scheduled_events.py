#!/usr/bin/env python3
"""Azure preemption poller: tells the varuna manager when this Spot VM will be evicted.

Polls the Scheduled Events service of the Azure Instance Metadata Service,
    GET <endpoint>/metadata/scheduledevents?api-version=2020-07-01   (header Metadata: true)
and reacts to events of EventType "Preempt" that name this VM in Resources
(events of other VMs in the same availability or scale set are ignored; an
event without Resources is taken as ours). NotBefore is the deadline; it is
blank once the eviction has started, and then no deadline is passed.

For each new event (by EventId) it runs, once per job on this host,
    notify_manager_preempt --connection_file <agent>/connection.json [--deadline_unix_ms MS]
retrying failures with backoff. With --ack it then approves the event
(POST {"StartRequests": [{"EventId": ...}]}), which lets Azure evict the VM
at once instead of waiting until NotBefore: use it only when the job's
on-demand checkpoint does not need the remaining notice.

    azure_scheduled_events.py                       # every 1 s, all agents' connection files
    azure_scheduled_events.py --connection_file /tmp/varuna/gpt/10.0.0.5/connection.json --ack
"""
import email.utils
import json
import sys
from typing import List, Optional

import poller_common as pc

API = "api-version=2020-07-01"
EVENTS_PATH = "/metadata/scheduledevents?" + API
NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
HEADERS = {"Metadata": "true"}


def parse_not_before(text: str) -> Optional[int]:
    """RFC 1123 time ("Mon, 19 Sep 2016 18:29:47 GMT") -> unix ms; None if blank."""
    if not text.strip():
        return None
    parsed = email.utils.parsedate_to_datetime(text)  # ValueError/TypeError if malformed
    if parsed.tzinfo is None:
        raise ValueError(f"NotBefore {text!r} has no time zone")
    return int(parsed.timestamp() * 1000)


class AzureScheduledEvents(pc.Cloud):
    name = "azure"
    default_interval_s = 1.0

    def add_arguments(self, parser):
        parser.add_argument("--ack", action="store_true",
                            help="after notifying, approve the event (POST StartRequests): Azure may then evict at "
                                 "once instead of at NotBefore")
        parser.add_argument("--vm_name", default=None,
                            help="this VM's name as Azure lists it in an event's Resources (default: asked from "
                                 "the metadata service when an event names resources)")

    def configure(self, args, client, log):
        super().configure(args, client, log)
        self.vm_name: Optional[str] = args.vm_name
        self.ignored: set = set()  # event ids of other VMs and malformed items, logged once each

    def supports_ack(self) -> bool:
        return True

    def _own_name(self) -> Optional[str]:
        if self.vm_name is None:
            try:
                response = self.client.request("GET", NAME_PATH, headers=HEADERS)
            except pc.MetadataError as e:
                self.log.warning("cannot learn this VM's name (%s); treating every Preempt event as ours", e)
                return None
            name = response.text().strip()
            if response.status != 200 or not name:
                self.log.warning("cannot learn this VM's name (%s); treating every Preempt event as ours",
                                 pc.http_error(response, "GET " + NAME_PATH))
                return None
            self.vm_name = name
            self.log.info("this VM is %r", name)
        return self.vm_name

    def poll(self) -> List[pc.PreemptEvent]:
        response = self.client.request("GET", EVENTS_PATH, headers=HEADERS)
        if response.status != 200:
            raise pc.http_error(response, "GET " + EVENTS_PATH)
        try:
            document = json.loads(response.body)
        except ValueError as e:
            raise pc.MetadataError("malformed", f"GET {EVENTS_PATH}: not JSON ({e}): {response.text()[:200]!r}")
        if not isinstance(document, dict) or not isinstance(document.get("Events"), list):
            raise pc.MetadataError("malformed", f"GET {EVENTS_PATH}: no Events list in {response.text()[:200]!r}")
        events = []
        for item in document["Events"]:
            if not isinstance(item, dict) or item.get("EventType") != "Preempt":
                continue
            event_id = item.get("EventId")
            if not isinstance(event_id, str) or not event_id:
                text = json.dumps(item, sort_keys=True)[:300]
                if text not in self.ignored:  # once per distinct item: it may stay listed for minutes
                    self.ignored.add(text)
                    self.log.warning("ignoring a Preempt event without EventId: %s", text)
                continue
            resources = item.get("Resources") or []
            if not isinstance(resources, list):
                resources = [resources]
            if resources:
                own = self._own_name()
                if own is not None and own not in resources:
                    if event_id not in self.ignored:
                        self.ignored.add(event_id)
                        self.log.info("ignoring Preempt event %s of other VMs %s", event_id, resources)
                    continue
            not_before = item.get("NotBefore") or ""
            try:
                deadline = parse_not_before(str(not_before))
            except (TypeError, ValueError, IndexError):
                self.log.warning("Preempt event %s: unreadable NotBefore %r; deadline unknown", event_id, not_before)
                deadline = None
            description = (f"Azure Preempt event {event_id} (status {item.get('EventStatus', '?')}, "
                           f"NotBefore {not_before or 'blank'})")
            events.append(pc.PreemptEvent(key=event_id, deadline_unix_ms=deadline, description=description,
                                          ack_id=event_id))
        return events

    def acknowledge(self, event: pc.PreemptEvent) -> None:
        body = json.dumps({"StartRequests": [{"EventId": event.ack_id}]}).encode()
        response = self.client.request("POST", EVENTS_PATH, body=body,
                                       headers=dict(HEADERS, **{"Content-Type": "application/json"}))
        if not 200 <= response.status < 300:
            raise pc.http_error(response, "POST " + EVENTS_PATH)


if __name__ == "__main__":
    sys.exit(pc.main(AzureScheduledEvents(), __doc__))

"""A tap on the loopback wire and the credentials a job's traffic must never
show in clear (local_job_test: the control plane is TLS)."""
import base64
import json
import re
import socket
import threading


class LoopbackTap:
    """Every frame on the loopback interface, as tcpdump -i lo would record
    them (an AF_PACKET socket: root only), kept in memory."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.frames = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                self.frames.append(self.sock.recv(65536))
            except socket.timeout:
                pass

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()
        return b"".join(self.frames)


def _pem_blocks(credential):
    """The DER bytes of each PEM block of a certificate credential ("vc1." and
    base64 of PEM: the key, the certificate, its issuers; certificate_credential.h)."""
    assert credential.startswith("vc1."), credential[:16]
    pem = base64.b64decode(credential[4:]).decode()
    blocks = re.findall(r"-----BEGIN ([A-Z ]+)-----\n(.*?)-----END \1-----", pem, re.S)
    return [(kind, base64.b64decode("".join(body.split()))) for kind, body in blocks]


def credentials_of_job(m, hosts):
    """What must never cross the wire in clear, as bytes: the job's secret,
    its CA (the text of <state_dir>/ca and the root's private key), and each
    host's notifier credential (its connection file: its text, its private
    key and its certificate, which TLS 1.3 encrypts too)."""
    found = {"secret": (m.state_dir / "token").read_text().strip().encode()}
    ca = (m.state_dir / "ca").read_text().splitlines()[0]
    found["ca credential"] = ca.encode()
    found["ca key"] = _pem_blocks(ca)[0][1]
    for host in hosts:
        notifier = json.loads(m.connection_file(host).read_text())["token"]
        found["notifier credential " + host] = notifier.encode()
        (_, key), (_, certificate) = _pem_blocks(notifier)[:2]
        found["notifier key " + host] = key
        found["notifier certificate " + host] = certificate
    return found

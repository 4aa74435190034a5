"""A tap on the loopback wire and the credentials a job's traffic must never
show in clear (local_job_test: the control plane is TLS)."""
import hashlib
import hmac
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


def credentials_of_job(m, hosts, generation_max=3, ranks=4):
    """The job's secret and every credential derived from it (credentials.h)
    for these hosts: what must never cross the wire in clear."""
    secret = (m.state_dir / "token").read_text().strip()
    mac = lambda key, text: hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()  # noqa: E731
    found = {"secret": secret}
    for host in hosts:
        agent = mac(secret, "agent\n" + host)
        found["agent " + host] = agent
        found["notifier " + host] = mac(agent, "notifier")
        for rank in range(ranks):
            for generation in range(generation_max + 1):
                found["worker %s %d %d" % (host, rank, generation)] = mac(agent, "worker\n%d\n%d" % (rank, generation))
    return found

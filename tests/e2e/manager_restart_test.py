#!/usr/bin/env python3
"""run_varuna restarted on the same state folder, end to end on this machine
(two loopback "hosts" started without SSH, the example trainer, real agents
and workers): killed and restarted it carries on, and the agents it replaced
lose their certificates; restarted with its secret rotated, nothing of the
old secret gets back in."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from varuna_e2e import (  # noqa: E402
    BIN, assert_nothing_left, managers, processes_of_job, run_tests, wait_for)

ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-e2e-restart-")))
shutil.rmtree(ROOT, ignore_errors=True)  # nothing of an earlier run may leak into this one
ROOT.mkdir(parents=True)
TWO_HOSTS = ["127.0.0.1 slots=2", "127.0.0.2 slots=2"]


manager = managers(ROOT, 27000 + (os.getpid() % 100) * 40, "e2e", TWO_HOSTS)


def unauthenticated(m):
    """Handshakes refused for want of the job's credential (state.json, rewritten every second)."""
    return m.state().get("connections", {}).get("unauthenticated", 0)


def notify_with_old_notifier(m, host, old_notifier):
    """notify_manager_preempt with `host`'s connection file as it is now, but
    the notifier credential it held earlier: the completed process."""
    stale_conn = m.workdir / "old-connection.json"
    conn = json.loads(m.connection_file(host).read_text())
    conn["token"] = old_notifier
    stale_conn.write_text(json.dumps(conn))
    stale_conn.chmod(0o600)
    return subprocess.run([str(BIN / "notify_manager_preempt"), "--connection_file", str(stale_conn)],
                          capture_output=True, text=True, timeout=30)


def assert_refused_and_stop(m, before, refused):
    """Each (completed notify_manager_preempt, what its stderr must say) was
    refused and counted, no notice reached the job; then the job stops cleanly."""
    for r, why in refused:
        assert r.returncode != 0 and why in r.stderr, (r.returncode, r.stderr)
    wait_for("the refusals counted", lambda: unauthenticated(m) >= before + len(refused), 30)
    assert len(m.events("preempt_notice")) == 0, "a refused notice reached the job"
    m.kill(signal.SIGTERM)
    assert m.wait_exit() == 0, m.tail()
    assert_nothing_left(m.job)


def test_manager_killed_and_restarted_carries_on():
    m = manager("restart", steps=300, train_args=["--checkpoint_every", "20"],
                extra_args=["--agent_grace_s", "30"]).start()
    m.wait_step(45)
    m.kill(signal.SIGKILL)
    m.proc.wait()
    old = processes_of_job(m.job)
    assert old, "agents and workers keep running within the grace period"
    m.start()  # same command, same state folder
    assert m.wait_exit() == 0, m.tail()
    assert m.events("manager_restarted"), "the restart was not recognised"
    launches = m.events("launch")
    assert launches[-1]["generation"] == 2 and launches[-1]["resume_step"] >= 40, launches
    for pid, _ in old:
        assert not Path("/proc/%d" % pid).exists() or pid not in [p for p, _ in processes_of_job(m.job)]
    assert_nothing_left(m.job)


def test_a_replaced_agents_certificates_are_revoked():
    """P15, a credential per host and launch: each start of a host's agent
    gets a host CA of its own, and a restarted manager (same secret, same
    CA) starts every agent again. Until the new agents say hello, the old
    ones' certificates stay valid (the starts are kept in
    <state_dir>/agent_launches); once they have, the old notifier's
    certificate is refused in the handshake."""
    m = manager("revoke", steps=100000, extra_args=["--agent_grace_s", "30"]).start()
    m.wait_step(10)
    old_notifier = json.loads(m.connection_file("127.0.0.2").read_text())["token"]
    saved = json.loads((m.state_dir / "agent_launches").read_text())
    assert sorted(saved) == ["127.0.0.1", "127.0.0.2"] and all(saved.values()), saved
    launched = len(m.events("launch"))
    m.kill(signal.SIGKILL)
    m.proc.wait()
    m.start()
    m.wait_event("launch", count=launched + 1)  # after both new agents said hello
    new_notifier = json.loads(m.connection_file("127.0.0.2").read_text())["token"]
    assert new_notifier != old_notifier
    # The new starts, and nothing of the old ones, once the file is written (within a second).
    wait_for("the new starts saved", lambda: all(
        not set(v) & set(saved[h]) for h, v in json.loads((m.state_dir / "agent_launches").read_text()).items()), 10)
    before = unauthenticated(m)
    r = notify_with_old_notifier(m, "127.0.0.2", old_notifier)
    assert_refused_and_stop(m, before, [(r, "refused this certificate")])


def test_a_rotated_secret_shuts_the_old_credentials_out():
    """docs/deployment.md, "Security": rotating is deleting <state_dir>/token and
    restarting run_varuna. Here the manager is killed while its agents and
    workers run on (within their grace) holding credentials of the old
    secret. The new manager makes a new secret and starts every agent again
    with credentials of it; each new agent stops its host's old agent and
    that agent's workers, and the job resumes from its checkpoint. The old
    secret and a host's old notifier credential (what a poller on the host
    holds) are refused in the TLS handshake."""
    m = manager("rotate", steps=100000, train_args=["--checkpoint_every", "20"],
                extra_args=["--agent_grace_s", "30"]).start()
    m.wait_step(45)
    old_secret = (m.state_dir / "token").read_text().strip()
    old_notifier = json.loads(m.connection_file("127.0.0.2").read_text())["token"]
    m.kill(signal.SIGKILL)
    m.proc.wait()
    old = processes_of_job(m.job)
    assert old, "agents and workers keep running within the grace period"
    (m.state_dir / "token").unlink()  # the rotation
    m.start()  # same command, same state folder
    m.wait_event("launch", count=2)
    m.wait_step(m.events("launch")[-1]["resume_step"] + 3)
    new_secret = (m.state_dir / "token").read_text().strip()
    assert len(new_secret) == len(old_secret) and new_secret != old_secret
    launches = m.events("launch")
    assert launches[-1]["generation"] >= 2 and launches[-1]["resume_step"] >= 40, launches
    # No process of the old secret is left: the new agents stopped the old ones and their workers.
    running = {pid for pid, _ in processes_of_job(m.job)}
    assert not running & {pid for pid, _ in old}, (old, processes_of_job(m.job))
    new_notifier = json.loads(m.connection_file("127.0.0.2").read_text())["token"]
    assert new_notifier != old_notifier
    before = unauthenticated(m)
    address = m.events("manager_started")[-1]["address"]  # the restarted manager's
    stale = m.workdir / "old-secret"
    stale.write_text(old_secret + "\n")
    with_secret = subprocess.run([str(BIN / "notify_manager_preempt"), "--manager", address, "--token_file",
                                  str(stale), "--host", "127.0.0.2"], capture_output=True, text=True, timeout=30)
    with_notifier = notify_with_old_notifier(m, "127.0.0.2", old_notifier)
    assert_refused_and_stop(m, before, [(with_secret, "did not accept this credential"),
                                        (with_notifier, "did not accept this credential")])


if __name__ == "__main__":
    run_tests([
        test_manager_killed_and_restarted_carries_on,
        test_a_replaced_agents_certificates_are_revoked,
        test_a_rotated_secret_shuts_the_old_credentials_out,
    ])

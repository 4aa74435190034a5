"""A real Slurm cluster on one machine, for end-to-end tests under a scheduler.

Built on netns_cluster.Cluster: every host is a network namespace; here each
also runs its own slurmd (in a UTS namespace of its own whose host name is its
node name, n0, n1, ...), and the head namespace runs slurmctld (host name
`head`). One munged with a throwaway key serves them all (its socket is a
file, which every namespace shares). Slurm's own commands (sbatch, squeue,
scontrol, scancel) run in the head namespace with SLURM_CONF pointing at this
cluster's configuration. Needs root, Debian's slurmctld, slurmd,
slurm-client and munge, and a cgroup file system (v1 or v2) for slurmd.

Job credentials expire after 10 s (cred_expire; Slurm's default is 120): a
requeued job waits that long before it may run again (its BeginTime).

Partitions: `low` (the default; PriorityTier 1, PreemptMode=REQUEUE,
GraceTime `grace_s`) and `high` (PriorityTier 10): a job on `high` preempts
`low` jobs on its nodes, which get SIGTERM, `grace_s` seconds, then SIGKILL,
and are requeued.

API
---
``SlurmCluster(n_hosts, workdir, grace_s=5)``: starts everything and returns
once every node is idle (raises ``SlurmError`` with the daemons' logs
otherwise). A context manager; ``close()`` stops the daemons and the
namespaces (also at interpreter exit).
``cluster.net``: the netns_cluster.Cluster (``hosts``, ``head_addr``, ...);
``node(i)``: node name of host i.
``run(argv, timeout=60)``: a Slurm command in the head namespace (text output).
``sbatch(script, *args) -> int``: submits a batch script (text); the job id.
``jobs() -> list[dict]``: squeue's jobs (id, array task, state, node list).
``job_states(job_id) -> dict``: every record of a job (array tasks included)
from scontrol, keyed by JobId.
``processes_on(i, pattern) -> list[int]``: pids in host i's namespace whose
command line contains pattern.
"""
import atexit
import os
import re
import subprocess
import time

from netns_cluster import Cluster


class SlurmError(RuntimeError):
    pass


def _cgroup_plugin():
    """cgroup/v2 on a unified hierarchy, else v1 (a tmpfs of v1 controllers)."""
    try:
        fs_type = subprocess.run(["stat", "-f", "-c", "%T", "/sys/fs/cgroup"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        fs_type = ""
    return "cgroup/v2" if fs_type == "cgroup2fs" else "cgroup/v1"


class SlurmCluster:
    def __init__(self, n_hosts, workdir, grace_s=5):
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.grace_s = grace_s
        self.daemons = []
        self.net = Cluster(n_hosts, os.path.join(self.workdir, "net"))
        atexit.register(self.close)
        try:
            self._start_munge()
            self._write_config()
            self._start_daemons()
            self._wait_idle()
        except Exception:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def node(self, i):
        return "n%d" % i

    # --- start-up ---------------------------------------------------------------------

    def _path(self, *parts):
        return os.path.join(self.workdir, *parts)

    def _start_munge(self):
        munge = self._path("munge")
        os.makedirs(munge, exist_ok=True)
        os.chmod(munge, 0o711)
        with open(self._path("munge", "munge.key"), "wb") as key:
            key.write(os.urandom(1024))
        os.chmod(self._path("munge", "munge.key"), 0o600)
        self.munge_socket = self._path("munge", "socket")
        self._daemon("munged", ["munged", "-F", "-f", "--socket=" + self.munge_socket,
                                "--key-file=" + self._path("munge", "munge.key"),
                                "--log-file=" + self._path("munge", "munged.log"),
                                "--pid-file=" + self._path("munge", "munged.pid"),
                                "--seed-file=" + self._path("munge", "munged.seed")], ns=None)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.munge_socket):
            if time.monotonic() > deadline:
                raise SlurmError("munged did not start:\n" + self._log("munged.out"))
            time.sleep(0.05)

    def _write_config(self):
        for folder in ["ctld"] + ["slurmd-%s" % self.node(h.index) for h in self.net.hosts]:
            os.makedirs(self._path(folder), exist_ok=True)
        nodes = "\n".join("NodeName=%s NodeAddr=%s CPUs=2 State=UNKNOWN" % (self.node(h.index), h.addr)
                          for h in self.net.hosts)
        d = self.workdir
        self.conf = self._path("slurm.conf")
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=varunatest
SlurmctldHost=head({self.net.head_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/slurmd-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait={self.grace_s}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=low Nodes=ALL Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={self.grace_s} OverSubscribe=EXCLUSIVE State=UP
PartitionName=high Nodes=ALL PriorityTier=10 PreemptMode=OFF OverSubscribe=EXCLUSIVE State=UP
""")
        with open(self._path("cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=%s\nCgroupMountpoint=/sys/fs/cgroup\n" % _cgroup_plugin())
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def _daemon(self, name, argv, ns):
        out = open(self._path(name + ".out"), "w")
        if ns is None:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=getattr(self, "env", None))
        else:
            proc = self.net.popen_in(ns, argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.daemons.append((name, proc))
        return proc

    def _start_daemons(self):
        # Each daemon in a UTS namespace of its own: Slurm finds a node's (and
        # the controller's) name in the host name.
        self._daemon("slurmctld", ["unshare", "--uts", "sh", "-c",
                                   "hostname head && exec slurmctld -D -f " + self.conf], ns=self.net.head_ns)
        for h in self.net.hosts:
            self._daemon("slurmd-" + self.node(h.index),
                         ["unshare", "--uts", "sh", "-c",
                          "hostname %s && exec slurmd -D -f %s" % (self.node(h.index), self.conf)], ns=h)

    def _log(self, name):
        try:
            with open(self._path(name), errors="replace") as f:
                return "".join(f.readlines()[-30:])
        except OSError:
            return "(no %s)" % name

    def _wait_idle(self, timeout=60):
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for name, proc in self.daemons:
                if proc.poll() is not None:
                    raise SlurmError("%s exited with %s:\n%s" % (name, proc.returncode, self._log(name + ".out")))
            r = self.run(["sinfo", "-h", "-N", "-p", "low", "-o", "%N %t"], check=False)
            states = r.stdout
            nodes = dict(line.split() for line in states.splitlines() if line.strip())
            if len(nodes) == len(self.net.hosts) and all(s == "idle" for s in nodes.values()):
                return
            time.sleep(0.2)
        raise SlurmError("nodes not idle after %d s: %s\nslurmctld:\n%s" % (timeout, states, self._log("slurmctld.out")))

    # --- use ----------------------------------------------------------------------------

    def run(self, argv, timeout=60, check=True):
        r = self.net.run_in(self.net.head_ns, argv, timeout=timeout, env=self.env)
        if check and r.returncode != 0:
            raise SlurmError("%s failed (%d): %s%s" % (" ".join(argv), r.returncode, r.stdout, r.stderr))
        return r

    def sbatch(self, script, *args):
        path = self._path("job-%d.sh" % time.monotonic_ns())
        with open(path, "w") as f:
            f.write(script)
        out = self.run(["sbatch", "--parsable", *args, path]).stdout.strip()
        return int(out.split(";")[0].split("_")[0])

    def jobs(self):
        """squeue's view: [{"id": "12_3", "state": "RUNNING", "nodes": "n1"}, ...]."""
        r = self.run(["squeue", "-h", "-o", "%i %T %N"], check=False)
        out = []
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2:
                out.append({"id": parts[0], "state": parts[1], "nodes": parts[2] if len(parts) > 2 else ""})
        return out

    def job_states(self, job_id):
        r = self.run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        records = {}
        for line in r.stdout.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "JobId" in fields:
                records[fields["JobId"]] = fields
        return records

    def processes_on(self, i, pattern):
        found = []
        for pid in self.net.pids_in(self.net.hosts[i]):
            try:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if pattern in cmd:
                found.append(pid)
        return found

    def close(self):
        for name, proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.daemons = []
        if self.net:
            self.net.close()
            self.net = None

#!/usr/bin/env python3
"""Checkpoint storage faults under run_varuna, end to end: real manager,
agents and workers on two loopback "hosts" (127.0.0.1, 127.0.0.2), real files.

- A global store on a small tmpfs (mounted by the test; we run as root) that
  holds a few checkpoints but not all: without retention a periodic
  checkpoint fails with ENOSPC, the manager is told (`checkpoint_failed`) and
  training goes on to its last step; with --keep_checkpoints 2 a longer run
  never fills it. A store too full for the manager's generation record at
  launch: the launch fails (`launch_failed`) and is retried after the backoff.
- A flipped byte in the newest complete checkpoint (same size, so only its
  checksum tells): a restarted manager's workers fall back to the previous
  complete checkpoint, mark the damaged one, and the manager's event log
  names it (`checkpoint_skipped`); training that reaches the damaged step
  again writes it anew.

Every scenario checks that no process of its job is left behind.
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from varuna_e2e import Manager, assert_nothing_left, log, processes_of_job, run_tests  # noqa: E402

ROOT = Path(os.environ.get("VARUNA_TEST_TMPDIR", tempfile.mkdtemp(prefix="varuna-ckpt-faults-")))
TWO_HOSTS = ["127.0.0.1 slots=2", "127.0.0.2 slots=2"]
PAGE = 4096  # tmpfs charges whole pages per file
_port = [23000 + (os.getpid() % 200) * 40]


def manager(name, **kw):
    _port[0] += 10
    extra = list(kw.pop("extra_args", [])) + ["--master_port", str(_port[0])]
    return Manager(ROOT / name, TWO_HOSTS, job="ckpt-" + name + "-" + str(os.getpid()), extra_args=extra, **kw)


def restarted(m, **kw):
    """run_varuna again on the same job, state folder and global store (a manager restart)."""
    extra = list(kw.pop("extra_args", [])) + ["--master_port", str(_port[0] + 5)]
    return Manager(m.workdir, TWO_HOSTS, job=m.job, extra_args=extra, **kw)


def complete_steps(store):
    """Steps of the checkpoints with their COMPLETE marker, newest first."""
    steps = []
    for d in Path(store).glob("varuna_ckpt_*"):
        name = d.name[len("varuna_ckpt_"):]
        if name.isdigit() and (d / "COMPLETE").exists():
            steps.append(int(name))
    return sorted(steps, reverse=True)


def tmpfs_bytes(folder):
    """What `folder` costs on a tmpfs: every file rounded up to whole pages."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            size = os.path.getsize(os.path.join(dirpath, f))
            total += (size + PAGE - 1) // PAGE * PAGE
    return total


def steps_trained(m, rank=0):
    """The steps of the trainer's per-step log of `rank`, in the order they were trained."""
    path = m.dump / ("rank%d_steps.jsonl" % rank)
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def end_job(m):
    """SIGKILL what is left of `m`'s job (a failed assertion must not leave it
    writing into a store we are about to unmount)."""
    m.kill(signal.SIGKILL)
    if m.proc:
        m.proc.wait()
    for pid, _ in processes_of_job(m.job):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def flip_one_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def verifies(folder):
    """Every file of the checkpoint's manifest has its size and crc32, and no DAMAGED marker."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["files"]:
        data = (folder / entry["name"]).read_bytes()
        if len(data) != entry["size"] or zlib.crc32(data) != entry["crc32"]:
            return False
    return (folder / "COMPLETE").exists() and not (folder / "DAMAGED").exists()


def unmount_leftovers():
    """A store an earlier, killed run of this test left mounted under ROOT."""
    with open("/proc/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in points:
        if point.startswith(str(ROOT) + "/"):
            subprocess.run(["umount", "-l", point], capture_output=True)


class CannotMount(Exception):
    pass


@contextlib.contextmanager
def small_tmpfs(path, size):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%d,mode=0755" % size, "varuna-test-store", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise CannotMount((r.stderr or r.stdout).strip() or "mount exited with %d" % r.returncode)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


_store_size = []  # measured once, for both tmpfs scenarios


def store_size():
    """Room for 4.5 checkpoints of the test's job (2 stages x 2 replicas, the
    tiny model) on a tmpfs, measured on a job of one checkpoint: with
    --keep_checkpoints 0 a job runs out after 4; with --keep_checkpoints 2 it
    needs 3 at most (two kept, one being written)."""
    if not _store_size:
        m = manager("measure", steps=10).start()
        assert m.wait_exit() == 0, m.tail()
        assert_nothing_left(m.job)
        assert complete_steps(m.store) == [10], complete_steps(m.store)
        checkpoint = tmpfs_bytes(m.store / "varuna_ckpt_10")
        _store_size.append((int(4.5 * checkpoint) + PAGE - 1) // PAGE * PAGE)
        log("a checkpoint takes %d bytes on tmpfs; the stores get %d" % (checkpoint, _store_size[0]))
    return _store_size[0]


def skip_without_tmpfs(test):
    def run():
        try:
            test()
        except CannotMount as e:
            log("SKIPPED %s: cannot mount a tmpfs (%s); it needs root (CAP_SYS_ADMIN)" % (test.__name__, e))
    run.__name__ = test.__name__
    return run


@contextlib.contextmanager
def job_on_small_store(name, steps, keep_checkpoints):
    """Runs a job checkpointing every 10 steps to the end on a store of
    store_size(); yields (manager, exit code) while the store is still mounted."""
    m = manager(name, steps=steps, train_args=["--checkpoint_every", "10"],
                extra_args=["--keep_checkpoints", str(keep_checkpoints)])
    with small_tmpfs(m.store, store_size()):
        try:
            m.start()
            code = m.wait_exit(240)
        finally:
            end_job(m)
        yield m, code


@skip_without_tmpfs
def test_full_store_fails_periodic_checkpoints_but_training_goes_on():
    steps = 150
    with job_on_small_store("enospc", steps, keep_checkpoints=0) as (m, code):
        assert code == 0, "run_varuna exited with %s (a full store must not stop the job):\n%s" % (code, m.tail())
        failed = m.events("checkpoint_failed")
        assert failed, "no checkpoint_failed event:\n" + m.tail()
        log("%d checkpoint_failed events, the first: %s" % (len(failed), json.dumps(failed[0])))
        assert all({"host", "rank", "step", "error"} <= set(e) for e in failed), failed[0]
        assert all(len(e["error"].encode()) <= 500 for e in failed)
        assert any("No space left on device" in e["error"] for e in failed), [e["error"] for e in failed[:4]]
        assert {e["host"] for e in failed} <= {"127.0.0.1", "127.0.0.2"}
        # A few fit, not all; the job trained every step and never relaunched.
        complete = complete_steps(m.store)
        log("complete checkpoints on the full store:", complete)
        assert 2 <= len(complete) < steps // 10, complete
        assert min(e["step"] for e in failed) > min(complete), (complete, failed[0])  # it filled up
        assert steps_trained(m) == list(range(steps)), steps_trained(m)[-5:]
        assert len(m.events("launch")) == 1, m.events("launch")
        assert all(e["exit_code"] == 0 for e in m.events("worker_exited")), m.events("worker_exited")
        assert m.events("stop")[-1]["exit_code"] == 0
        state = m.state()
        assert state["checkpoint_failures"] == len(failed), state
        assert state["last_checkpoint_failure"]["step"] == max(e["step"] for e in failed), state
        status = subprocess.run([m.argv[0], "status", "--state_dir", str(m.state_dir)],
                                capture_output=True, text=True, timeout=30)
        assert "ckpt failures" in status.stdout, status.stdout
        assert_nothing_left(m.job)


@skip_without_tmpfs
def test_retention_keeps_a_long_run_within_the_same_store():
    steps = 200
    with job_on_small_store("retention", steps, keep_checkpoints=2) as (m, code):
        assert code == 0, m.tail()
        assert not m.events("checkpoint_failed"), m.events("checkpoint_failed")[:2]
        complete = complete_steps(m.store)
        log("complete checkpoints at the end:", complete, "; store:", sorted(p.name for p in m.store.iterdir()))
        assert complete == [steps, steps - 10], complete
        # Of the 20 checkpoints nothing else is left but unfinished partial folders.
        others = [p.name for p in m.store.glob("varuna_ckpt_*")
                  if p.name[len("varuna_ckpt_"):].isdigit() and int(p.name[len("varuna_ckpt_"):]) not in complete]
        assert not others, others
        assert m.state()["last_checkpoint_step"] == steps, m.state()
        assert steps_trained(m) == list(range(steps))
        assert_nothing_left(m.job)


def fill(folder):
    """Fills the filesystem of `folder` up to the last byte; returns the filler file."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as out:
        for size in (1 << 20, PAGE, 1):
            try:
                while True:
                    out.write(b"\0" * size)
            except OSError:
                pass
    return filler


@skip_without_tmpfs
def test_a_full_store_at_launch_is_retried_after_the_backoff():
    """The generation record cannot be written (a full store): no worker is
    started, the launch is a failure (launch_failed), and once space is freed
    the retry after the backoff runs the job."""
    m = manager("full-at-launch", steps=20, extra_args=["--restart_backoff_s", "1"])
    with small_tmpfs(m.store, 4 << 20):  # room for the job's checkpoint once the filler is gone
        # The store already belongs to this job (nothing to write at start-up)
        # and has no room left for anything else.
        (m.store / "varuna_job.json").write_text(json.dumps({"job": m.job}) + "\n")
        filler = fill(m.store)
        try:
            m.start()
            m.wait_event("launch_failed", timeout=60)
            filler.unlink()  # the first retry is a backoff (1 s) away
            code = m.wait_exit(120)
        finally:
            end_job(m)
        assert code == 0, m.tail()
        failed = m.events("launch_failed")
        log("launch_failed:", json.dumps(failed[0]))
        assert "No space left on device" in failed[0]["reason"], failed[0]
        launches = m.events("launch")
        assert launches and launches[0]["generation"] > failed[0]["generation"], (launches, failed)
        assert not m.events("kill_all"), "nothing was running: nothing to kill"
        record = json.loads((m.store / "varuna_job.json").read_text())
        assert record == {"job": m.job, "generation": launches[-1]["generation"]}, record
        assert steps_trained(m) == list(range(20))
        assert_nothing_left(m.job)


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one():
    m = manager("damaged", steps=60, train_args=["--checkpoint_every", "20"]).start()
    assert m.wait_exit() == 0, m.tail()
    assert_nothing_left(m.job)
    assert complete_steps(m.store) == [60, 40, 20], complete_steps(m.store)
    newest = m.store / "varuna_ckpt_60"
    pieces = sorted(newest.glob("piece_*_head.params.pt"), key=lambda p: int(p.name.split("_")[1]))
    assert pieces, sorted(p.name for p in newest.iterdir())
    size = pieces[-1].stat().st_size
    flip_one_byte(pieces[-1])
    assert pieces[-1].stat().st_size == size
    log("flipped one byte of", pieces[-1])
    trained_before = len(steps_trained(m))

    # The same job restarted (same state folder and store), to step 50: the
    # manager still sees step 60 as complete (its sizes match), the workers
    # find the bad checksum, mark it and load step 40.
    again = restarted(m, steps=50, train_args=["--checkpoint_every", "20"])
    again.start()
    try:
        code = again.wait_exit()
    finally:
        end_job(again)
    assert code == 0, again.tail()
    assert again.events("manager_restarted"), "the restart was not recognised"
    launches = again.events("launch")
    assert launches[-1]["resume_step"] == 60, launches[-1]  # all the manager could tell from sizes
    resumed = steps_trained(again)[trained_before:]
    log("steps trained after the restart:", resumed[:3], "...", resumed[-2:])
    assert resumed == list(range(40, 50)), resumed
    assert (newest / "DAMAGED").exists(), sorted(p.name for p in newest.iterdir())
    skipped = [e for e in again.events("checkpoint_skipped") if e["step"] == 60]
    assert len(skipped) == 1, again.events("checkpoint_skipped")
    assert "damaged" in skipped[0]["reason"].lower(), skipped[0]
    log("checkpoint_skipped:", json.dumps(skipped[0]))
    assert "skipping the checkpoint of step 60" in again.output(), again.tail()
    assert complete_steps(again.store)[:2] == [60, 50]  # 60 keeps its marker, and DAMAGED
    assert again.state()["last_checkpoint_step"] == 50, again.state()
    assert again.state()["skipped_checkpoints"] == [60], again.state()
    assert_nothing_left(again.job)


def test_the_step_of_a_damaged_checkpoint_is_written_again():
    """The same command restarted after the newest checkpoint was damaged:
    training falls back to the previous one, reaches the damaged step again and
    its new checkpoint replaces the damaged one (else every later restart would
    retrain the same steps and the job's final state would never be saved)."""
    m = manager("rewrite", steps=40, train_args=["--checkpoint_every", "20"]).start()
    assert m.wait_exit() == 0, m.tail()
    assert_nothing_left(m.job)
    newest = m.store / "varuna_ckpt_40"
    flip_one_byte(sorted(newest.glob("piece_*.params.pt"), key=lambda p: int(p.name.split("_")[1]))[-1])
    trained_before = len(steps_trained(m))
    again = restarted(m, steps=40, train_args=["--checkpoint_every", "20"]).start()
    try:
        code = again.wait_exit()
    finally:
        end_job(again)
    assert code == 0, again.tail()
    assert steps_trained(again)[trained_before:] == list(range(20, 40)), steps_trained(again)[trained_before:]
    # (No checkpoint_skipped to wait for here: the new checkpoint may replace
    # the damaged one before the manager's next look at the store.)
    assert verifies(newest), "the checkpoint of step 40 was not written again: %s" % sorted(
        p.name for p in newest.iterdir())
    assert again.state()["last_checkpoint_step"] == 40, again.state()
    assert_nothing_left(again.job)


if __name__ == "__main__":
    unmount_leftovers()
    shutil.rmtree(ROOT, ignore_errors=True)  # nothing of an earlier run may leak into this one
    ROOT.mkdir(parents=True)
    run_tests([
        test_damaged_newest_checkpoint_falls_back_to_the_previous_one,
        test_the_step_of_a_damaged_checkpoint_is_written_again,
        test_full_store_fails_periodic_checkpoints_but_training_goes_on,
        test_retention_keeps_a_long_run_within_the_same_store,
        test_a_full_store_at_launch_is_retried_after_the_backoff,
    ])

#!/usr/bin/env python3
"""scripts/varuna_report.py's data extraction on an event log and a step log
written here: events on the time axis (seconds since the first event), each
generation a band from its launch to the next (the last to the stop), marks
by kind (the exits a kill-all causes are not marked), morphs as spans, the
steps a relaunch rolled back (lost, then recomputed) and none for a morph
that resumes where it stopped; then the command itself (a PNG, its path
printed; a folder without an event log is a clear error). unittest, run by
CTest with the project's .venv (matplotlib)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(SOURCE / "scripts"))
import varuna_report  # noqa: E402

T0 = 1_800_000_000_000  # unix ms of the first event


def event(seconds, name, **fields):
    return {"unix_ms": T0 + int(seconds * 1000), "event": name, **fields}


def plan(stages, replicas, chunk=4, hosts=("a", "b")):
    return {"stages": stages, "replicas": replicas, "chunk_size": chunk, "hosts": list(hosts)}


EVENTS = [
    event(0, "manager_started"),
    event(1, "launch", generation=1, resume_step=-1, plan=plan(2, 2)),
    event(5, "checkpoint_complete", step=100),
    event(6, "worker_exited", rank=1, exit_code=-1, signal=9, generation=1),
    event(6.1, "kill_all", reason="rank 1 exited with signal 9"),
    event(6.2, "worker_exited", rank=0, exit_code=-1, signal=9, generation=1),  # the kill-all's: not marked
    event(8, "launch", generation=2, resume_step=100, plan=plan(2, 2)),
    event(10, "morph_complete", cause="rank 1 failed", total_s=4.0),
    event(20, "preempt_notice", host="b"),
    event(20, "checkpoint_ordered", generation=2),
    event(21, "worker_exited", rank=0, exit_code=75, signal=0, generation=2),  # a morph's: not a loss
    event(21.5, "checkpoint_complete", step=300),
    event(22, "launch", generation=3, resume_step=300, plan=plan(2, 1, hosts=("a",))),
    event(23, "morph_complete", cause="preemption of b", total_s=3.0),
    event(25, "host_back", host="b"),
    event(30, "stop", reason="training finished", exit_code=0),
]


def step(seconds, generation, number, loss=2.0):
    return {"unix_ms": T0 + int(seconds * 1000), "event": "step", "generation": generation, "step": number,
            "loss": loss, "samples_per_s": 160.0, "step_s": 0.1}


STEPS = [step(2, 1, 10), step(3, 1, 60), step(4, 1, 110), step(5, 1, 150),
         step(10, 2, 101), step(11, 2, 150), step(12, 2, 200), step(20, 2, 300),
         step(23, 3, 301), step(30, 3, 400)]


class BuildTimelineTest(unittest.TestCase):
    def setUp(self):
        self.timeline = varuna_report.build_timeline(EVENTS, STEPS)

    def test_generations_are_bands_from_launch_to_the_next(self):
        bands = [(g["generation"], g["start"], g["end"], g["label"]) for g in self.timeline["generations"]]
        self.assertEqual(bands, [(1, 1.0, 8.0, "g1: 2x2, mb 4"), (2, 8.0, 22.0, "g2: 2x2, mb 4"),
                                 (3, 22.0, 30.0, "g3: 2x1, mb 4")])
        self.assertEqual([g["resume_step"] for g in self.timeline["generations"]], [-1, 100, 300])
        self.assertEqual(self.timeline["end"], 30.0)

    def test_events_are_marked_on_the_time_axis_by_kind(self):
        marks = [(m["t"], m["kind"], m["label"]) for m in self.timeline["marks"]]
        self.assertEqual(marks, [
            (5.0, "checkpoint", "checkpoint 100"),
            (6.0, "loss", "rank 1: signal 9"),
            (10.0, "morph", "morph 4.0 s"),
            (20.0, "notice", "notice: b"),
            (21.5, "checkpoint", "checkpoint 300"),
            (23.0, "morph", "morph 3.0 s"),
            (25.0, "machines", "b back"),
            (30.0, "stop", "training finished"),
        ])
        self.assertEqual([(m["start"], m["end"]) for m in self.timeline["morphs"]], [(6.0, 10.0), (20.0, 23.0)])

    def test_a_relaunch_from_an_older_checkpoint_shows_lost_and_recomputed_steps(self):
        rollbacks = self.timeline["rollbacks"]
        self.assertEqual(len(rollbacks), 1, rollbacks)  # the preemption resumed where it stopped
        r = rollbacks[0]
        self.assertEqual((r["generation"], r["resume_step"], r["last_step"], r["steps"]), (2, 100, 150, 50))
        # Step 100 was passed at 3.8 s (between 60 at 3 s and 110 at 4 s), 150 was the last at 5 s.
        self.assertAlmostEqual(r["lost"][0], 3.8)
        self.assertEqual(r["lost"][1], 5.0)
        # Generation 2 trains them again from its first step (10 s) to step 150 (11 s).
        self.assertEqual(r["recomputed"], (10.0, 11.0))

    def test_steps_are_series_on_the_same_axis(self):
        steps = self.timeline["steps"]
        self.assertEqual(steps["t"][:2], [2.0, 3.0])
        self.assertEqual(steps["step"], [10, 60, 110, 150, 101, 150, 200, 300, 301, 400])
        self.assertEqual(steps["generation"], [1, 1, 1, 1, 2, 2, 2, 2, 3, 3])

    def test_a_kill_all_without_a_loss_before_it_is_marked(self):
        events = [event(0, "launch", generation=1, resume_step=-1, plan=plan(2, 2)),
                  event(5, "kill_all", reason="the on-demand checkpoint did not finish in time")]
        marks = varuna_report.build_timeline(events, [])["marks"]
        self.assertEqual([(m["t"], m["kind"]) for m in marks], [(5.0, "loss")])

    def test_a_salvage_marks_its_loss_once_and_not_its_writers(self):
        def marks_of(events):
            return [(m["t"], m["kind"]) for m in varuna_report.build_timeline(events, [])["marks"]]
        launch = event(0, "launch", generation=1, resume_step=-1, plan=plan(2, 2))
        writers = [event(5.2, "worker_exited", rank=0, exit_code=77, signal=0, generation=1),
                   event(5.2, "worker_exited", rank=1, exit_code=76, signal=0, generation=1)]
        # The killed rank's exit first: it is the loss.
        self.assertEqual(marks_of([launch, event(5, "worker_exited", rank=2, exit_code=-1, signal=9, generation=1),
                                   event(5.1, "salvage_started", reason="rank 2 exited with a signal")] + writers),
                         [(5.0, "loss")])
        # A survivor's report first: the salvage is the loss.
        self.assertEqual(marks_of([launch, event(5, "salvage_started", reason="rank 0 lost a peer"),
                                   event(5.1, "worker_exited", rank=2, exit_code=-1, signal=9, generation=1)] + writers),
                         [(5.0, "loss")])

    def test_no_data_is_an_error(self):
        with self.assertRaises(ValueError):
            varuna_report.build_timeline([], [])


class CommandTest(unittest.TestCase):
    def test_writes_a_png_and_prints_its_path(self):
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp) / "state"
            state.mkdir()
            (state / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
            # The last line half written (a running job): skipped.
            (state / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in STEPS) + '{"unix_ms": 18')
            out = Path(tmp) / "pictures" / "job.png"
            r = subprocess.run([sys.executable, str(SOURCE / "scripts" / "varuna_report.py"), "--state_dir",
                                str(state), "--out", str(out)], capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.strip(), str(out))
            self.assertEqual(out.read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
            missing = subprocess.run([sys.executable, str(SOURCE / "scripts" / "varuna_report.py"), "--state_dir",
                                      str(Path(tmp) / "nowhere")], capture_output=True, text=True, timeout=60)
            self.assertEqual(missing.returncode, 2)
            self.assertIn("no event log at", missing.stderr)


if __name__ == "__main__":
    os.environ.setdefault("MPLBACKEND", "Agg")
    unittest.main()

#!/usr/bin/env python3
"""A run_varuna job's timeline as a picture.

    .venv/bin/python scripts/varuna_report.py --state_dir DIR [--out job.png]

Reads the job's state folder (run_varuna --state_dir): events.jsonl, what
happened (launches, notices, losses, morphs, checkpoints), and steps.jsonl,
its progress (a line a second: step, loss, samples/s; on a long job thinned
by the manager to stay under a few MB, with every generation's first and last
step kept, so the whole job is there, more coarsely). Draws, against the
time since the manager started: loss, samples/s and the step; each
generation's plan as a band (P x D, micro-batch); every event marked
(notices, losses, morphs with their duration, checkpoints, machine-list
changes, the stop); the steps a relaunch rolled back shaded where they were
lost (trained, then thrown away) and where they were trained again. Prints
the picture's path. Works on a job that is still running (a partial last line
is skipped).

The data extraction (build_timeline) is plain Python; matplotlib (in the
project's .venv, scripts/requirements.txt) is needed only to draw.
"""
import argparse
import json
import sys
from pathlib import Path

# Events drawn as marks, by kind: what they are called in the legend, colour.
MARK_KINDS = {
    "notice": ("preemption notice", "#d97706"),
    "loss": ("loss / failure", "#dc2626"),
    "morph": ("morph done", "#7c3aed"),
    "checkpoint": ("checkpoint complete", "#059669"),
    "checkpoint_failed": ("checkpoint failed", "#b91c1c"),
    "machines": ("machines changed", "#2563eb"),
    "restart": ("manager restarted", "#0f172a"),
    "stop": ("stop", "#475569"),
}


def read_jsonl(path):
    """The JSON objects of a .jsonl file; [] if it is missing. A line that is
    not JSON (the last one while the manager writes it) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _time_at_step(points, step):
    """When the job passed `step`, from (t, step) points of one generation in
    time order: interpolated between the points around it; the first point's
    time if it is before them, None if after."""
    if not points:
        return None
    if step <= points[0][1]:
        return points[0][0]
    for (t1, s1), (t2, s2) in zip(points, points[1:]):
        if s1 <= step <= s2:
            return t1 if s2 == s1 else t1 + (t2 - t1) * (step - s1) / (s2 - s1)
    return None


def _plan_label(generation, plan):
    return "g%d: %dx%d, mb %s" % (generation, plan.get("stages", 0), plan.get("replicas", 0),
                                  plan.get("chunk_size", "?"))


def build_timeline(events, steps):
    """The report's data, times in seconds since the first event (or step):

    generations: [{generation, start, end, stages, replicas, chunk_size, hosts, resume_step, label}]
    marks:       [{t, kind (MARK_KINDS), label}] in time order
    morphs:      [{start, end, cause}] (a morph's cause to its first step)
    steps:       {t, step, loss, samples_per_s, generation} lists
    rollbacks:   [{generation, resume_step, last_step, steps, lost: (t, t), recomputed: (t, t) or None}]
    end:         the last time anything happened
    """
    times = [e["unix_ms"] for e in events if "unix_ms" in e] + [s["unix_ms"] for s in steps if "unix_ms" in s]
    if not times:
        raise ValueError("no events and no steps: is this a run_varuna state folder?")
    t0 = min(times)

    def at(record):
        return (record["unix_ms"] - t0) / 1000.0

    events = sorted((e for e in events if "unix_ms" in e), key=lambda e: e["unix_ms"])
    steps = sorted((s for s in steps if "unix_ms" in s and "step" in s), key=lambda s: s["unix_ms"])
    end = (max(times) - t0) / 1000.0

    generations = []
    for e in events:
        if e.get("event") != "launch":
            continue
        if generations:
            generations[-1]["end"] = at(e)
        plan = e.get("plan") or {}
        generations.append({"generation": e.get("generation", len(generations) + 1), "start": at(e), "end": end,
                            "stages": plan.get("stages"), "replicas": plan.get("replicas"),
                            "chunk_size": plan.get("chunk_size"), "hosts": len(plan.get("hosts", [])),
                            "resume_step": e.get("resume_step", -1),
                            "label": _plan_label(e.get("generation", len(generations) + 1), plan)})
    # A generation ends at the stop, not at the end of the picture.
    stops = [at(e) for e in events if e.get("event") == "stop"]
    if generations and stops and stops[-1] >= generations[-1]["start"]:
        generations[-1]["end"] = stops[-1]

    marks, morphs = [], []
    failed_since_launch = False  # after a kill-all, the exits it causes are not marked
    loss_since_launch = False
    for e in events:
        kind, label, t = None, None, at(e)
        name = e.get("event")
        if name == "launch":
            failed_since_launch = loss_since_launch = False
        elif name == "preempt_notice":
            kind, label = "notice", "notice: %s" % e.get("host", "?")
        elif name == "host_lost":
            kind, label = "loss", "%s lost" % e.get("host", "?")
        elif name == "worker_hung":
            kind, label = "loss", "rank %s hung" % e.get("rank", "?")
        elif name == "hang":
            kind, label = "loss", "no progress"
        elif name == "launch_failed":
            kind, label = "loss", "launch failed"
        elif name == "worker_exited":
            code, signal = e.get("exit_code", 0), e.get("signal", 0)
            # 77: a salvage writer done; the rest of a salvage follows its loss.
            if code not in (0, 75, 77) and not failed_since_launch:
                kind = "loss"
                label = "rank %s: %s" % (e.get("rank", "?"), ("signal %d" % signal) if code < 0 else ("exit %d" % code))
        elif name == "salvage_started":
            if not loss_since_launch:  # a survivor's report was the first sign of the loss
                kind, label = "loss", "salvage: %s" % e.get("reason", "")[:40]
            failed_since_launch = True
        elif name == "kill_all":
            if not loss_since_launch:  # e.g. a checkpoint that did not finish in time
                kind, label = "loss", "kill all: %s" % e.get("reason", "")[:40]
            failed_since_launch = True
        elif name == "morph_complete":
            total = float(e.get("total_s", 0))
            morphs.append({"start": t - total, "end": t, "cause": e.get("cause", "")})
            kind, label = "morph", "morph %.1f s" % total
        elif name == "checkpoint_complete":
            kind, label = "checkpoint", "checkpoint %s" % e.get("step", "?")
        elif name == "checkpoint_failed":
            kind, label = "checkpoint_failed", "checkpoint %s failed" % e.get("step", "?")
        elif name in ("machine_list_changed", "host_back", "hosts_readmitted"):
            kind = "machines"
            label = {"machine_list_changed": "machine list changed", "host_back": "%s back" % e.get("host", "?"),
                     "hosts_readmitted": "hosts readmitted"}[name]
        elif name == "manager_restarted":
            kind, label = "restart", "manager restarted"
        elif name in ("stop_requested", "stop"):
            kind, label = "stop", e.get("reason", name)[:40]
        if kind:
            if kind == "loss":
                loss_since_launch = True
            marks.append({"t": t, "kind": kind, "label": label, "step": e.get("step")})

    series = {"t": [at(s) for s in steps], "step": [s["step"] for s in steps],
              "loss": [s.get("loss") for s in steps], "samples_per_s": [s.get("samples_per_s") for s in steps],
              "generation": [s.get("generation") for s in steps]}

    # Rollbacks: a launch resuming below the last step done rolls those steps back.
    rollbacks = []
    last_step, last_generation = None, None
    launches = [e for e in events if e.get("event") == "launch"]
    records = list(zip(series["t"], series["step"], series["generation"]))
    position = 0
    for launch in launches:
        t_launch = at(launch)
        while position < len(records) and records[position][0] <= t_launch:
            last_step, last_generation = records[position][1], records[position][2]
            position += 1
        resume = max(int(launch.get("resume_step", -1)), 0)
        if last_step is not None and last_step > resume:
            before = [(t, s) for t, s, g in records if g == last_generation and t <= t_launch]
            after = [(t, s) for t, s, g in records if g == launch.get("generation")]
            lost_from = _time_at_step(before, resume)
            lost_to = before[-1][0] if before else t_launch
            recomputed = None
            if after:
                reached = _time_at_step(after, last_step)
                recomputed = (after[0][0], reached if reached is not None else after[-1][0])
            rollbacks.append({"generation": launch.get("generation"), "resume_step": resume, "last_step": last_step,
                              "steps": last_step - resume,
                              "lost": (lost_from if lost_from is not None else lost_to, lost_to),
                              "recomputed": recomputed})
        last_step = resume if last_step is not None else None

    return {"t0_unix_ms": t0, "end": end, "generations": generations, "marks": marks, "morphs": morphs,
            "steps": series, "rollbacks": rollbacks}


def plot(timeline, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D

    steps = timeline["steps"]
    fig, (ax_loss, ax_rate, ax_step) = plt.subplots(3, 1, figsize=(12, 8.5), sharex=True,
                                                    gridspec_kw={"height_ratios": [3, 2, 2]})
    axes = (ax_loss, ax_rate, ax_step)
    band_colors = ["#e0f2fe", "#fef9c3", "#dcfce7", "#fce7f3", "#ede9fe", "#ffedd5"]
    for i, g in enumerate(timeline["generations"]):
        for ax in axes:
            ax.axvspan(g["start"], g["end"], color=band_colors[i % len(band_colors)], alpha=0.8, lw=0, zorder=0)
        ax_loss.text((g["start"] + g["end"]) / 2, 1.01, g["label"], transform=ax_loss.get_xaxis_transform(),
                     ha="center", va="bottom", fontsize=9)
    for m in timeline["morphs"]:
        for ax in axes:
            ax.axvspan(m["start"], m["end"], facecolor="none", edgecolor="#7c3aed", hatch="///", lw=0, alpha=0.5,
                       zorder=1)
    for r in timeline["rollbacks"]:
        for ax in axes:
            ax.axvspan(*r["lost"], color="#ef4444", alpha=0.25, lw=0, zorder=1)
            if r["recomputed"]:
                ax.axvspan(*r["recomputed"], color="#f97316", alpha=0.25, lw=0, zorder=1)
        ax_step.annotate("%d steps rolled back" % r["steps"], xy=(r["lost"][1], r["last_step"]), fontsize=8,
                         xytext=(4, 4), textcoords="offset points", color="#b91c1c")

    # The series, one line per generation (a rollback is a jump back, not a slope).
    by_generation = {}
    for t, s, loss, rate, g in zip(steps["t"], steps["step"], steps["loss"], steps["samples_per_s"],
                                   steps["generation"]):
        by_generation.setdefault(g, []).append((t, s, loss, rate))
    for points in by_generation.values():
        ts = [p[0] for p in points]
        ax_loss.plot(ts, [p[2] for p in points], color="#1e3a8a", lw=1.4, marker="." if len(ts) < 40 else None)
        ax_rate.plot(ts, [p[3] for p in points], color="#0f766e", lw=1.4, marker="." if len(ts) < 40 else None)
        ax_step.plot(ts, [p[1] for p in points], color="#334155", lw=1.4, marker="." if len(ts) < 40 else None)

    kinds_seen = []
    # Notices and losses say what they were (a few: a long job's would cover the picture).
    labelled = [m for m in timeline["marks"] if m["kind"] in ("notice", "loss", "restart")][:12]
    for mark in timeline["marks"]:
        name, color = MARK_KINDS[mark["kind"]]
        if mark["kind"] == "checkpoint" and mark.get("step") is not None:
            ax_step.plot([mark["t"]], [mark["step"]], marker="v", color=color, markersize=7, zorder=4)
        else:
            for ax in axes:
                ax.axvline(mark["t"], color=color, lw=1.1, ls="--" if mark["kind"] == "morph" else "-", zorder=3)
        if mark in labelled:
            ax_loss.text(mark["t"], 0.97, " " + mark["label"], transform=ax_loss.get_xaxis_transform(), rotation=90,
                         va="top", ha="right", fontsize=8, color=color)
        if mark["kind"] not in kinds_seen:
            kinds_seen.append(mark["kind"])

    ax_loss.set_ylabel("loss")
    ax_rate.set_ylabel("samples/s")
    ax_step.set_ylabel("step")
    ax_step.set_xlabel("seconds since the manager started")
    ax_step.set_xlim(0, max(timeline["end"], 1) * 1.01)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_axisbelow(True)
    handles = []
    for kind in kinds_seen:
        name, color = MARK_KINDS[kind]
        if kind == "checkpoint":
            handles.append(Line2D([], [], color=color, marker="v", ls="none", label=name))
        else:
            handles.append(Line2D([], [], color=color, ls="--" if kind == "morph" else "-", label=name))
    if timeline["morphs"]:
        handles.append(Patch(facecolor="none", edgecolor="#7c3aed", hatch="///", label="morph (cause to first step)"))
    if timeline["rollbacks"]:
        handles.append(Patch(color="#ef4444", alpha=0.35, label="steps lost (rolled back)"))
        handles.append(Patch(color="#f97316", alpha=0.35, label="steps recomputed"))
    handles.append(Patch(color=band_colors[0], label="generation: stages x replicas, micro-batch"))
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def title_for(state_dir, timeline):
    state = {}
    try:
        state = json.loads((Path(state_dir) / "state.json").read_text())
    except (OSError, ValueError):
        pass
    steps = timeline["steps"]["step"]
    return "run_varuna job '%s': %d generation(s), %d morph(s), %d steps rolled back, last step %s, %.0f s" % (
        state.get("job", Path(state_dir).name), len(timeline["generations"]), len(timeline["morphs"]),
        sum(r["steps"] for r in timeline["rollbacks"]), steps[-1] if steps else "none", timeline["end"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state_dir", required=True, help="the job's state folder (run_varuna --state_dir)")
    parser.add_argument("--out", default=None, help="the PNG to write (default: STATE_DIR/timeline.png)")
    parser.add_argument("--title", default=None, help="the picture's title (default: the job and its figures)")
    args = parser.parse_args(argv)
    state_dir = Path(args.state_dir)
    events_path = state_dir / "events.jsonl"
    if not events_path.exists():
        print("varuna_report.py: no event log at %s (is --state_dir the one run_varuna uses?)" % events_path,
              file=sys.stderr)
        return 2
    try:
        timeline = build_timeline(read_jsonl(events_path), read_jsonl(state_dir / "steps.jsonl"))
    except ValueError as e:
        print("varuna_report.py: %s: %s" % (state_dir, e), file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("varuna_report.py: matplotlib is missing: run it with the project's .venv/bin/python "
              "(scripts/setup.sh installs scripts/requirements.txt)", file=sys.stderr)
        return 2
    out = plot(timeline, args.out or state_dir / "timeline.png", args.title or title_for(state_dir, timeline))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

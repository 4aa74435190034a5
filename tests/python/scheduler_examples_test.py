#!/usr/bin/env python3
"""The scheduler examples in config/slurm and config/kubernetes stay usable:
the batch scripts and the containers' shell commands parse (bash -n / sh -n),
every run_varuna and varuna_agent option they use is one the built binaries
accept (their --help), the manifests are valid YAML with what the deployment
relies on and pass Kubernetes' own schema, strictly. (No Slurm or Kubernetes cluster runs here: docs/deployment.md.)

    VARUNA_BUILD_DIR=build .venv/bin/python tests/python/scheduler_examples_test.py
"""
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

SOURCE = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VARUNA_BUILD_DIR", SOURCE / "build")) / "bin"
SLURM = SOURCE / "config" / "slurm"
KUBERNETES = SOURCE / "config" / "kubernetes"
PROGRAMS = ("run_varuna", "varuna_agent")
# The oldest Kubernetes the manifests are written for (docs/deployment.md):
# a field newer than it fails the schema check.
KUBERNETES_VERSION = "1.30.0"


def accepted_options(program):
    text = subprocess.run([str(BIN / program), "--help"], capture_output=True, text=True, timeout=30).stdout
    options = set(re.findall(r"(--[a-z][a-z0-9_]*)", text))
    assert len(options) > 5, (program, text[:500])
    return options


def invocations(script):
    """(program, [options]) of every run_varuna / varuna_agent command in a
    shell text: continuation lines joined; the options up to ` -- ` (the
    training program's own arguments follow)."""
    logical = script.replace("\\\n", " ")
    found = []
    for line in logical.splitlines():
        for program in PROGRAMS:
            at = re.search(r"(?:^|[\s'\"])" + program + r"\s", line)
            if not at:
                continue
            rest = line[at.end():].split(" -- ")[0]
            found.append((program, re.findall(r"(?<![\w-])(--[a-z][a-z0-9_]*)(?![\w-])", rest)))
    return found


def check_options(where, script, accepted):
    used = invocations(script)
    for program, options in used:
        unknown = [o for o in options if o not in accepted[program]]
        assert not unknown, "%s: %s does not accept %s" % (where, program, unknown)
    return used


def test_slurm_scripts(accepted):
    scripts = sorted(SLURM.glob("*.sbatch"))
    assert [s.name for s in scripts] == ["varuna-agents.sbatch", "varuna-allocation.sbatch", "varuna-manager.sbatch"]
    programs = set()
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
        text = script.read_text()
        assert "#SBATCH --requeue" in text, script.name  # preempted or stopped, it comes back
        programs |= {p for p, _ in check_options(script.name, text, accepted)}
    assert programs == set(PROGRAMS), programs
    agents = (SLURM / "varuna-agents.sbatch").read_text()
    # The agent reads the partition's GraceTime itself (unit-tested in manager_runtime_test).
    assert "--sigterm_notice_s auto" in agents and "--join_token_file" in agents


def check_schema(documents):
    """Every manifest against Kubernetes' own OpenAPI schema (the pinned
    kubernetes-validate carries it), strictly: a misspelt or misplaced field
    (which a cluster would reject, or worse, drop silently) fails here."""
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    # The validator is live: the same Deployment with one field misspelt is refused.
    broken = copy.deepcopy(next(d for d in documents if d["kind"] == "Deployment"))
    pod = broken["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds", 30)
    try:
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
        raise SystemExit("a misspelt field passed the schema check")
    except kubernetes_validate.ValidationError:
        pass


def test_kubernetes_manifests(accepted):
    documents = [d for d in yaml.safe_load_all((KUBERNETES / "varuna.yaml").read_text()) if d]
    check_schema(documents)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents}
    assert kinds == {("Service", "varuna-manager"), ("Deployment", "varuna-manager"), ("Service", "varuna-hosts"),
                     ("StatefulSet", "varuna-host")}, kinds
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in documents}
    manager = by_name[("Deployment", "varuna-manager")]
    assert manager["spec"]["replicas"] == 1 and manager["spec"]["strategy"]["type"] == "Recreate"
    hosts = by_name[("StatefulSet", "varuna-host")]
    assert hosts["spec"]["serviceName"] == "varuna-hosts"
    assert by_name[("Service", "varuna-hosts")]["spec"]["clusterIP"] == "None"
    programs = set()
    for workload in (manager, hosts):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] != 0, workload["metadata"]["name"]  # never root
        for container in pod["containers"]:
            command = container["args"][0]
            assert container["command"] == ["sh", "-c"]
            subprocess.run(["sh", "-n", "-c", command], check=True)
            programs |= {p for p, _ in check_options(container["name"], command, accepted)}
    assert programs == set(PROGRAMS), programs
    agent = hosts["spec"]["template"]["spec"]["containers"][0]
    # The join credential from the Secret into VARUNA_JOIN_TOKEN (the agent
    # takes it out of its environment once read); the agents' pods mount the
    # checkpoints only, never the manager's state folder with the job's secret.
    token = [e for e in agent["env"] if e["name"] == "VARUNA_JOIN_TOKEN"]
    assert token and token[0]["valueFrom"]["secretKeyRef"]["name"] == "varuna-join", agent["env"]
    assert all(m.get("subPath") == "checkpoints" for m in agent["volumeMounts"]), agent["volumeMounts"]


def main():
    accepted = {p: accepted_options(p) for p in PROGRAMS}
    # The parser of this test finds what it must (and would see a typo).
    assert invocations("x && varuna_agent --join a:1 \\\n  --slots 2 -- ./t --steps 3") == [
        ("varuna_agent", ["--join", "--slots"])]
    try:
        check_options("self-test", "run_varuna --no_such_option", accepted)
        raise SystemExit("an unknown option was not caught")
    except AssertionError:
        pass
    test_slurm_scripts(accepted)
    test_kubernetes_manifests(accepted)
    print("scheduler examples: ok")


if __name__ == "__main__":
    sys.exit(main())

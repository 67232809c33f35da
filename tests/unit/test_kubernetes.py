"""deploy/kubernetes/: valid against the Kubernetes schemas (offline), and saying what the docs say.

The schemas come with `kubernetes-validate` (a test extra); without it the
schema check is skipped with the reason. The commands in the manifests are
parsed by flodl-zmq's own parser, so a renamed flag fails here, not in a pod;
the controller's is compared with docker-compose.yml's, which the cluster
tests run (killed and started again in tests/cluster/test_controller_restart.py).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from flodl_zmq.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
PORTS = {"control": 7300, "data": 7301, "broadcast": 7302, "join": 7303}


def resources() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def container(resource: dict) -> dict:
    (c,) = resource["spec"]["template"]["spec"]["containers"]
    return c


def secret_refs(c: dict) -> dict[str, str]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}


def parsed(c: dict):
    """The container's command line through flodl-zmq's parser ($(VAR) references filled in)."""
    args = [re.sub(r"\$\((\w+)\)", "0", a) for a in c["args"]]
    assert args[0] == "flodl-zmq"
    return build_parser().parse_args(args[1:])


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (pip install -e '.[test]') is not installed")
    docs = resources()
    assert docs
    for (kind, name), doc in docs.items():
        try:
            kv.validate(doc, kv.latest_version(), strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{kind}/{name}: {exc.message} at {'.'.join(map(str, exc.path))}")


def test_the_controller_is_a_job_of_one_pod_behind_a_service_on_its_four_ports():
    docs = resources()
    job, service = docs[("Job", "flodl-controller")], docs[("Service", "flodl-controller")]
    assert job["spec"]["completions"] == 1 and job["spec"]["parallelism"] == 1
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == PORTS
    assert service["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]
    c = container(job)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == PORTS
    args = parsed(c)
    assert args.command == "controller" and args.bind == "0.0.0.0:7300" and args.argv[0] == "--"
    # The key and the CURVE secret from Secrets, never written in the manifest.
    assert secret_refs(c) == {"FLODL_KEY": "flodl-key", "FLODL_CURVE_SECRET": "flodl-curve-controller"}


def test_a_restarted_controller_pod_resumes_from_checkpoints_on_a_claim_and_is_ready_once_it_listens():
    docs = resources()
    job = docs[("Job", "flodl-controller")]
    pod = job["spec"]["template"]["spec"]
    # A dead container is restarted (a pod replaced) a stated number of times; a completed one is not.
    assert pod["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] >= 1
    c = container(job)
    args = parsed(c)
    assert args.resume == "auto"
    (mount,) = c["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = docs[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    # What a restart reads (the checkpoints) and what the run leaves (events.jsonl) are on the claim.
    for path in (args.checkpoint_dir, args.run_dir):
        assert Path(path).is_relative_to(mount["mountPath"]), (path, mount)
    # The Service sends the agents to the pod once its join window listens.
    assert c["readinessProbe"]["tcpSocket"]["port"] == "join"
    # The world cannot grow past what the agents' Job runs.
    assert args.max_ranks == int(args.target_ranks)


def test_the_kubernetes_controller_runs_the_compose_controller_s_restartable_command():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["controller"]
    theirs = build_parser().parse_args(shlex.split(compose["command"])[1:])
    ours = parsed(container(resources()[("Job", "flodl-controller")]))
    for flag in ("checkpoint_dir", "resume", "run_dir", "argv"):
        assert getattr(ours, flag) == getattr(theirs, flag), flag
    assert theirs.max_ranks == int(theirs.target_ranks)  # each caps the world at what it runs
    # Compose restarts a controller that failed (a completed one exits 0) onto the same volume.
    assert compose["restart"].startswith("on-failure")
    assert any(v.split(":")[1] == str(Path(theirs.checkpoint_dir).parent) for v in compose["volumes"])


def test_the_agents_dial_the_service_with_the_same_image_key_and_a_gpu_each():
    docs = resources()
    job = docs[("Job", "flodl-agents")]
    c, controller = container(job), container(docs[("Job", "flodl-controller")])
    assert c["image"] == controller["image"]
    args = parsed(c)
    assert args.command == "agent" and args.controller == "flodl-controller:7300"
    assert args.script.split() == parsed(controller).argv[1:3]  # it agrees to run the controller's program
    # The agents get the controller's public key only, never its secret.
    assert secret_refs(c) == {"FLODL_KEY": "flodl-key", "FLODL_CURVE_SERVER": "flodl-curve-public"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert job["spec"]["completions"] == int(parsed(controller).target_ranks)


def test_the_agents_re_dial_a_restarted_controller_and_one_failed_host_leaves_the_others_running():
    job = resources()[("Job", "flodl-agents")]
    args = parsed(container(job))
    # Long enough for a controller pod to be rescheduled, attach its claim and resume (docs/operations.md).
    assert args.controller_grace_s >= 600
    assert job["spec"]["backoffLimitPerIndex"] == 0 and "backoffLimit" not in job["spec"]

"""deploy/kubernetes/: valid against the Kubernetes schemas (offline), and saying what the docs say.

The schemas come with `kubernetes-validate` (a test extra); without it the
schema check is skipped with the reason. The commands in the manifests are
parsed by flodl-zmq's own parser, so a renamed flag fails here, not in a pod.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from flodl_zmq.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
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


def test_the_controller_is_a_deployment_behind_a_service_on_its_four_ports():
    docs = resources()
    deployment, service = docs[("Deployment", "flodl-controller")], docs[("Service", "flodl-controller")]
    assert deployment["spec"]["replicas"] == 1
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == PORTS
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    c = container(deployment)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == PORTS
    args = parsed(c)
    assert args.command == "controller" and args.bind == "0.0.0.0:7300" and args.argv[0] == "--"
    # The key and the CURVE secret from Secrets, never written in the manifest.
    assert secret_refs(c) == {"FLODL_KEY": "flodl-key", "FLODL_CURVE_SECRET": "flodl-curve-controller"}


def test_the_agents_dial_the_service_with_the_same_image_key_and_a_gpu_each():
    docs = resources()
    job = docs[("Job", "flodl-agents")]
    c, controller = container(job), container(docs[("Deployment", "flodl-controller")])
    assert c["image"] == controller["image"]
    args = parsed(c)
    assert args.command == "agent" and args.controller == "flodl-controller:7300"
    assert args.script.split() == parsed(controller).argv[1:3]  # it agrees to run the controller's program
    # The agents get the controller's public key only, never its secret.
    assert secret_refs(c) == {"FLODL_KEY": "flodl-key", "FLODL_CURVE_SERVER": "flodl-curve-public"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert job["spec"]["completions"] == int(parsed(controller).target_ranks)

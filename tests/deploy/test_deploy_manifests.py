"""The Kubernetes manifests in deploy/, checked without a cluster: core objects against Kubernetes'
own JSON schemas (kubernetes-validate, strict: an unknown or misspelt field fails), the RayService's
pod templates likewise and its Serve config against Ray's own schema, and what ties them to the
server: the image, GPU requests, /health readiness probes, LAYERSTREAM_* names that are real flags,
and an autoscaling metric that /metrics really exports."""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

from server.cli import add_arguments  # noqa: E402
from server.metrics import ServerMetrics  # noqa: E402
from server.launch import parse_flags  # noqa: E402
from server.ray_options import ReplicaOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33"  # a current cluster; the schemas of every later release ship in the package too


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(path: Path) -> dict[str, dict]:
    return {d["kind"]: d for d in documents(path)}


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def as_pod_template(template: dict) -> dict:
    """A pod template embedded in a custom resource, as the core object that holds one."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}


PLAIN = DEPLOY / "kubernetes" / "layerstream.yaml"
RAYSERVICE = DEPLOY / "kuberay" / "rayservice.yaml"
ADAPTER = DEPLOY / "kubernetes" / "prometheus-adapter-values.yaml"


def ray_pod_templates(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return templates


def serve_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {a.dest for a in parser._actions if a.option_strings}


def test_plain_manifests_match_the_kubernetes_schemas():
    docs = documents(PLAIN)
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for doc in docs:
        validate(doc)


def test_rayservice_pod_templates_match_the_kubernetes_schemas():
    rayservice = by_kind(RAYSERVICE)["RayService"]
    assert rayservice["apiVersion"] == "ray.io/v1"
    for template in ray_pod_templates(rayservice).values():
        validate(as_pod_template(template))


@pytest.mark.parametrize("damage", ["misspelt field", "wrong type", "missing container name"])
def test_the_schema_check_catches_mistakes(damage):
    deployment = copy.deepcopy(by_kind(PLAIN)["Deployment"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    if damage == "misspelt field":
        container["readinesProbe"] = container.pop("readinessProbe")
    elif damage == "wrong type":
        container["ports"][0]["containerPort"] = "8000"
    else:
        del container["name"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


def _serving_containers():
    deployment = by_kind(PLAIN)["Deployment"]
    yield "deployment", deployment["spec"]["template"]["spec"]["containers"][0]
    for name, template in ray_pod_templates(by_kind(RAYSERVICE)["RayService"]).items():
        if name != "head":
            yield f"ray worker group {name}", template["spec"]["containers"][0]


def test_serving_pods_use_the_image_one_gpu_and_a_health_probe():
    seen = 0
    for where, container in _serving_containers():
        seen += 1
        assert container["image"].split(":")[0] == "layerstream", where
        for need in ("requests", "limits"):
            assert container["resources"][need]["nvidia.com/gpu"] == "1", where
        probe = container["readinessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert probe["path"] == "/health" and ports.get(probe["port"], probe["port"]) == 8000, where
    assert seen == 2
    head = ray_pod_templates(by_kind(RAYSERVICE)["RayService"])["head"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]  # replicas never land on the head


def test_plain_deployment_is_configured_by_real_flags_and_reachable():
    objs = by_kind(PLAIN)
    deployment, service, hpa = objs["Deployment"], objs["Service"], objs["HorizontalPodAutoscaler"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    flags = serve_flags()
    for env in container["env"]:
        assert env["name"].startswith("LAYERSTREAM_")
        assert env["name"].removeprefix("LAYERSTREAM_").lower() in flags, f"{env['name']} is no serve flag"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in container["ports"]}
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}


def test_autoscaling_metric_is_a_gauge_the_server_exports():
    hpa = by_kind(PLAIN)["HorizontalPodAutoscaler"]
    (metric,) = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    metrics = ServerMetrics("m")
    exported = re.findall(r"^# TYPE (\S+) gauge$", metrics.render().decode(), re.M)
    assert metric in exported
    (rule,) = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    assert rule["seriesQuery"].split("{")[0] == metric and rule["name"]["as"] == metric


def test_rayservice_serve_config_builds_the_layerstream_app():
    ray = pytest.importorskip("ray")
    from ray.serve.schema import ServeDeploySchema

    import server.ray_serve

    rayservice = by_kind(RAYSERVICE)["RayService"]
    config = ServeDeploySchema.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    (app,) = config.applications
    module, _, name = app.import_path.partition(":")
    assert module == "server.ray_serve" and getattr(server.ray_serve, name) is server.ray_serve.app_builder
    options = ReplicaOptions.from_namespace(parse_flags(app.args))
    assert options.num_gpus == 1 and options.autoscaling
    # The cluster runs the Ray that the `ray` extra pins, which is the one installed here.
    pinned = re.search(r'"ray\[serve\]==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == pinned == ray.__version__

"""The Kubernetes deployment, checked without Kubernetes or Docker: the RayService manifest and
its public Service (deploy/kuberay/rayservice.yaml), the local Serve config
(deploy/serve-local.yaml) and the Dockerfile every pod runs.

Each check uses the parser the real system runs, where one is importable: Ray's
`ServeDeploySchema` (what `serve deploy` and KubeRay's operator hand to Serve), Serve's
`AutoscalingConfig` (which imports the policy), `TandemConfig.from_dict` (what `app_builder`
does with `args`), and the Ray autoscaler's own reading of a KubeRay worker group (its Ray
resources, from rayStartParams and the container limits). KubeRay's CRD is not available here:
the manifest's field names are checked against KubeRay's API reference (v1.6), copied below.
"""

from __future__ import annotations

import inspect
import json
import re
import shlex
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray._common.constants import HEAD_NODE_RESOURCE_NAME
from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema
from ray.util import accelerators

from cluster.config import CLUSTER_SECRET_ENV, TandemConfig
from cluster.config_parsing import ConfigError
from cluster.serve.app import GRPC_SERVICER_FUNCTIONS, app_builder

REPO_ROOT = Path(__file__).resolve().parents[2]
RAYSERVICE = REPO_ROOT / "deploy" / "kuberay" / "rayservice.yaml"
SERVE_LOCAL = REPO_ROOT / "deploy" / "serve-local.yaml"
NODES = REPO_ROOT / "deploy" / "placement" / "nodes.yaml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
GRPC_PORT = 9000
"""The public gRPC API at the default door: the router replicas' own server."""
HTTP_PORT = 8000
"""The OpenAI-compatible API at the default door."""
PROXY_GRPC_PORT = 9001
"""The same gRPC API through Serve's proxy: the second door."""
PROXY_HTTP_PORT = 8001
"""The same OpenAI-compatible API through Serve's HTTP proxy (which KubeRay also probes)."""
SIDES = ("router", "drafter", "verifier", "suffix")
DEPLOYMENTS = {
    "router": "Router", "drafter": "Drafter", "verifier": "Verifier", "suffix": "SuffixDrafter",
}  # fmt: skip
POLICY_PATH = "cluster.serve.autoscaling:scale_on_load"

# Field names of KubeRay's ray.io/v1 types (API reference, v1.6), for the fields this manifest
# may use: a misspelt or invented field is dropped by the API server without a word.
RAYSERVICE_SPEC_FIELDS = {
    "serveConfigV2", "rayClusterConfig", "serveService", "upgradeStrategy",
    "excludeHeadPodFromServeSvc", "rayClusterDeletionDelaySeconds",
}  # fmt: skip
RAYCLUSTER_SPEC_FIELDS = {
    "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "authOptions",
    "gcsFaultToleranceOptions", "headGroupSpec", "workerGroupSpecs", "headServiceAnnotations",
    "suspend", "managedBy",
}  # fmt: skip
HEAD_GROUP_FIELDS = {"template", "headService", "enableIngress", "rayStartParams", "serviceType"}
WORKER_GROUP_FIELDS = {
    "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds",
    "rayStartParams", "template", "scaleStrategy", "numOfHosts", "suspend",
}  # fmt: skip
AUTH_OPTIONS_FIELDS = {"mode", "secretName", "enableK8sTokenAuth"}
GCS_FT_FIELDS = {"redisAddress", "redisPassword", "redisUsername", "externalStorageNamespace"}
AUTOSCALER_OPTIONS_FIELDS = {
    "resources", "image", "imagePullPolicy", "securityContext", "idleTimeoutSeconds",
    "upscalingMode", "env", "envFrom", "volumeMounts",
}  # fmt: skip
DEPRECATED_THRESHOLDS = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}


def manifest_documents() -> list[dict[str, Any]]:
    """The manifest's objects: the RayService, then the default door's Service (secrets are
    created apart: see the file's header)."""
    documents = [dict(d) for d in yaml.safe_load_all(RAYSERVICE.read_text()) if d]
    assert [(d["apiVersion"], d["kind"]) for d in documents] == [
        ("ray.io/v1", "RayService"), ("v1", "Service"),
    ], "the RayService and its public Service; secrets are created apart"  # fmt: skip
    return documents


def load_rayservice() -> dict[str, Any]:
    return manifest_documents()[0]


def public_service() -> dict[str, Any]:
    return manifest_documents()[1]


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return dict(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))


def the_app(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    return dict(app)


def groups(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {group["groupName"]: group for group in cluster["workerGroupSpecs"]}


def pod_specs(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    heads = [cluster["headGroupSpec"]["template"]["spec"]]
    return heads + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]


@pytest.mark.parametrize("source", ["rayservice", "serve-local"])
def test_serve_configs_pass_serves_schema_and_build_a_usable_tandem_config(source: str) -> None:
    data = (
        serve_config(load_rayservice())
        if source == "rayservice"
        else yaml.safe_load(SERVE_LOCAL.read_text())
    )
    schema = ServeDeploySchema.model_validate(data)
    assert schema.grpc_options.port == PROXY_GRPC_PORT  # Serve's proxies: the second door
    assert schema.http_options.port == PROXY_HTTP_PORT  # the OpenAI-compatible API
    assert schema.grpc_options.grpc_servicer_functions == list(GRPC_SERVICER_FUNCTIONS)
    app = the_app(data)
    assert app["import_path"] == "cluster.serve.app:app_builder" and callable(app_builder)
    assert app["route_prefix"] == "/", "OpenAI clients expect the base URL http://HOST:PORT/v1"
    config = TandemConfig.from_dict(app["args"])
    config.auth.check_usable()  # what build_app does first: someone can call the service
    assert config.app_name == app["name"], "the registry is named after the Serve app"
    assert config.proxy_grpc_port == schema.grpc_options.port
    # The default door: the routers' own servers, on the ports the proxies leave free.
    assert (config.front.grpc_port, config.front.http_port) == (GRPC_PORT, HTTP_PORT)
    assert set(DEPLOYMENTS.values()) >= {d["name"] for d in app.get("deployments", [])}


def test_the_local_config_says_that_authentication_is_off_and_why() -> None:
    args = the_app(yaml.safe_load(SERVE_LOCAL.read_text()))["args"]
    assert args["auth"] == {"enabled": False}
    assert "local development only" in SERVE_LOCAL.read_text().lower()
    assert TandemConfig.from_dict(args).models.preset == "tiny"


def test_the_rayservice_serves_tenants_and_keeps_the_cluster_secret_out_of_the_manifest() -> None:
    rayservice = load_rayservice()
    args = the_app(serve_config(rayservice))["args"]
    config = TandemConfig.from_dict(args)
    assert config.auth.enabled and config.auth.tenants
    assert "cluster_secret" not in args
    for pod in pod_specs(rayservice):
        env = {e["name"]: e for e in pod["containers"][0].get("env", [])}
        assert env[CLUSTER_SECRET_ENV]["valueFrom"]["secretKeyRef"]["name"] == "tandem-secrets"
    images = {pod["containers"][0]["image"] for pod in pod_specs(rayservice)}
    assert len(images) == 1, "every group must run the same code and model paths"


def test_drafters_and_verifiers_scale_on_load_with_a_policy_serve_can_instantiate() -> None:
    app = the_app(serve_config(load_rayservice()))
    overrides = {d["name"]: d for d in app["deployments"]}
    for name in ("Drafter", "Verifier", "SuffixDrafter"):
        autoscaling = AutoscalingConfig(**overrides[name]["autoscaling_config"])
        assert autoscaling.policy.policy_function == POLICY_PATH
        # Serve passes policy_kwargs only to a class, instantiated once (Ray 2.60's
        # autoscaling_state._resolve_policy_callable): do what it does.
        policy = autoscaling.policy.get_policy()
        assert inspect.isclass(policy)
        policy(**autoscaling.policy.policy_kwargs)
        assert 1 <= autoscaling.min_replicas <= autoscaling.max_replicas
    router = AutoscalingConfig(**overrides["Router"]["autoscaling_config"])
    assert router.policy.is_default_policy_function()  # request-based: it is the ingress
    assert (
        router.get_target_ongoing_requests()
        <= TandemConfig.from_dict(app["args"]).api.max_running_requests
    )


def test_each_side_fits_exactly_one_worker_group_with_its_own_accelerator() -> None:
    rayservice = load_rayservice()
    app = the_app(serve_config(rayservice))
    config = TandemConfig.from_dict(app["args"])
    overrides = {d["name"]: d for d in app["deployments"]}
    resources = {
        name: _get_ray_resources_from_group_spec(group, is_head=False)
        for name, group in groups(rayservice).items()
    }
    head = _get_ray_resources_from_group_spec(
        rayservice["spec"]["rayClusterConfig"]["headGroupSpec"], is_head=True
    )
    assert head["CPU"] == 0, "no replica on the head"
    homes: dict[str, str] = {}
    for side in SIDES:
        options = getattr(config, side).ray_actor_options()
        fits = [name for name, offered in resources.items() if _fits(options, offered)]
        assert len(fits) == 1, f"{side} fits {fits}"
        homes[side] = fits[0]
        group = groups(rayservice)[fits[0]]
        per_pod = min(resources[fits[0]][key] // amount for key, amount in _demand(options).items())
        limits = AutoscalingConfig(**overrides[DEPLOYMENTS[side]]["autoscaling_config"])
        assert limits.max_replicas <= group["maxReplicas"] * per_pod
        assert limits.min_replicas <= group["minReplicas"] * per_pod
    assert len(set(homes.values())) == len(SIDES)
    gpu_sides = {side: getattr(config, side) for side in ("drafter", "verifier")}
    known = {v for k, v in vars(accelerators).items() if k.startswith("NVIDIA_")}
    assert {g.accelerator_type for g in gpu_sides.values()} <= known
    assert gpu_sides["drafter"].accelerator_type != gpu_sides["verifier"].accelerator_type
    selectors = [
        groups(rayservice)[homes[side]]["template"]["spec"]["nodeSelector"] for side in gpu_sides
    ]
    assert selectors[0] != selectors[1]
    for side in gpu_sides:
        spec = groups(rayservice)[homes[side]]["template"]["spec"]
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])


def _demand(options: dict[str, Any]) -> dict[str, float]:
    """What one replica asks Ray for, as resource names (accelerator_type: as Ray spells it)."""
    demand = {
        "CPU": options["num_cpus"],
        "GPU": options["num_gpus"],
        **options.get("resources", {}),
    }
    if options.get("accelerator_type"):
        demand[f"accelerator_type:{options['accelerator_type']}"] = 0.001
    return {key: amount for key, amount in demand.items() if amount > 0}


def _fits(options: dict[str, Any], offered: Mapping[str, float]) -> bool:
    return all(offered.get(key, 0) >= amount for key, amount in _demand(options).items())


def declared_resources(group: Mapping[str, Any]) -> dict[str, float]:
    """The custom resources a group's pods advertise: its rayStartParams `resources` as `ray
    start` reads it. KubeRay puts `--resources=<value>` in the pod's shell command, so the shell
    drops the outer quotes and the escapes, and `ray start` parses what is left as JSON."""
    value = group.get("rayStartParams", {}).get("resources")
    if value is None:
        return {}
    (argument,) = shlex.split(value)
    resources = json.loads(argument)
    assert isinstance(resources, dict)
    return {str(name): float(amount) for name, amount in resources.items()}


def test_every_resource_a_side_asks_for_is_declared_by_one_worker_group() -> None:
    # A replica asking for a custom resource that no group declares stays pending for good:
    # Ray's autoscaler has no group to add a pod of.
    rayservice = load_rayservice()
    config = TandemConfig.from_dict(the_app(serve_config(rayservice))["args"])
    declared = {name: declared_resources(group) for name, group in groups(rayservice).items()}
    for name, group in groups(rayservice).items():
        assert declared[name], f"group {name} declares no node type"
        # The shell's reading agrees with the Ray autoscaler's own reading of the field.
        autoscaler = _get_ray_resources_from_group_spec(group, is_head=False)
        assert {key: autoscaler[key] for key in declared[name]} == declared[name]
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert declared_resources(head) == {}, "no node type on the head: it runs no replica"
    for side in SIDES:
        asked = getattr(config, side).resources
        assert asked, f"{side} asks for no node type, so it may land on any pod"
        homes = [
            name
            for name, offered in declared.items()
            if all(offered.get(key, 0) >= amount for key, amount in asked.items())
        ]
        assert len(homes) == 1, f"{side} asks for {asked}; groups declaring it: {homes}"


def test_the_local_node_types_are_the_rayservices() -> None:
    # deploy/placement/nodes.yaml (`make demo-nodes`) places each side by the same custom
    # resource as the RayService, so what the demo checks on one machine is what the pods
    # advertise; its router goes to the head, which every Ray cluster has.
    local = TandemConfig.from_yaml(NODES)
    rayservice = load_rayservice()
    service = TandemConfig.from_dict(the_app(serve_config(rayservice))["args"])
    declared = {key for group in groups(rayservice).values() for key in declared_resources(group)}
    for side in ("drafter", "verifier"):
        group = getattr(local, side)
        assert set(group.resources) == {f"tandem_{side}_node"}
        assert set(group.resources) == set(getattr(service, side).resources)
        assert set(group.resources) <= declared
        # A share of a node: all the demo's replicas of a side fit on one node advertising 1.
        assert all(0 < amount <= 1 / group.num_replicas for amount in group.resources.values())
    assert set(local.router.resources) == {HEAD_NODE_RESOURCE_NAME}


def container_ports(pod: Mapping[str, Any]) -> dict[str, int]:
    """A pod's first container's ports by name."""
    return {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}


def test_serves_proxies_are_the_second_door_on_ports_9001_and_8001() -> None:
    spec = load_rayservice()["spec"]
    assert spec["serveService"]["metadata"]["name"] == "tandem-proxy"
    ports = spec["serveService"]["spec"]["ports"]
    assert [(p["port"], p["targetPort"]) for p in ports] == [
        (PROXY_GRPC_PORT, PROXY_GRPC_PORT),
        (PROXY_HTTP_PORT, PROXY_HTTP_PORT),
    ]
    assert serve_config(load_rayservice())["http_options"]["host"] == "0.0.0.0"
    for pod in pod_specs(load_rayservice()):
        named = container_ports(pod)
        # KubeRay probes a worker's proxy (/-/healthz) on the container port named `serve`.
        assert named["serve"] == PROXY_HTTP_PORT and named["grpc-proxy"] == PROXY_GRPC_PORT


def test_the_default_door_is_a_service_over_the_router_pods_own_servers() -> None:
    rayservice = load_rayservice()
    front = TandemConfig.from_dict(the_app(serve_config(rayservice))["args"]).front
    assert (front.grpc_port, front.http_port) == (GRPC_PORT, HTTP_PORT)
    assert front.host == "0.0.0.0"  # the pod's interfaces, where the Service reaches it
    router = groups(rayservice)["router"]
    named = container_ports(router["template"]["spec"])
    assert named["grpc"] == front.grpc_port and named["http"] == front.http_port
    for name, group in groups(rayservice).items():  # only the router pods serve them
        if name != "router":
            assert {"grpc", "http"}.isdisjoint(container_ports(group["template"]["spec"]))
    service = public_service()
    assert service["metadata"]["name"] == "tandem"
    assert service["spec"]["selector"] == {
        "ray.io/group": router["groupName"], "ray.io/node-type": "worker",
    }  # fmt: skip
    ports = {p["targetPort"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"grpc": front.grpc_port, "http": front.http_port}
    protocols = {p["name"]: p["appProtocol"] for p in service["spec"]["ports"]}
    assert protocols == {"grpc": "kubernetes.io/h2c", "http": "http"}


def test_ray_token_auth_gcs_fault_tolerance_and_the_ray_version() -> None:
    cluster = load_rayservice()["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "tandem-ray-token"}
    ft = cluster["gcsFaultToleranceOptions"]
    assert ft["redisAddress"].startswith("redis://")
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "tandem-redis"
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["enableInTreeAutoscaling"] is True


def test_the_manifest_uses_only_kuberay_fields() -> None:
    rayservice = load_rayservice()
    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    spec = rayservice["spec"]
    assert set(spec) <= RAYSERVICE_SPEC_FIELDS and not set(spec) & DEPRECATED_THRESHOLDS
    cluster = spec["rayClusterConfig"]
    assert set(cluster) <= RAYCLUSTER_SPEC_FIELDS
    assert set(cluster["headGroupSpec"]) <= HEAD_GROUP_FIELDS
    assert all(set(group) <= WORKER_GROUP_FIELDS for group in cluster["workerGroupSpecs"])
    assert set(cluster["authOptions"]) <= AUTH_OPTIONS_FIELDS
    assert set(cluster["gcsFaultToleranceOptions"]) <= GCS_FT_FIELDS
    assert set(cluster["autoscalerOptions"]) <= AUTOSCALER_OPTIONS_FIELDS


# --- The image -----------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            logical.append(current.strip())
            current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def dockerfile_args() -> dict[str, str]:
    return dict(args.split("=", 1) for kind, args in dockerfile_instructions() if kind == "ARG")


def copy_sources(args: str) -> list[str]:
    """The sources of a COPY (its flags and destination dropped)."""
    return [word for word in shlex.split(args) if not word.startswith("--")][:-1]


def pyproject_pin(name: str) -> str:
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    pins = [d for d in dependencies["dependencies"] if re.match(rf"{re.escape(name)}(\[|==)", d)]
    return pins[0].split("==")[1]


def test_the_image_is_built_on_the_pinned_ray_and_python() -> None:
    (base,) = [args for kind, args in dockerfile_instructions() if kind == "FROM"]
    image = dockerfile_args()["RAY_IMAGE"] if base == "${RAY_IMAGE}" else base
    repository, tag = image.split(":")
    assert repository == "rayproject/ray"
    version, python, flavour = tag.split("-")
    assert version == ray.__version__ == pyproject_pin("ray")
    target = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert python == target["target-version"] and flavour == "gpu"


def test_the_image_checks_the_protos_and_installs_the_project() -> None:
    instructions = dockerfile_instructions()
    sources = {
        source for kind, args in instructions if kind == "COPY" for source in copy_sources(args)
    }
    assert {"pyproject.toml", "protos", "cluster", "drafter", "verifier"} <= sources
    runs = [args for kind, args in instructions if kind == "RUN"]
    check = next(i for i, run in enumerate(runs) if "python -m protos.build --check" in run)
    install = next(i for i, run in enumerate(runs) if re.search(r"pip install \.( |$)", run))
    assert check < install, "drift fails the build before anything is installed"
    assert any("ray.__version__" in run for run in runs[install:]), "the Ray version is asserted"
    assert any(kind == "WORKDIR" for kind, _ in instructions)
    # The build context is an allowlist: whatever the COPYs take must be allowed into it.
    ignore = DOCKERIGNORE.read_text().splitlines()
    assert "*" in ignore and "!.venv" not in ignore
    assert {f"!{source}" for source in sources} <= set(ignore)


def test_suffix_drafters_are_a_cpu_only_deployment_on_pods_without_an_accelerator() -> None:
    """The suffix drafter asks Ray for no GPU and no accelerator type, and the one worker group
    it fits offers none: no GPU in Ray's view of the group, no GPU limit, no GPU node
    selector or toleration. The app builds it as its own deployment from these args."""
    rayservice = load_rayservice()
    app = the_app(serve_config(rayservice))
    config = TandemConfig.from_dict(app["args"])
    assert config.suffix_drafter.enabled
    options = config.suffix.ray_actor_options()
    assert options["num_gpus"] == 0 and "accelerator_type" not in options
    offered = {
        name: _get_ray_resources_from_group_spec(group, is_head=False)
        for name, group in groups(rayservice).items()
    }
    (home,) = [name for name, resources in offered.items() if _fits(options, resources)]
    assert offered[home].get("GPU", 0) == 0
    assert not any(key.startswith("accelerator_type:") for key in offered[home])
    spec = groups(rayservice)[home]["template"]["spec"]
    assert "nodeSelector" not in spec and "tolerations" not in spec
    for container in spec["containers"]:
        for amounts in container["resources"].values():
            assert not any("gpu" in key for key in amounts)
    with pytest.raises(ConfigError, match="CPUs only"):
        TandemConfig.from_dict({**app["args"], "suffix": {"num_gpus": 1}})

"""docker/k8s/: every object valid offline (Kubernetes 1.37 schemas, the custom resources' schemas), yamllint
clean, and the pieces consistent with each other and with slora-serve (ports, probes, labels, metric names)."""

from __future__ import annotations

import copy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from slora.backend.config import EngineConfig
from slora.backend.launcher import cli
from tests.deploy import picker
from tests.deploy.conftest import K8S, OVERLAYS, REPO, find
from tests.deploy.kustomize import Doc, KustomizeError, pod_containers, pod_spec, render

KUBERNETES = "1.37.0"
SCHEMAS = Path(__file__).parent / "schemas"
CUSTOM = {  # kind → (apiVersion, schema file)
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepool-v1.yaml"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproute-v1.yaml"),
    "PodMonitor": ("monitoring.coreos.com/v1", "podmonitor-v1.yaml"),
}
BIN = Path(sys.executable).parent


def _check_jsonschema(schema: str, instances: list[Path]) -> subprocess.CompletedProcess[str]:
    command = [str(BIN / "check-jsonschema"), "--schemafile", str(SCHEMAS / schema), *map(str, instances)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _write(docs: list[Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, doc in enumerate(docs):
        paths.append(folder / f"{i}.yaml")
        paths[-1].write_text(yaml.safe_dump(doc))
    return paths


def _server(docs: list[Doc]) -> Doc:
    return find(docs, "Deployment", "slora")


def _container(docs: list[Doc], deployment: str, name: str) -> Doc:
    return next(c for c in pod_containers(find(docs, "Deployment", deployment)) if c["name"] == name)


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_objects_validate_against_kubernetes(rendered: dict[str, list[Doc]], overlay: str) -> None:
    builtin = [doc for doc in rendered[overlay] if doc["kind"] not in CUSTOM]
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "PodDisruptionBudget"} <= {
        doc["kind"] for doc in builtin
    }
    for doc in builtin:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_kubernetes_validation_can_fail(rendered: dict[str, list[Doc]]) -> None:
    broken = copy.deepcopy(_server(rendered["pvc"]))
    pod_spec(broken)["containers"][0]["ports"][0]["containerPort"] = "eight thousand"  # type: ignore[index]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)
    unknown = copy.deepcopy(_server(rendered["pvc"]))
    pod_spec(unknown)["terminationGracePeriod"] = 30  # type: ignore[index]  # the field is ...Seconds
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, KUBERNETES, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_validate_against_their_schemas(
    rendered: dict[str, list[Doc]], overlay: str, tmp_path: Path
) -> None:
    for kind, (api_version, schema) in CUSTOM.items():
        docs = [doc for doc in rendered[overlay] if doc["kind"] == kind]
        assert docs and all(doc["apiVersion"] == api_version for doc in docs), kind
        result = _check_jsonschema(schema, _write(docs, tmp_path / kind))
        assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(find(rendered[overlay], "ConfigMap", "slora-epp-config")["data"]["epp-config.yaml"])
    result = _check_jsonschema("endpointpickerconfig-v1alpha1.yaml", _write([config], tmp_path / "epp"))
    assert result.returncode == 0, result.stdout + result.stderr


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(doc)
    *parents, last = path.split(".")
    target: Any = changed
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is None:
        del target[last]
    else:
        target[last] = value
    return changed


def test_the_schemas_reject_what_the_published_ones_reject(
    rendered: dict[str, list[Doc]], epp_config: dict[str, Any], tmp_path: Path
) -> None:
    pool = find(rendered["pvc"], "InferencePool", "slora")
    monitor = find(rendered["pvc"], "PodMonitor", "slora")
    route = find(rendered["pvc"], "HTTPRoute", "slora")
    bad = {
        "inferencepool-v1.yaml": [
            _set(pool, "spec.targetPorts", None),
            _set(pool, "spec.targetPorts", [{"number": 9000}, {"number": 9000}]),
            _set(pool, "spec.endpointPickerRef.port", None),  # kind Service (the default) needs a port
            _set(pool, "spec.endpointPickerRef.failureMode", "FailSoft"),
            _set(pool, "spec.selector.matchLabels", {}),
            _set(pool, "spec.modelServers", {}),
        ],
        "podmonitor-v1.yaml": [_set(monitor, "spec.podMetricsEndpoints.0.interval", "15 seconds")],
        "httproute-v1.yaml": [_set(route, "spec.rules.0.timeouts.request", "5min")],
        "endpointpickerconfig-v1alpha1.yaml": [
            _set(epp_config, "apiVersion", "v1"),
            _set(epp_config, "plugins.1.parameters.port", 0),
            _set(epp_config, "plugins.2.parameters.engineConfigs.0.loraSpec", "vllm:lora requests"),
            _set(epp_config, "plugins.2.parameters.engineConfigs.0.loraspec", "x"),
            _set(epp_config, "schedulingProfiles.0.plugins.2.weight", "high"),
        ],
    }
    for schema, docs in bad.items():
        for i, doc in enumerate(docs):
            result = _check_jsonschema(schema, _write([doc], tmp_path / f"{schema}-{i}"))
            assert result.returncode != 0, f"{schema} accepted bad document {i}"


def test_yaml_is_lint_clean() -> None:
    files = sorted((REPO / "docker").rglob("*.yaml")) + sorted(SCHEMAS.glob("*.yaml"))
    assert len(files) > 15
    config = REPO / "docker" / ".yamllint.yaml"
    result = subprocess.run([str(BIN / "yamllint"), "-f", "parsable", "-c", str(config), *map(str, files)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_renderer_applies_the_overlay_and_refuses_what_it_does_not_implement(
    rendered: dict[str, list[Doc]], tmp_path: Path
) -> None:
    docs = rendered["pvc"]
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    assert all(d["metadata"].get("namespace") == "slora" for d in docs if d["kind"] not in cluster_scoped)
    from_base = [d for d in docs if d["kind"] not in ("Namespace", "PersistentVolumeClaim")]  # the overlay's own
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "slora-triton" for d in from_base)
    assert "labels" not in find(docs, "Namespace", "slora")["metadata"]
    assert _container(docs, "slora", "slora")["image"] == "registry.example.com/slora-triton:0.1.0"
    binding = find(docs, "ClusterRoleBinding", "slora-epp-metrics-auth")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "slora-epp", "namespace": "slora"}]
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "replicas": [{"name": "slora", "count": 3}]}  # fmt: skip
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    with pytest.raises(KustomizeError, match="replicas"):
        render(tmp_path)


def test_object_store_overlay_copies_adapters_into_the_pod(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["object-store"]
    spec = pod_spec(_server(docs))
    assert spec is not None
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["adapters"] and "persistentVolumeClaim" in volumes["models"]
    assert not [d for d in docs if d["metadata"]["name"] == "slora-adapters"]  # no adapters claim left behind
    copy_step, sidecar = spec["initContainers"]
    assert copy_step.get("restartPolicy") is None  # runs to completion before the server starts
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar beside the server
    for step in (copy_step, sidecar):
        assert {"name": "adapters", "mountPath": "/adapters"} in step["volumeMounts"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_model_server_pod(rendered: dict[str, list[Doc]], overlay: str) -> None:
    deployment = _server(rendered[overlay])
    spec = pod_spec(deployment)
    assert spec is not None
    server = _container(rendered[overlay], "slora", "slora")
    args = server["args"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == server["resources"]["requests"]["nvidia.com/gpu"] == 1
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes[next(n for n, m in mounts.items() if m["mountPath"] == "/dev/shm")]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    assert {mounts[n]["mountPath"] for n in ("models", "adapters")} == {
        _arg(args, "--model"),
        _arg(args, "--adapter-dir"),
    }
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": int(_arg(args, "--openai-port"))}
    for probe in ("startupProbe", "readinessProbe"):
        assert server[probe]["httpGet"] == {"path": "/v2/models/slora/ready", "port": "http"}
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > float(_arg(args, "--ready-timeout"))
    assert "--lora-info-metric" in args  # the fleet exports the picker's LoRA gauge
    assert "replicas" not in deployment["spec"]  # the autoscaler owns the count
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_termination_waits_for_the_requests_then_lets_slora_serve_stop(rendered: dict[str, list[Doc]]) -> None:
    deployment = _server(rendered["pvc"])
    server = _container(rendered["pvc"], "slora", "slora")
    command = server["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "/opt/slora/docker/wait_idle.py"]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert "WORKDIR /opt/slora" in dockerfile and "COPY docker/wait_idle.py docker/" in dockerfile
    wait_s = float(_arg(command, "--timeout-s"))
    stop_s = cli.DRAIN_TIMEOUT_S + cli.STOP_TIMEOUT_S + cli.LEFTOVER_GRACE_S
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] > wait_s + stop_s  # type: ignore[index]


def _parses(args: list[str]) -> None:
    """slora-serve accepts `args`. --openai-port comes with the OpenAI endpoint (issue 28): until that flag
    exists it is checked for its value only."""
    args = list(args)
    flags = {a for action in cli.build_parser()._actions for a in action.option_strings}
    if "--openai-port" not in flags and "--openai-port" in args:
        at = args.index("--openai-port")
        assert 1 <= int(args[at + 1]) <= 65535
        del args[at : at + 2]
    options = cli.parse_options(args)
    assert options.lora_info_metric == ("--lora-info-metric" in args)
    EngineConfig.from_dict({**options.engine, "model": options.model})  # refuses unknown options and bad values


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_server_arguments_are_slora_serve_flags(
    rendered: dict[str, list[Doc]], overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _container(rendered[overlay], "slora", "slora")["args"]
    monkeypatch.setattr(cli.LaunchOptions, "__post_init__", lambda self: None)  # the paths exist in the pod only
    _parses(args)
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]["slora"]
    _parses(compose["command"])
    with pytest.raises(SystemExit):
        cli.parse_options([*args, "--lora-info-metrics"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pool_and_picker_point_at_the_servers(
    rendered: dict[str, list[Doc]], overlay: str, epp_config: dict[str, Any]
) -> None:
    docs = rendered[overlay]
    server, template = _container(docs, "slora", "slora"), _server(docs)["spec"]["template"]
    pool = find(docs, "InferencePool", "slora")
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": int(_arg(server["args"], "--openai-port"))}]
    ref = pool["spec"]["endpointPickerRef"]
    service = find(docs, "Service", ref["name"])
    epp = _container(docs, "slora-epp", "epp")
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert {p["name"]: p["containerPort"] for p in epp["ports"]}[port["targetPort"]] == 9002
    assert _arg(epp["args"], "--pool-name") == pool["metadata"]["name"]
    mounted = yaml.safe_load(find(docs, "ConfigMap", "slora-epp-config")["data"]["epp-config.yaml"])
    assert mounted == epp_config and _arg(epp["args"], "--config-file") == "/config/epp-config.yaml"
    plugins = {p.get("name", p["type"]): p for p in epp_config["plugins"]}
    source = plugins["metrics-data-source"]["parameters"]
    assert source["port"] == {p["name"]: p["containerPort"] for p in server["ports"]}["metrics"]
    extractor = plugins["core-metrics-extractor"]["parameters"]
    engine = picker.engine_config(epp_config, template["metadata"]["labels"][extractor["engineLabelKey"]])
    assert extractor["defaultEngine"] == engine["name"]
    assert picker.parse_spec(engine["queuedRequestsSpec"]) == picker.Spec("slora_requests", {"state": "waiting"})
    assert picker.parse_spec(engine["loraSpec"]) == picker.Spec("vllm:lora_requests_info", {})
    profile = epp_config["schedulingProfiles"][0]["plugins"]
    refs = [p["pluginRef"] for p in profile] + [p["pluginRef"] for p in epp_config["requestHandler"]["parsers"]]
    refs += [s["pluginRef"] for s in epp_config["dataLayer"]["sources"]]
    assert set(refs) <= set(plugins)
    assert next(p for p in profile if p["pluginRef"] == "lora-affinity-scorer")["weight"] > 0
    rules = find(docs, "Role", "slora-epp")["rules"]
    for group, resource in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        assert any(group in r["apiGroups"] and resource in r["resources"] and "watch" in r["verbs"] for r in rules)
    route = find(docs, "HTTPRoute", "slora")["spec"]["rules"][0]["backendRefs"][0]
    assert (route["kind"], route["name"]) == ("InferencePool", "slora")


def test_autoscaler_reads_the_queue_that_prometheus_adapter_serves(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["pvc"]
    hpa = find(docs, "HorizontalPodAutoscaler", "slora")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "slora"}
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert [m["pods"]["metric"]["name"] for m in hpa["metrics"]] == [rule["name"]["as"]]
    assert rule["seriesQuery"].startswith('slora_requests{state="waiting",')
    assert 'state="waiting"' in rule["metricsQuery"]
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    monitor = find(docs, "PodMonitor", "slora")["spec"]
    labels = _server(docs)["spec"]["template"]["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in _container(docs, "slora", "slora")["ports"]}
    assert [e["port"] for e in monitor["podMetricsEndpoints"]] == ["metrics"] and "metrics" in port_names


def test_compose_file_is_valid_and_probes_the_model() -> None:
    compose_file = REPO / "docker" / "compose.yaml"
    result = subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                             str(compose_file)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    service = yaml.safe_load(compose_file.read_text())["services"]["slora"]
    assert "/v2/models/slora/ready" in shlex.join(service["healthcheck"]["test"])

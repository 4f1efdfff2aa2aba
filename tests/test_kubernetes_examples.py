"""The Kubernetes manifests in examples/kubernetes (no cluster runs here): each is well-formed
YAML of the kinds it claims, every `tokenloom serve` command line in it is one the real flag
parser accepts (with the variables Kubernetes substitutes filled in), its ports and probes
agree with those flags and with the routes the server has, every TOKENLOOM_* variable it sets is
one tokenloom reads, and the autoscaler's metric is one tokenloom exports."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from tokenloom.api.serve_args import parse_serve_args

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "kubernetes"
SOURCE = "\n".join(path.read_text(encoding="utf-8") for path in (REPO / "tokenloom").rglob("*.py"))
# what Kubernetes (and the LeaderWorkerSet controller) substitutes for $(NAME) in args
SUBSTITUTIONS = {"LWS_LEADER_ADDRESS": "tokenloom-dp-0.tokenloom-dp"}
KINDS = {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "LeaderWorkerSet", "RayService"}


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if document:
                found.append((path.name, document))
    return found


def pod_specs(document: dict) -> list[dict]:
    spec = document.get("spec", {})
    if document["kind"] == "Deployment":
        return [spec["template"]["spec"]]
    if document["kind"] == "LeaderWorkerSet":
        templates = spec["leaderWorkerTemplate"]
        return [templates[name]["spec"] for name in ("leaderTemplate", "workerTemplate")]
    if document["kind"] == "RayService":
        cluster = spec["rayClusterConfig"]
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        return [group["template"]["spec"] for group in groups]
    return []


def substituted(text: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda match: SUBSTITUTIONS[match.group(1)], text)


def serve_argv(container: dict) -> list[str] | None:
    """The flags after `tokenloom serve` in the container's command, if it runs the server."""
    command, args = container.get("command", []), container.get("args", [])
    if command[:2] == ["tokenloom", "serve"]:
        return [substituted(arg) for arg in args]
    if command == ["sh", "-c"]:
        for part in substituted(args[0]).split("&&"):
            words = shlex.split(part)
            while words and ("=" in words[0] or words[0] == "exec"):
                words.pop(0)  # VAR=value assignments and exec before the command
            if words[:2] == ["tokenloom", "serve"]:
                return words[2:]
    return None


def containers() -> list[tuple[str, dict]]:
    return [
        (name, container)
        for name, document in documents()
        for pod in pod_specs(document)
        for container in pod["containers"]
    ]


def test_every_manifest_is_yaml_of_known_kinds():
    found = documents()
    assert {name for name, _ in found} == {path.name for path in EXAMPLES.glob("*.yaml")}
    assert {document["kind"] for _, document in found} <= KINDS
    assert sum(1 for _, container in containers() if serve_argv(container) is not None) == 6


@pytest.mark.parametrize(
    "where,container",
    [pair for pair in containers() if serve_argv(pair[1]) is not None],
    ids=lambda value: value if isinstance(value, str) else value["name"],
)
def test_every_serve_command_is_accepted_and_its_ports_and_probes_agree(where, container):
    argv = serve_argv(container)
    serve_args = parse_serve_args(argv, {"TOKENLOOM_API_KEY": "k"})
    ports = {port.get("name"): port["containerPort"] for port in container.get("ports", [])}
    if serve_args.server.headless:
        assert "http" not in ports and "readinessProbe" not in container  # no API server there
        return
    assert ports["http"] == serve_args.server.port and serve_args.server.host == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for probe in ("startupProbe", "livenessProbe"):
        if probe in container:
            assert container[probe]["httpGet"]["path"] == "/health"
    parallel = serve_args.engine_args.create_engine_config().parallel
    if parallel.data_parallel_size_local is not None:
        assert ports["dp-rpc"] == parallel.data_parallel_rpc_port


def test_every_tokenloom_variable_set_is_one_tokenloom_reads():
    named = set()
    for _, container in containers():
        named |= {entry["name"] for entry in container.get("env", [])}
        named |= set(re.findall(r"\b(TOKENLOOM_\w+)=", " ".join(container.get("args", []))))
    assert named >= {"TOKENLOOM_API_KEY", "TOKENLOOM_NODE_AUTHKEY", "TOKENLOOM_RAY_PLACEMENT_STRATEGY"}
    unknown = sorted(name for name in named if name.startswith("TOKENLOOM_") and f'"{name}' not in SOURCE)
    assert not unknown, f"set in the manifests, read nowhere: {unknown}"


def test_the_autoscaler_reads_the_waiting_requests_tokenloom_exports():
    by_kind = {document["kind"]: document for _, document in documents()}
    metric = by_kind["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    (rule,) = yaml.safe_load(by_kind["ConfigMap"]["data"]["config.yaml"])["rules"]
    assert rule["name"]["as"] == metric
    exported = rule["name"]["matches"]
    assert rule["seriesQuery"].startswith(exported + "{")
    assert f'gauge("{exported}"' in SOURCE  # a gauge tokenloom's /metrics serves


def test_the_ray_worker_joins_the_leaders_ray_head():
    leader, worker = (
        container["args"][0] for name, container in containers() if name == "leaderworkerset-ray-tensor-parallel.yaml"
    )
    head_port = re.search(r"ray start --head --port=(\d+)", leader).group(1)
    assert f"ray start --address=$(LWS_LEADER_ADDRESS):{head_port}" in worker
    assert f"RAY_ADDRESS=127.0.0.1:{head_port}" in leader


def test_the_worker_pod_runs_node_1_of_the_leaders_engine_and_the_leader_opens_its_ports():
    leader, worker = (
        container for name, container in containers() if name == "leaderworkerset-multinode-tensor-parallel.yaml"
    )
    head, node = (parse_serve_args(serve_argv(container), {}) for container in (leader, worker))
    assert (node.engine_args.nnodes, node.engine_args.node_rank, node.server.headless) == (2, 1, True)
    assert (head.engine_args.nnodes, head.engine_args.node_rank, head.server.headless) == (2, 0, False)
    for field in ("model", "tensor_parallel_size", "pipeline_parallel_size", "master_addr", "master_port"):
        assert getattr(head.engine_args, field) == getattr(node.engine_args, field)
    port = head.engine_args.master_port
    assert {port, port + 1} <= {entry["containerPort"] for entry in leader["ports"]}


def test_the_ray_service_runs_tokenloom_s_app_builder_with_models_tokenloom_serve_accepts():
    import importlib

    pytest.importorskip("ray.serve")
    from tokenloom.ray_serve import ModelConfig

    (service,) = (document for _, document in documents() if document["kind"] == "RayService")
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    module, name = application["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    models = application["args"]["models"]
    for model in models:
        parse_serve_args(ModelConfig(**model).serve_argv())
    app = builder(application["args"])
    assert type(app).__name__ == "Application"
    serve_port = {
        port["containerPort"] for container in pod_specs(service)[0]["containers"] for port in container["ports"]
    }
    assert 8000 in serve_port  # Ray Serve's HTTP proxy

"""deploy/ (Kubernetes manifests for encoders, prefill/decode instances and the proxy) is
valid, consistent with itself, and speaks ecshare's real flags and keys.

A Kubernetes cluster cannot run here (no container runtime, no network beyond this host),
so nothing is applied: each overlay is rendered offline (`deploy_render`, the subset of
kustomize that deploy/ uses, held to `kubectl kustomize` where kubectl is installed) and
then checked:

- every object against the Kubernetes API's OpenAPI schema, strictly (an unknown field is
  an error), with kubernetes-validate, which bundles the schemas of each Kubernetes release
  (no cluster, no download);
- every Secret, ConfigMap (and key of it), Service, port and volume a workload names
  exists in the render;
- each container's ecshare settings decode with ecshare's own parsers: the ECSHARE_*
  variables (as the kubelet expands them for each pod) and `ec_connector_extra_config`
  through `ecshare.config.load_config` and the connector's `split_extra`, the proxy's and
  doctor's command lines through `ecshare`'s argparse and `ProxyConfig`, and `vllm serve`'s
  through vLLM's own parser;
- the key files as each pod would see them mounted load with ecshare's own loaders (which
  refuse a secret key that other users can read): Secrets are mounted read-only, 0600 or
  stricter, with no fsGroup to add group access;
- the roles agree: the prefill/decode instances trust exactly the endpoints the encoders
  advertise, the encoders push to exactly the prefill/decode instances' push names, and
  the proxy calls every instance by a name its headless Service resolves.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_render import Obj, render

from ecshare.apps.cli import build_parser
from ecshare.apps.ops.integrity_checks import check_integrity
from ecshare.apps.ops.key_checks import check_keys
from ecshare.apps.proxy.config import ProxyConfig, config_from_args
from ecshare.config import Config, load_config
from ecshare.control import ControlConfigError, generate_keypair, load_keypair
from ecshare.vllm.settings import ConnectorSettings, split_extra

DEPLOY = Path(__file__).parents[2] / "deploy"
OVERLAYS = ("tcp", "rdma")
# The oldest Kubernetes release still widely run, and the newest whose schema is bundled.
SCHEMA_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
WORKLOAD_KINDS = ("StatefulSet", "Deployment")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@pytest.fixture(scope="module")
def deploy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/ with the keys an operator makes first (docs/DEPLOYMENT.md)."""
    root = tmp_path_factory.mktemp("deploy") / "deploy"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("keys"))
    keys = root / "base" / "keys"
    generate_keypair(keys, "encoder")
    generate_keypair(keys, "pd")
    (keys / "api-key").write_text("a-proxy-api-key-for-the-test\n")
    return root


@pytest.fixture(scope="module")
def rendered(deploy_dir: Path) -> dict[str, list[Obj]]:
    return {overlay: render(deploy_dir / "overlays" / overlay) for overlay in OVERLAYS}


def objects(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] in WORKLOAD_KINDS]


def pod_names(workload: Obj) -> list[str]:
    """A StatefulSet's pod names; one stand-in name for a Deployment's pods."""
    name, replicas = workload["metadata"]["name"], workload["spec"]["replicas"]
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(replicas)]
    return [f"{name}-pod"]


def containers(pod_spec: Obj) -> list[Obj]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def container(workload: Obj, name: str) -> Obj:
    spec = workload["spec"]["template"]["spec"]
    (found,) = [c for c in containers(spec) if c["name"] == name]
    return found


def container_env(objs: list[Obj], pod: str, c: Obj) -> dict[str, str]:
    """The container's environment as the kubelet gives it to pod `pod`: envFrom first,
    then env, each `$(VAR)` of a value expanded from what is defined before it."""
    env: dict[str, str] = {}
    config_maps = objects(objs, "ConfigMap")
    for source in c.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), var["value"])
        else:
            assert var["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, var
            env[var["name"]] = pod
    return env


def mount_files(objs: list[Obj], pod_spec: Obj, c: Obj, root: Path) -> None:
    """Write the files of the container's Secret and ConfigMap mounts under `root`, each with
    the mode the kubelet gives it (an item's mode, else the volume's defaultMode, else 0644)."""
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    for mount in c.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        source = volume.get("secret") or volume.get("configMap")
        if source is None:
            continue
        if "secret" in volume:
            data = {
                k: base64.b64decode(v)
                for k, v in objects(objs, "Secret")[source["secretName"]]["data"].items()
            }
        else:
            data = {
                k: v.encode() for k, v in objects(objs, "ConfigMap")[source["name"]]["data"].items()
            }
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        target = root / mount["mountPath"].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for item in items:
            path = target / item["path"]
            path.write_bytes(data[item["key"]])
            path.chmod(item.get("mode", source.get("defaultMode", 0o644)))


def under(root: Path, env: dict[str, str], c: Obj) -> dict[str, str]:
    """`env` with every path inside one of the container's mounts moved under `root`."""
    mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
    return {
        k: str(root / v.lstrip("/")) if any(v.startswith(m + "/") or v == m for m in mounts) else v
        for k, v in env.items()
    }


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@dataclass
class Instance:
    """One vLLM pod: its ecshare Config and connector settings, as its connector decodes them."""

    pod: str
    workload: Obj
    config: Config
    settings: ConnectorSettings
    ec_transfer: dict[str, Any]
    port: int


def instances(objs: list[Obj], root: Path) -> Iterator[Instance]:
    for workload in objects(objs, "StatefulSet").values():
        pod_spec = workload["spec"]["template"]["spec"]
        vllm = container(workload, "vllm")
        for pod in pod_names(workload):
            pod_root = root / pod
            mount_files(objs, pod_spec, vllm, pod_root)
            env = under(pod_root, container_env(objs, pod, vllm), vllm)
            ec_transfer = json.loads(flag(vllm["args"], "--ec-transfer-config"))
            core, settings = split_extra(ec_transfer["ec_connector_extra_config"])
            config = load_config(
                extra=core, env={k: v for k, v in env.items() if k.startswith("ECSHARE_")}
            )
            yield Instance(
                pod, workload, config, settings, ec_transfer, int(flag(vllm["args"], "--port"))
            )


def role(instance: Instance) -> str:
    return str(instance.ec_transfer["ec_role"])


def proxy_config(objs: list[Obj], root: Path) -> tuple[Obj, ProxyConfig]:
    (deployment,) = objects(objs, "Deployment").values()
    proxy = container(deployment, "proxy")
    assert proxy["command"] == ["ecshare", "proxy"]
    args = build_parser().parse_args([*proxy["command"][1:], *proxy["args"]])
    mount_files(objs, deployment["spec"]["template"]["spec"], proxy, root)
    args.api_key_file = under(root, {"f": args.api_key_file}, proxy)["f"]
    return deployment, config_from_args(args, environ={})


# -- the render and the schema -------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_kubernetes_api_schema(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    objs = rendered[overlay]
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objs)
    assert kinds == [
        "ConfigMap/ecshare-encoder-env",
        "ConfigMap/ecshare-pd-env",
        "ConfigMap/ecshare-public-keys",
        "ConfigMap/ecshare-ucx-env",
        "Deployment/ecshare-proxy",
        "Secret/ecshare-encoder-secret-key",
        "Secret/ecshare-pd-secret-key",
        "Secret/ecshare-proxy-api-key",
        "Service/ecshare-encoder",
        "Service/ecshare-pd",
        "Service/ecshare-proxy",
        "StatefulSet/ecshare-encoder",
        "StatefulSet/ecshare-pd",
    ]
    for version in SCHEMA_VERSIONS:
        for obj in objs:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_schema_check_refuses_a_misspelt_field(rendered: dict[str, list[Obj]]) -> None:
    statefulset = copy.deepcopy(objects(rendered["tcp"], "StatefulSet")["ecshare-encoder"])
    statefulset["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="resource"):
        kubernetes_validate.validate(statefulset, SCHEMA_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_itself_renders_what_the_tests_check(deploy_dir: Path, overlay: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(deploy_dir / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout

    def normal(o: Obj) -> str:
        """The object as JSON, a Secret's data decoded (kustomize wraps its base64)."""
        if o["kind"] == "Secret":
            o = {**o, "data": {k: base64.b64decode(v).decode() for k, v in o["data"].items()}}
        return json.dumps(o, sort_keys=True)

    by_kustomize = sorted(normal(d) for d in yaml.safe_load_all(out) if d)
    assert by_kustomize == sorted(normal(o) for o in render(deploy_dir / "overlays" / overlay))


# -- references between objects ------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workloads_name_only_objects_ports_and_keys_that_exist(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    objs = rendered[overlay]
    secrets, config_maps = objects(objs, "Secret"), objects(objs, "ConfigMap")
    services = objects(objs, "Service")
    for workload in workloads(objs):
        template = workload["spec"]["template"]
        labels, pod_spec = template["metadata"]["labels"], template["spec"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        volumes = {v["name"]: v for v in pod_spec["volumes"]}
        for volume in volumes.values():
            if "secret" in volume:
                data = secrets[volume["secret"]["secretName"]]["data"]
                items = volume["secret"].get("items", [])
            elif "configMap" in volume:
                data = config_maps[volume["configMap"]["name"]]["data"]
                items = volume["configMap"].get("items", [])
            else:
                continue
            assert {i["key"] for i in items} <= set(data), volume
        for c in containers(pod_spec):
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for source in c.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                action = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket")
                if action is not None:
                    assert action["port"] in ports, (c["name"], probe)
        if workload["kind"] == "StatefulSet":
            service = services[workload["spec"]["serviceName"]]
            assert service["spec"]["clusterIP"] == "None", "pods get DNS names only when headless"
    for service in services.values():
        (selected,) = [
            w
            for w in workloads(objs)
            if service["spec"]["selector"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        ports = {
            p["name"]: p["containerPort"]
            for c in selected["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"], (service["metadata"]["name"], port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_mounted_read_only_and_unreadable_to_group_and_others(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    mounted = 0
    for workload in workloads(rendered[overlay]):
        pod_spec = workload["spec"]["template"]["spec"]
        # fsGroup makes the kubelet add group read to every file of a Secret volume.
        assert "fsGroup" not in pod_spec.get("securityContext", {})
        secret_volumes = {v["name"]: v["secret"] for v in pod_spec["volumes"] if "secret" in v}
        for secret in secret_volumes.values():
            modes = [secret.get("defaultMode", 0o644)]
            modes += [i["mode"] for i in secret.get("items", []) if "mode" in i]
            assert all(mode & 0o077 == 0 for mode in modes), (secret, [oct(m) for m in modes])
        for c in containers(pod_spec):
            for mount in c.get("volumeMounts", []):
                if mount["name"] in secret_volumes:
                    assert mount.get("readOnly") is True, (c["name"], mount)
                    mounted += 1
    assert mounted == 5  # each instance's key in its vLLM and doctor containers; the API key


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_loads_its_keys_as_mounted_with_ecshare_doctor_key_checks(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    found = list(instances(rendered[overlay], tmp_path))
    assert sorted(i.pod for i in found) == [
        "ecshare-encoder-0",
        "ecshare-encoder-1",
        "ecshare-pd-0",
        "ecshare-pd-1",
    ]
    for instance in found:
        checks = check_keys(instance.config)
        assert [c.status for c in checks] == ["ok"], (instance.pod, checks)
        side = "producer" if role(instance) == "ec_producer" else "consumer"
        assert checks[0].name == f"keys ({side})"


def test_a_secret_key_mounted_readable_by_all_is_refused_by_ecshare(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    objs = copy.deepcopy(rendered["tcp"])
    encoder = objects(objs, "StatefulSet")["ecshare-encoder"]
    (secret,) = [v for v in encoder["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    secret["secret"]["defaultMode"] = 0o444
    instance = next(i for i in instances(objs, tmp_path) if role(i) == "ec_producer")
    assert instance.config.server_secret_key_file is not None
    with pytest.raises(ControlConfigError, match="accessible to all users"):
        load_keypair(instance.config.server_secret_key_file)


# -- ecshare's own parsers, and the roles agreeing ------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_roles_name_each_other_as_their_services_resolve(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    objs = rendered[overlay]
    found = list(instances(objs, tmp_path))
    encoders = [i for i in found if role(i) == "ec_producer"]
    pd = [i for i in found if role(i) == "ec_consumer"]
    assert len(encoders) == 2 and len(pd) == 2
    services = objects(objs, "Service")

    def dns_name(i: Instance) -> str:
        service = services[i.workload["spec"]["serviceName"]]
        return f"{i.pod}.{service['metadata']['name']}"

    def service_ports(i: Instance) -> set[int]:
        return {p["port"] for p in services[i.workload["spec"]["serviceName"]]["spec"]["ports"]}

    for i in found:
        ports = {p["name"]: p["containerPort"] for p in container(i.workload, "vllm")["ports"]}
        assert ports["http"] == i.port and ports["metrics"] == i.config.metrics_port
        assert i.config.metrics_port in service_ports(i)
    advertised = set()
    for e in encoders:
        assert e.config.advertise_host == dns_name(e)
        assert e.config.listen_port in service_ports(e) and e.port in service_ports(e)
        advertised.add(f"tcp://{e.config.advertise_host}:{e.config.listen_port}")
    push_names = {i.config.push_name for i in pd}
    assert None not in push_names and len(push_names) == len(pd)
    for e in encoders:
        assert set(e.settings.push_targets) == push_names
    for i in pd:
        assert set(i.settings.trusted_producers) == advertised
        assert i.port in service_ports(i)

    _, proxy = proxy_config(objs, tmp_path / "proxy")
    assert proxy.api_key == "a-proxy-api-key-for-the-test"
    assert set(proxy.encoders) == {f"http://{dns_name(e)}:{e.port}" for e in encoders}
    pd_by_url = {f"http://{dns_name(i)}:{i.port}": i for i in pd}
    assert set(proxy.prefill_decode) == set(pd_by_url)
    for url, name in zip(proxy.prefill_decode, proxy.pd_push_names, strict=True):
        assert pd_by_url[url].config.push_name == name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_doctor_runs_with_the_settings_of_its_vllm_container(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    for workload in objects(rendered[overlay], "StatefulSet").values():
        doctor, vllm = container(workload, "doctor"), container(workload, "vllm")
        assert doctor["command"][0] == "ecshare"
        args = build_parser().parse_args([*doctor["command"][1:], *doctor.get("args", [])])
        assert args.command == "doctor" and not args.no_selftest
        assert doctor["envFrom"] == vllm["envFrom"] and doctor["env"] == vllm["env"]
        assert doctor["volumeMounts"] == vllm["volumeMounts"]
        # doctor's memory check measures the region against the limit it runs under.
        assert doctor["resources"]["limits"]["memory"] == vllm["resources"]["limits"]["memory"]


def test_tcp_checks_what_it_reads_and_rdma_gives_pods_the_hca_and_ipc_lock(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    for instance in instances(rendered["tcp"], tmp_path / "tcp"):
        assert instance.config.ucx_tls == "tcp" and instance.config.checksum == "xxh3_64"
        assert [c.status for c in check_integrity(instance.config)] == ["ok"]
    for instance in instances(rendered["rdma"], tmp_path / "rdma"):
        assert instance.config.ucx_tls is not None and "rc" in instance.config.ucx_tls.split(",")
        assert "tcp" not in instance.config.ucx_tls.split(",")
        assert instance.config.ucx_net_devices and instance.config.checksum == "none"
        assert [c.status for c in check_integrity(instance.config)] == ["ok"]
    for workload in objects(rendered["rdma"], "StatefulSet").values():
        for c in containers(workload["spec"]["template"]["spec"]):
            resources = c["resources"]
            hca = {k: v for k, v in resources["limits"].items() if k.startswith("rdma/")}
            # Extended resources are requested as much as they are limited.
            assert hca and hca.items() <= resources["requests"].items(), c["name"]
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    for workload in objects(rendered["tcp"], "StatefulSet").values():
        for c in containers(workload["spec"]["template"]["spec"]):
            assert not any(k.startswith("rdma/") for k in c["resources"]["limits"])
            assert "add" not in c["securityContext"]["capabilities"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_instances_ask_for_one_gpu_and_memory_for_region_and_shm(
    rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    def gib(quantity: str) -> int:
        assert quantity.endswith("Gi"), quantity
        return int(quantity[:-2]) << 30

    for instance in instances(rendered[overlay], tmp_path):
        pod_spec = instance.workload["spec"]["template"]["spec"]
        resources = container(instance.workload, "vllm")["resources"]
        gpus = {resources["limits"]["nvidia.com/gpu"], resources["requests"]["nvidia.com/gpu"]}
        assert gpus == {"1"}
        # The region (a memfd) and a memory-backed /dev/shm are both charged to the limit.
        (shm,) = [v["emptyDir"] for v in pod_spec["volumes"] if "emptyDir" in v]
        assert shm["medium"] == "Memory"
        needed = instance.config.region_bytes + gib(shm["sizeLimit"])
        assert gib(resources["limits"]["memory"]) > needed


def test_vllm_serve_accepts_every_argument_the_instances_pass(
    rendered: dict[str, list[Obj]],
) -> None:
    serve = pytest.importorskip("vllm.entrypoints.cli.serve", reason="vLLM is not installed")
    # The parser `vllm serve` itself builds, from the module that defines the subcommand.
    parser = serve.FlexibleArgumentParser(prog="vllm")
    serve.ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    for overlay in OVERLAYS:
        for workload in objects(rendered[overlay], "StatefulSet").values():
            vllm = container(workload, "vllm")
            assert vllm["command"] == ["vllm", "serve"]
            args = parser.parse_args([*vllm["command"][1:], *vllm["args"]])
            ec = args.ec_transfer_config
            assert ec.ec_connector == "ECShareConnector"
            component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
            assert (
                ec.ec_role == {"encoder": "ec_producer", "prefill-decode": "ec_consumer"}[component]
            )
            split_extra(ec.ec_connector_extra_config)
            assert args.port == vllm["ports"][0]["containerPort"]

"""The cluster packaging (issue 30), checked without a container engine or a cluster: every Kubernetes manifest
validates against the Kubernetes JSON schemas (kubernetes-validate bundles them: no network), the compose file's
services, ports and health checks are the ones docs/scale-out.md's table documents, the Containerfile runs as a
non-root user with a health check, a volume for the store and port 11434, and COPYs only what exists and what
.dockerignore lets into the build context, and every CORRAL_* setting the three give parses as the daemon reads it.
The probe and health-check paths of all three are asked of a real daemon that requires an API key: each must answer
without one, and the health-check commands themselves are run. The Kubernetes HAProxy configuration is the
generator's for the StatefulSet's pods and passes `haproxy -c`. Building the image needs a container engine and a
network: that test runs only when asked for."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from daemon.settings import ENV_DOCS, Settings
from registry.names import ModelName
from tests.conftest import REPO, free_port, start_daemon, stop_daemon

PACKAGING = REPO / "packaging"
CONTAINERFILE = PACKAGING / "container" / "Containerfile"
COMPOSE = PACKAGING / "compose" / "compose.yaml"
KUBERNETES = PACKAGING / "kubernetes"
SCALE_OUT = REPO / "docs" / "scale-out.md"
# the oldest Kubernetes release the manifests must still validate against, and the newest the validator knows
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
# read at import: the autouse fixture clears CORRAL_* variables before each test. CORRAL_TEST_IMAGE_BUILD=1 builds
# the image; the engine's extra flags, if it needs any, come from CORRAL_TEST_IMAGE_BUILD_ARGS and ..._RUN_ARGS (e.g.
# "--isolation chroot --build-arg PYTHON_IMAGE=localhost/python:3.11" for a podman without Docker Hub whose OCI
# runtime cannot start build containers)
BUILD_IMAGE = os.environ.get("CORRAL_TEST_IMAGE_BUILD") == "1"
BUILD_ARGS = shlex.split(os.environ.get("CORRAL_TEST_IMAGE_BUILD_ARGS", ""))
RUN_ARGS = shlex.split(os.environ.get("CORRAL_TEST_IMAGE_RUN_ARGS", ""))


# -- helpers ----------------------------------------------------------------------------------------------------
def manifests() -> list[tuple[Path, dict[str, Any]]]:
    """Every resource in packaging/kubernetes (kustomization.yaml is kustomize's, not a cluster resource)."""
    out = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path, doc))
    return out


def resource(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def statefulset() -> dict[str, Any]:
    (sts,) = resource("StatefulSet")
    return sts


def corral_container() -> dict[str, Any]:
    (container,) = [c for c in statefulset()["spec"]["template"]["spec"]["containers"] if c["name"] == "corral"]
    return container


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def instructions() -> list[tuple[str, str]]:
    """The Containerfile as (INSTRUCTION, arguments), continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in CONTAINERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Containerfile ends inside a continued line"
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from + 1 :]


def stage_env(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in steps:
        if word == "ENV":
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                assert sep, f"ENV {rest!r}: use the KEY=value form"
                env[key] = value
    return env


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def healthcheck_command() -> list[str]:
    (check,) = [rest for word, rest in final_stage() if word == "HEALTHCHECK"]
    _, sep, cmd = check.partition(" CMD ")
    assert sep, f"HEALTHCHECK without CMD: {check}"
    return exec_form(cmd.strip())


def scale_out_section(title: str) -> str:
    text = SCALE_OUT.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def compose_table() -> dict[str, dict[str, list[str]]]:
    """docs/scale-out.md's table of the compose file: service -> {"ports": [...], "health": [...]} (backticked)."""
    rows: dict[str, dict[str, list[str]]] = {}
    lines = [line for line in scale_out_section("Compose: three replicas, HAProxy and a registry").splitlines()]
    header = next(i for i, line in enumerate(lines) if line.startswith("| service |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        cells = dict(zip(columns, (c.strip() for c in line.strip().strip("|").split("|")), strict=True))
        (service,) = re.findall(r"`([^`]+)`", cells["service"])
        rows[service] = {
            "ports": re.findall(r"`([^`]+)`", cells["ports (host:container)"]),
            "health": re.findall(r"`([^`]+)`", cells["health check"]),
        }
    return rows


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps a top-level path out of the build context (the last matching pattern wins)."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        bare = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, bare) or fnmatch.fnmatch(path, bare.removeprefix("**/")):
            excluded = not negate
    return excluded


# -- Kubernetes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_kubernetes_manifest_validates_against_the_schemas(version: str) -> None:
    found = manifests()
    kinds = {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap"}
    assert {doc["kind"] for _, doc in found} >= kinds
    for path, doc in found:
        try:
            # strict: a misspelt field (periodSecond) is an error, not something the cluster silently drops
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']} against {version}: {exc.message}")


def test_the_schema_check_catches_a_misspelt_field() -> None:
    sts = json.loads(json.dumps(statefulset()))
    probe = sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert {"haproxy.yaml", "statefulset.yaml"} <= files
    assert sorted(kustomization["resources"]) == sorted(files)
    (image,) = kustomization["images"]
    assert image["name"] == corral_container()["image"]


def test_statefulset_probes_drain_and_security() -> None:
    sts = statefulset()
    pod = sts["spec"]["template"]["spec"]
    c = corral_container()
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # a store per pod
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/var/lib/corral"} in c["volumeMounts"]
    # readiness and liveness on the two endpoints, a startup budget for the preloads, all on the named port
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
    port_names = {p["name"] for p in c["ports"] if p["containerPort"] == 11434}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in port_names
    # the grace period covers the preStop pause and the whole drain
    settings = {k: v for cm in resource("ConfigMap") for k, v in cm["data"].items()}
    pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = int(settings["CORRAL_DRAIN_TIMEOUT"].removesuffix("s"))
    assert pod["terminationGracePeriodSeconds"] >= pause + drain + 10
    # settings: from the ConfigMap, the instance from the pod's name, the key from a Secret file
    assert {"configMapRef": {"name": resource("ConfigMap")[0]["metadata"]["name"]}} in c["envFrom"]
    env = {e["name"]: e for e in c["env"]}
    assert env["CORRAL_INSTANCE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["CORRAL_API_KEY_FILE"]["value"].startswith(
        next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "api-key")
    )
    assert settings["CORRAL_PRELOAD_PULL"] == "true"
    assert all(k.startswith("CORRAL_") for k in settings)
    assert pod["enableServiceLinks"] is False  # no CORRAL_PORT & co from the Service named corral
    # non-root, the image's numeric user
    user = next(rest for word, rest in final_stage() if word == "USER")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == user
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # resources: requests always, a memory limit 2 GiB above CORRAL_RAM_BUDGET; the GPU as a comment
    assert {"cpu", "memory"} <= c["resources"]["requests"].keys()
    limit_gib = int(c["resources"]["limits"]["memory"].removesuffix("Gi"))
    assert settings["CORRAL_RAM_BUDGET"] == f"{limit_gib - 2}GiB"
    assert "# nvidia.com/gpu: 1" in (KUBERNETES / "statefulset.yaml").read_text()


def test_services_and_disruption_budget_select_the_pods() -> None:
    sts = statefulset()
    labels = sts["spec"]["template"]["metadata"]["labels"]
    services = {s["metadata"]["name"]: s for s in resource("Service") if s["metadata"]["name"].startswith("corral")}
    assert set(services) == {"corral", "corral-headless", "corral-haproxy"}
    assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    for name in ("corral", "corral-headless"):
        assert services[name]["spec"]["selector"].items() <= labels.items()
        assert [(p["port"], p["targetPort"]) for p in services[name]["spec"]["ports"]] == [(11434, "http")]
    pdbs = {p["metadata"]["name"]: p for p in resource("PodDisruptionBudget")}
    assert pdbs["corral"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdbs["corral"]["spec"]["maxUnavailable"] == 1 < sts["spec"]["replicas"]
    # the balancer's Service, PDB and pods go together, and select none of corral's pods
    (balancer,) = resource("Deployment")
    balancer_labels = balancer["spec"]["template"]["metadata"]["labels"]
    for selector in (services["corral-haproxy"]["spec"]["selector"], pdbs["corral-haproxy"]["spec"]["selector"]):
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= balancer_labels.items() and not selector.items() <= labels.items()
    assert pdbs["corral-haproxy"]["spec"]["maxUnavailable"] < balancer["spec"]["replicas"]


def load_haproxy_cfg_module() -> Any:
    spec = importlib.util.spec_from_file_location("haproxy_cfg", PACKAGING / "haproxy" / "haproxy_cfg.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_balancer_configuration_is_the_generators_for_the_statefulsets_pods() -> None:
    sts = statefulset()
    name, headless = sts["metadata"]["name"], sts["spec"]["serviceName"]
    pods = [f"{name}-{i}" for i in range(sts["spec"]["replicas"])]
    servers = [(pod, f"{pod}.{headless}.default.svc.cluster.local:11434") for pod in pods]
    cfg = (KUBERNETES / "haproxy.cfg").read_text()
    args = " ".join(f"{n}={a}" for n, a in servers)
    assert cfg == load_haproxy_cfg_module().render(servers), (
        f"write it again: python3 packaging/haproxy/haproxy_cfg.py {args} > packaging/kubernetes/haproxy.cfg"
    )
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    (generator,) = kustomization["configMapGenerator"]
    assert generator["files"] == ["haproxy.cfg"]
    (balancer,) = resource("Deployment")
    pod = balancer["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["configMap"]["name"] == generator["name"]
    (container,) = pod["containers"]
    mount = {"name": volume["name"], "mountPath": "/usr/local/etc/haproxy", "readOnly": True}
    assert mount in container["volumeMounts"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"bind *:{ports['http']}" in cfg and f"bind *:{ports['stats']}" in cfg
    assert pod["securityContext"]["runAsNonRoot"] is True
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("HAProxy is not installed: the configuration's syntax was not checked (.ci/run installs it)")
    r = subprocess.run([haproxy, "-c", "-f", str(KUBERNETES / "haproxy.cfg")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# -- compose ------------------------------------------------------------------------------------------------------
def test_compose_services_ports_and_health_checks_match_the_docs() -> None:
    services = compose()["services"]
    documented = compose_table()
    assert sorted(documented) == sorted(services)
    for name, svc in services.items():
        assert sorted(documented[name]["ports"]) == sorted(svc.get("ports", [])), name
        check = " ".join(svc["healthcheck"]["test"])
        assert documented[name]["health"], f"{name}: the table names no health check"
        for fragment in documented[name]["health"]:
            assert fragment in check, f"{name}: the health check {check!r} does not contain {fragment!r}"
    # every published port is documented once: no two services on one host port
    host_ports = [p.rsplit(":", 1)[0] for svc in services.values() for p in svc.get("ports", [])]
    assert len(host_ports) == len(set(host_ports))


def test_compose_replicas_registry_and_balancer() -> None:
    data = compose()
    services = data["services"]
    replicas = {n: s for n, s in services.items() if n.startswith("corral-")}
    assert len(replicas) == 3
    volumes = set()
    for name, svc in replicas.items():
        env = svc["environment"]
        assert env["CORRAL_INSTANCE"] == name
        assert env["CORRAL_PRELOAD_PULL"] == "true"
        assert "CORRAL_PRELOAD" in env and "CORRAL_API_KEY" in env
        (volume,) = svc["volumes"]
        store, _, mount = volume.partition(":")
        assert mount == "/var/lib/corral" and store in data["volumes"]
        volumes.add(store)
        build = svc["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == CONTAINERFILE
        assert svc["depends_on"]["registry"]["condition"] == "service_healthy"
        drain = int(env["CORRAL_DRAIN_TIMEOUT"].removesuffix("s"))
        assert int(svc["stop_grace_period"].removesuffix("s")) > drain
    assert len(volumes) == 3, "each replica has its own store"
    haproxy = services["haproxy"]
    assert set(haproxy["depends_on"]) == set(replicas)
    (config,) = haproxy["volumes"]
    source = config.split(":")[0]
    assert (COMPOSE.parent / source).resolve() == (PACKAGING / "haproxy" / "haproxy.cfg").resolve()
    for svc in services.values():
        for dep, cond in svc.get("depends_on", {}).items():
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no health check to wait for"


def test_haproxy_config_names_the_compose_replicas() -> None:
    cfg = PACKAGING / "haproxy" / "haproxy.cfg"
    if not cfg.exists():
        pytest.skip("packaging/haproxy/haproxy.cfg is not there yet")
    text = cfg.read_text()
    for name in (n for n in compose()["services"] if n.startswith("corral-")):
        assert f"{name}:11434" in text, f"haproxy.cfg has no server line for the compose replica {name}"


# -- Containerfile --------------------------------------------------------------------------------------------------
def test_containerfile_runs_as_non_root_with_health_check_volume_and_port() -> None:
    stage = final_stage()
    words = [w for w, _ in stage]
    (user,) = [rest for w, rest in stage if w == "USER"]
    name, _, group = user.partition(":")
    assert name not in ("root", "0") and group not in ("root", "0")
    assert name.isdigit(), "a numeric USER, so that Kubernetes' runAsNonRoot can check it"
    assert "HEALTHCHECK" in words
    assert "11434" in " ".join(rest for w, rest in stage if w == "EXPOSE").split()
    env = stage_env(stage)
    assert env["CORRAL_HOST"] == "0.0.0.0:11434"
    (volume,) = [exec_form(rest) for w, rest in stage if w == "VOLUME"]
    for setting in ("CORRAL_MODELS", "CORRAL_KV_DISK_DIR"):
        assert any(env[setting] == v or env[setting].startswith(v + "/") for v in volume), setting
    labels = " ".join(rest for w, rest in stage if w == "LABEL")
    assert "org.opencontainers.image.title" in labels
    assert exec_form(next(rest for w, rest in stage if w == "ENTRYPOINT"))[-1] == "corral"
    assert exec_form(next(rest for w, rest in stage if w == "CMD")) == ["serve"]
    # two stages: the runtime receives the build stage's environment, not a compiler
    assert [w for w, _ in instructions()].count("FROM") == 2


def test_containerfile_copies_what_exists_and_what_the_build_context_holds() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied: set[str] = set()
    for word, rest in instructions():
        if word not in ("COPY", "ADD"):
            continue
        assert word == "COPY", "ADD fetches and unpacks; COPY is what is meant"
        args = shlex.split(rest)
        if any(a.startswith("--from=") for a in args):
            continue
        sources = [a for a in args if not a.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert not ignored(source.split("/")[0], patterns), f"COPY {source}: .dockerignore keeps it out"
            copied.add(source.rstrip("/"))
    # everything the wheel is built from: the packages pyproject.toml names, pyproject.toml and its readme
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = set(project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"])
    needed |= {"pyproject.toml", project["project"]["readme"]}
    assert needed <= copied, f"the image misses {sorted(needed - copied)}"
    # and the build stage finds the llama-cpp-python pin the way its RUN line does
    assert len(re.findall(r'"llama-cpp-python==[^"]*"', (REPO / "pyproject.toml").read_text())) == 1
    assert """grep -o '"llama-cpp-python==[^"]*"' pyproject.toml""" in CONTAINERFILE.read_text()
    # nothing that is not the image's reaches the context
    for stray in (".venv", "tests", ".git", "bench", "packaging"):
        assert ignored(stray, patterns), stray


# -- the settings the three give, read as the daemon reads them -------------------------------------------------------
def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?message} (the forms compose.yaml uses)."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in environ and (environ[name] or not op.startswith(":")):
            return environ[name]
        if op.endswith("?"):
            raise AssertionError(f"compose would stop: {arg}")
        return arg if op.endswith("-") else ""

    return re.sub(r"\$\{(\w+)(:?[-?])?([^}]*)\}", one, value)


def test_every_corral_setting_given_is_known_and_parses(tmp_path: Path) -> None:
    """A misspelt name (CORRAL_PRELOAD_PULLS) would be ignored silently and a bad value would stop every replica:
    the image's ENV, each compose replica's environment and the ConfigMap with the StatefulSet's env are read by
    Settings.from_env, as `corral serve` reads them inside the container."""
    key_file = tmp_path / "api_key"
    key_file.write_text("k" * 32 + "\n")
    image = stage_env(final_stage())
    sources = {"Containerfile": image}
    caller = {"CORRAL_API_KEY": "k" * 32, "CORRAL_PRELOAD": "http://registry:5000/library/smollm2:135m"}
    for name, svc in compose()["services"].items():
        if name.startswith("corral-"):
            # compose fills ${VAR} and ${VAR:?message} from the caller's environment
            env = {k: interpolate(str(v), caller) for k, v in svc["environment"].items()}
            sources[f"compose {name}"] = image | env
    pod = {k: v for cm in resource("ConfigMap") for k, v in cm["data"].items()}
    for e in corral_container()["env"]:
        pod[e["name"]] = e.get("value", "corral-0")  # the pod's name, from the downward API
    pod["CORRAL_API_KEY_FILE"] = str(key_file)  # the Secret's file, here
    sources["Kubernetes"] = image | pod
    for where, env in sources.items():
        unknown = {k for k in env if k.startswith("CORRAL_")} - ENV_DOCS.keys()
        assert not unknown, f"{where}: no such setting {sorted(unknown)}"
        env = env | {"CORRAL_MODELS": str(tmp_path / "models"), "CORRAL_KV_DISK_DIR": str(tmp_path / "kv")}
        settings = Settings.from_env(env)
        assert settings.host.port == 11434 and not settings.host.is_loopback
        if where != "Containerfile":
            assert settings.api_key and settings.preload_pull and settings.drain_timeout > 0
            assert all(ModelName.is_valid(name) for name in settings.preload), settings.preload
            assert settings.instance in (where.removeprefix("compose "), "corral-0")


# -- the paths, asked of a real daemon ------------------------------------------------------------------------------
@pytest.fixture
def keyed_daemon(tmp_path: Path) -> Iterator[Any]:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", {"CORRAL_API_KEY": "cluster-test-key"})
    try:
        yield d
    finally:
        stop_daemon(d)


def run_check(cmd: list[str], port: int, host: str) -> subprocess.CompletedProcess[str]:
    """A health-check command as the container runs it, pointed at a daemon on this machine."""
    argv = [sys.executable if cmd[0] == "python" else cmd[0], *(a.replace(":11434", f":{port}") for a in cmd[1:])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    env.update({"CORRAL_HOST": host, "PYTHONPATH": str(REPO)})
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, cwd=REPO)


def test_probe_and_health_check_paths_answer_without_the_api_key(keyed_daemon: Any) -> None:
    port = int(keyed_daemon.host.rsplit(":", 1)[1])
    with keyed_daemon.client() as http:
        assert http.get("/api/tags").status_code == 401  # the key is really required elsewhere
        c = corral_container()
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            path = c[probe]["httpGet"]["path"]
            r = http.get(path)
            assert r.status_code == 200, f"{probe} {path}: {r.status_code} {r.text}"
    # the image's HEALTHCHECK and the compose file's, run as they are
    checks = {"Containerfile": healthcheck_command()}
    for name, svc in compose()["services"].items():
        if name.startswith("corral-"):
            checks[f"compose {name}"] = svc["healthcheck"]["test"][1:]  # after "CMD"
    for what, cmd in checks.items():
        r = run_check(cmd, port, keyed_daemon.host)
        assert r.returncode == 0, f"{what}'s health check failed against a live daemon: {r.stderr}"
    stop_daemon(keyed_daemon)
    for what, cmd in checks.items():
        assert run_check(cmd, port, keyed_daemon.host).returncode != 0, f"{what}'s health check passes with no daemon"


# -- building the image (needs an engine and the network) -----------------------------------------------------------
def container_engine() -> str | None:
    for engine in ("podman", "docker"):
        if shutil.which(engine):
            r = subprocess.run([engine, "info"], capture_output=True, timeout=60)
            if r.returncode == 0:
                return engine
    return None


@pytest.mark.slow
def test_the_image_builds_and_serves(tiny_gguf: Path) -> None:
    if not BUILD_IMAGE:
        pytest.skip("building the image compiles llama.cpp (minutes) and pulls a base image: CORRAL_TEST_IMAGE_BUILD=1")
    engine = container_engine()
    if engine is None:
        pytest.skip("no working container engine (podman or docker whose `info` answers)")
    tag = "localhost/corral-test:latest"
    build = subprocess.run(
        [engine, "build", *BUILD_ARGS, "-f", str(CONTAINERFILE), "-t", tag, str(REPO)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    port = free_port()
    run = subprocess.run(
        [engine, "run", "-d", *RUN_ARGS, "-p", f"127.0.0.1:{port}:11434", "-e", "CORRAL_API_KEY=image-test-key", tag],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    cid = run.stdout.strip()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert httpx.get(url + "/health/ready", timeout=5).status_code == 200
        r = httpx.get(url + "/api/tags", headers={"Authorization": "Bearer image-test-key"}, timeout=5)
        assert r.status_code == 200
        uid = subprocess.run([engine, "exec", cid, "id", "-u"], capture_output=True, text=True, timeout=60)
        assert uid.stdout.strip() == "10001"
        # the image's own HEALTHCHECK command, inside the container
        check = subprocess.run([engine, "exec", cid, *healthcheck_command()], capture_output=True, timeout=60)
        assert check.returncode == 0, check.stderr
        # llama.cpp works in the image: a model created through the API (the CLI uploads it) answers
        (tiny_gguf.parent / "Modelfile").write_text(f"FROM {tiny_gguf}\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        env.update({"CORRAL_HOST": f"127.0.0.1:{port}", "CORRAL_API_KEY": "image-test-key", "PYTHONPATH": str(REPO)})
        create = subprocess.run(
            [sys.executable, "-m", "cli", "create", "tiny", "-f", str(tiny_gguf.parent / "Modelfile")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert create.returncode == 0, create.stdout + create.stderr
        body = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 4}}
        r = httpx.post(
            url + "/api/generate", json=body, headers={"Authorization": "Bearer image-test-key"}, timeout=300
        )
        assert r.status_code == 200 and r.json()["done"] and r.json()["eval_count"] >= 1, r.text
        assert r.headers["x-corral-instance"]  # the container's hostname, by default
    finally:
        subprocess.run([engine, "rm", "-f", cid], capture_output=True, timeout=120)

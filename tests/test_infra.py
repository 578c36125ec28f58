"""The deployment recipes (infra/compose.yaml, infra/k8s/, infra/docker/) checked as far as this machine can: the YAML
parses, the Kubernetes objects validate against the API's schemas (kubernetes-validate, offline), every VSRQ_*
variable they set is one the code reads, their commands are the Procfile's, GPUs asked for match the devices used,
KEDA scales the worker of the queue it watches, every long-running container has health checks or probes, no image
is `:latest`, both images install from their lock file, the locks agree with each other and with pyproject.toml's
ranges, and the API image's package set (no model stack) imports the API, the reaper and the webhook worker.
`docker compose config` runs where the compose plugin is installed."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from storage.config import OTHER_VARIABLES, Settings
from worker.service import WorkerSettings

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
K8S = [doc for path in sorted((INFRA / "k8s").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]
COMPOSE = yaml.safe_load((INFRA / "compose.yaml").read_text())
DOCKERFILES = {name: (INFRA / "docker" / f"{name}.Dockerfile").read_text() for name in ("api", "worker")}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What only a process that runs jobs needs (the engine, media I/O): never in the API image
MODEL_STACK = {"torch", "diffusers", "transformers", "accelerate", "safetensors", "huggingface-hub", "av", "numpy",
               "pillow", "triton"}  # fmt: skip
PROCFILE = {
    name: shlex.split(command)
    for name, command in re.findall(r"^(\w+):\s*(.+)$", (ROOT / "Procfile").read_text(), flags=re.MULTILINE)
}


def known_variables() -> set[str]:
    """Every VSRQ_* name the code reads: the settings classes' fields, and names it looks up itself."""
    names = {f"VSRQ_{field.upper()}" for field in Settings.model_fields}
    names |= {f"VSRQ_WORKER_{field.upper()}" for field in WorkerSettings.model_fields}
    for path in [*ROOT.glob("*/**/*.py"), ROOT / "Procfile"]:
        if ".venv" not in path.parts and "tests" not in path.parts:
            names |= set(re.findall(r"VSRQ_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    return names


def argv(command: list[str] | str) -> list[str]:
    """A container command as the process sees it (`sh -c "exec ..."` unwrapped)."""
    if isinstance(command, str):
        command = shlex.split(command)
    if command[:2] == ["sh", "-c"]:
        command = shlex.split(command[2].removeprefix("exec "))
    return command


def queue_of(command: list[str]) -> str:
    return command[command.index("-Q") + 1]


def containers() -> list[tuple[str, dict]]:
    return [
        (doc["metadata"]["name"], container)
        for doc in K8S
        if doc["kind"] == "Deployment"
        for container in doc["spec"]["template"]["spec"]["containers"]
    ]


def lock(name: str) -> dict[str, Version]:
    """infra/lock/NAME.txt: package -> the version it pins (uv's `name==version ; marker \\` lines)."""
    text = (INFRA / "lock" / f"{name}.txt").read_text()
    return {
        canonicalize_name(package): Version(version)
        for package, version in re.findall(r"^([A-Za-z0-9][\w.-]*)==([^\s;\\]+)", text, flags=re.MULTILINE)
    }


def config_map() -> dict[str, str]:
    return next(doc["data"] for doc in K8S if doc["kind"] == "ConfigMap")


@pytest.mark.parametrize("doc", K8S, ids=lambda doc: f"{doc['kind']}/{doc['metadata']['name']}")
def test_kubernetes_objects_validate(doc):
    if doc["apiVersion"].startswith("keda.sh/"):  # a CRD: no schema ships offline; test_keda checks it
        pytest.skip("KEDA's ScaledObject is a custom resource")
    kubernetes_validate.validate(doc, "1.32.0", strict=True)


def test_every_variable_set_is_read_by_the_code():
    known = known_variables()
    set_here = {name for doc in K8S if doc["kind"] in ("ConfigMap", "Secret") for name in doc.get("data", {})}
    set_here |= {name for doc in K8S if doc["kind"] == "Secret" for name in doc.get("stringData", {})}
    set_here |= {env["name"] for _, container in containers() for env in container.get("env", [])}
    set_here |= set(COMPOSE["x-service-env"])
    set_here |= {name for service in COMPOSE["services"].values() for name in service.get("environment", {})}
    unknown = sorted(name for name in set_here if name.startswith("VSRQ_") and name not in known)
    assert not unknown, f"set in infra/ but read nowhere: {unknown}"
    assert "VSRQ_NOT_A_SETTING" not in known  # the check can fail


def test_commands_are_the_procfiles():
    web, reaper, worker, webhooks = PROCFILE["web"], PROCFILE["reaper"], PROCFILE["worker"], PROCFILE["webhooks"]
    worker_prefix = worker[: worker.index("-Q")]
    # the Procfile's options but their concurrency, which each deployment sizes
    webhooks_options = [option for option in webhooks[: webhooks.index("-Q")] if option.startswith("--without")]
    version = PYPROJECT["version"]
    images = {"api": f"vsrq-api:{version}", "worker": f"vsrq-worker:{version}"}
    served = set(json.loads(config_map()["VSRQ_MODELS"]).values())
    for name, container in containers():
        command = argv(container["command"])
        if command[:3] == ["celery", "-A", "worker.tasks"]:
            assert command[: len(worker_prefix)] == worker_prefix and queue_of(command) in served, name
            assert container["image"] == images["worker"], name
        elif command[:3] == ["celery", "-A", "worker.webhooks"]:
            assert queue_of(command) == "vsrq.webhooks" and container["image"] == images["api"], name
            assert set(webhooks_options) <= set(command) and webhooks_options, name
        else:
            assert command in (web, reaper), name
            assert container["image"] == images["api"], name
    services = COMPOSE["services"]
    assert argv(services["api"]["command"]) == web and argv(services["reaper"]["command"]) == reaper
    assert argv(services["worker-k6"]["command"])[: len(worker_prefix)] == worker_prefix
    assert queue_of(argv(services["webhooks"]["command"])) == "vsrq.webhooks"


def test_every_variable_the_code_reads_is_known_to_the_unknown_variables_check():
    """`storage.config.unknown_variables` warns of VSRQ_* names no setting reads (a typo was ignored unsaid): every name
    the code reads must be one it knows, or each process would warn of a variable it uses."""
    known = {f"VSRQ_{field.upper()}" for field in Settings.model_fields} | OTHER_VARIABLES
    known |= {f"VSRQ_WORKER_{field.upper()}" for field in WorkerSettings.model_fields}
    prefixes = {"VSRQ_S3", "VSRQ_WORKER", "VSRQ_METRICS_DIR"}  # "VSRQ_S3_*" in prose; _VSRQ_METRICS_DIR is internal
    assert known_variables() - known - prefixes == set()


def test_the_procfiles_celery_processes_name_themselves_apart():
    """The Procfile's worker and webhooks ran unnamed, both `celery@HOST` on one host: one entry of the workers'
    registry between them, so /healthz flapped between ok and "no worker takes jobs" and `vsrq status` counted one
    worker. (A container or a pod has a host name of its own: compose and k8s name theirs all the same.)"""
    names = [command[command.index("-n") + 1] for command in (PROCFILE["worker"], PROCFILE["webhooks"])]
    assert len(set(names)) == 2 and all(name.endswith("@%h") for name in names), names


def test_each_worker_reports_the_name_its_model_is_served_under():
    """A worker on a checkpoint directory reported the directory's name (`k6-vsr`) as the model its jobs ran, where
    VSRQ_MODELS serves the hub's name."""
    served = set(json.loads(config_map()["VSRQ_MODELS"])) | set(json.loads(COMPOSE["x-service-env"]["VSRQ_MODELS"]))
    workers = [{item["name"]: item.get("value") for item in container.get("env", [])} for _, container in containers()]
    workers.append(COMPOSE["services"]["worker-k6"]["environment"])
    workers = [env for env in workers if "VSRQ_WORKER_MODEL" in env]
    assert workers, "no worker found"
    for env in workers:
        name = WorkerSettings(model=env["VSRQ_WORKER_MODEL"], served_as=env.get("VSRQ_WORKER_SERVED_AS")).served
        assert name in served, (env, served)


def test_gpus_asked_for_match_the_devices_used():
    for name, container in containers():
        env = {item["name"]: item.get("value") for item in container.get("env", [])}
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        devices = [device for device in (env.get("VSRQ_WORKER_DEVICES") or "").split(",") if device.startswith("cuda")]
        assert gpus == len(devices), name
    worker = COMPOSE["services"]["worker-k6"]
    reserved = worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert reserved["driver"] == "nvidia" and "gpu" in reserved["capabilities"]
    assert reserved["count"] == len(worker["environment"]["VSRQ_WORKER_DEVICES"].split(","))


def test_keda_scales_the_worker_of_the_queue_it_watches():
    deployments = {doc["metadata"]["name"]: doc for doc in K8S if doc["kind"] == "Deployment"}
    scaled = [doc for doc in K8S if doc["kind"] == "ScaledObject"]
    assert scaled
    for doc in scaled:
        target = deployments[doc["spec"]["scaleTargetRef"]["name"]]
        command = argv(target["spec"]["template"]["spec"]["containers"][0]["command"])
        (trigger,) = doc["spec"]["triggers"]
        assert trigger["type"] == "redis" and trigger["metadata"]["listName"] == queue_of(command)
        assert trigger["metadata"]["address"] in config_map()["VSRQ_REDIS_URL"]
        assert 0 <= doc["spec"]["minReplicaCount"] <= doc["spec"]["maxReplicaCount"]


def test_compose_builds_from_dockerfiles_that_exist():
    for name, service in COMPOSE["services"].items():
        build = service.get("build")
        if build:
            assert (INFRA / build["context"] / build["dockerfile"]).is_file(), name


def test_the_api_image_runs_without_the_model_stack(tmp_path):
    assert lock("api") and not set(lock("api")) & MODEL_STACK
    assert {"torch", "diffusers", "av"} <= set(lock("worker"))
    # the model stack's modules made unimportable, as they are in that image
    blocked = ["torch", "diffusers", "transformers", "accelerate", "safetensors", "huggingface_hub", "av", "numpy",
               "PIL"]  # fmt: skip
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}: raise ImportError('not in the API image: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import api.app, worker.reaper, worker.webhooks, worker.metrics, storage.overview\n"
        "api.app.create_app(api.app.Settings(api_keys=[{'id': 'a', 'token': 's' * 16}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_docker_compose_config():
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker CLI with its compose plugin is not installed here")
    result = subprocess.run(
        [docker, "compose", "-f", str(INFRA / "compose.yaml"), "config", "--quiet"],
        env={"VSRQ_API_KEYS": "[]", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_the_api_is_given_time_to_finish_its_requests_when_stopped():
    """A deploy stops API pods with SIGTERM: gunicorn finishes the requests in hand for up to its graceful_timeout, but
    the orchestrators' defaults (Kubernetes 30 s, compose 10 s) killed slow uploads mid-way, and their clients' retries
    met the dead request's Idempotency-Key claim (the upgrade trial of session 52)."""
    graceful_s = float(re.search(r"^graceful_timeout = (\d+)", (INFRA / "gunicorn.conf.py").read_text(), re.M)[1])
    (api,) = [doc for doc in K8S if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "vsrq-api"]
    pod = api["spec"]["template"]["spec"]
    pre_stop_s = float(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + graceful_s
    assert float(COMPOSE["services"]["api"]["stop_grace_period"].removesuffix("s")) > graceful_s


def test_no_image_is_latest():
    """Every image a recipe runs or builds from names a version: `:latest` (or no tag) changes under a running
    deployment."""
    images = [container["image"] for _, container in containers()]
    images += [service["image"] for service in COMPOSE["services"].values()]
    images += [
        line.split()[1] for text in DOCKERFILES.values() for line in text.splitlines() if line.startswith("FROM ")
    ]
    assert len(images) >= 10
    untagged = [image for image in images if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")]
    assert untagged == []


def test_every_long_running_container_is_checked():
    for name, text in DOCKERFILES.items():
        assert re.search(r"^HEALTHCHECK .*\\\n\s+CMD ", text, flags=re.MULTILINE), name
    services = COMPOSE["services"]
    for name, service in services.items():
        healthcheck = service.get("healthcheck") or {}
        built_with_one = service.get("build") is not None  # the image's HEALTHCHECK
        assert healthcheck.get("test") or built_with_one or (healthcheck.get("disable") and name == "reaper"), name
        for needed, condition in (service.get("depends_on") or {}).items():
            assert condition == {"condition": "service_healthy"}, (name, needed)
    assert set(services["api"]["depends_on"]) == {"redis", "seaweedfs"} <= set(services["worker-k6"]["depends_on"])
    probes = {name: {probe for probe in container if probe.endswith("Probe")} for name, container in containers()}
    assert probes["vsrq-worker-k6"] == {"startupProbe", "livenessProbe", "readinessProbe"}
    assert probes["vsrq-api"] == {"startupProbe", "livenessProbe", "readinessProbe"}
    assert "livenessProbe" in probes["vsrq-webhooks"]
    # a probe asks a port the container declares
    for name, container in containers():
        ports = {port["name"] for port in container.get("ports", [])}
        for probe in probes[name]:
            check = container[probe].get("httpGet") or container[probe].get("tcpSocket")
            assert check["port"] in ports, (name, probe)


def test_the_worker_user_has_a_home_and_caches():
    worker = DOCKERFILES["worker"]
    for variable in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        assert re.search(rf"\b{variable}=/", worker), variable
    assert "--create-home" in worker and "USER vsrq" in worker
    mounts = {mount["mountPath"] for _, container in containers() for mount in container.get("volumeMounts", [])}
    assert "/cache" in mounts


def test_images_install_from_their_lock_file():
    for name, text in DOCKERFILES.items():
        installs = [line for line in text.splitlines() if re.search(r"\bpip install\b", line)]
        assert f"COPY infra/lock/{name}.txt /tmp/lock.txt" in text, name
        assert installs == [
            "RUN pip install --require-hashes --no-deps -r /tmp/lock.txt",
            "RUN pip install --no-deps .",
        ], name
    ci = (ROOT / ".ci" / "run").read_text() + (ROOT / "Makefile").read_text()
    assert "--require-hashes" in ci and "infra/lock/test.txt" in ci and "apt-get install -y -qq redis-server" not in ci


@pytest.mark.parametrize("name, extra", [("api", "api"), ("worker", "worker"), ("test", "test")])
def test_each_lock_pins_what_pyproject_asks_within_its_ranges(name, extra):
    """A lock made before pyproject.toml changed fails here (`make lock` writes them again)."""
    pins = lock(name)
    extras = PYPROJECT["optional-dependencies"]

    def wanted(extra: str) -> list[Requirement]:
        found = [Requirement(line) for line in PYPROJECT["dependencies"]]
        for line in extras[extra]:
            requirement = Requirement(line)
            if requirement.name == PYPROJECT["name"]:
                found += [item for nested in sorted(requirement.extras) for item in wanted(nested)]
            else:
                found.append(requirement)
        return found

    for requirement in wanted(extra):
        package = canonicalize_name(requirement.name)
        assert package in pins, f"{package} is in pyproject's [{extra}] but not in infra/lock/{name}.txt: make lock"
        pinned = Version(pins[package].public)  # torch's CPU build, 2.13.0+cpu, is 2.13.0 to a range
        assert requirement.specifier.contains(pinned, prereleases=True), (package, str(pinned), str(requirement))


def test_the_locks_agree_on_every_version():
    locks = {name: lock(name) for name in ("api", "worker", "test")}
    for package in set().union(*locks.values()):
        versions = {name: pins[package].public for name, pins in locks.items() if package in pins}
        assert len(set(versions.values())) == 1, (package, versions)
    assert locks["test"]["torch"].local == "cpu" and locks["worker"]["torch"].local is None  # CPU tests, GPU image

"""Cluster and deployment files, checked without a cluster.

``ray_cluster.yaml`` passes Ray's own cluster-config validation (the JSON schema ``ray up``
uses, then its checks on the filled-in config) and keeps training off the head node. The
manifests in ``deploy/`` parse, name the pinned Ray version and the image ``deploy/Dockerfile``
builds, turn token authentication on, and run ``python -m raydlrm`` commands whose config files
exist and load with their overrides; the scheduled ones have valid cron schedules; the runtime
env keeps local state out of the uploaded working directory.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import tomllib
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from raydlrm.platform.config import load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _one(path: Path, kind: str) -> dict[str, Any]:
    docs = [d for d in _load(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{path.name}: expected one {kind}, found {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return yaml.safe_load((REPO / "ray_cluster.yaml").read_text())


@pytest.fixture(scope="module")
def torch_pin() -> str:
    """The torch release the ``gpu`` extra pins (with fbgemm-gpu; the base install takes a
    range), which the cluster images install first."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (pin,) = [
        d for d in project["optional-dependencies"]["gpu"] if re.fullmatch(r"torch==[\w.+]+", d)
    ]
    return pin


@pytest.fixture(scope="module")
def dockerfile() -> dict[str, Any]:
    """FROM image, WORKDIR and RUN commands of deploy/Dockerfile."""
    lines = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    instructions = [line.split(None, 1) for line in lines if line and not line.startswith("#")]
    return {
        "from": [arg for op, arg in instructions if op == "FROM"],
        "workdir": [arg for op, arg in instructions if op == "WORKDIR"],
        "run": [arg for op, arg in instructions if op == "RUN"],
    }


# --- ray_cluster.yaml -------------------------------------------------------------------------


def test_ray_cluster_yaml_passes_rays_own_validation(cluster: dict[str, Any]) -> None:
    schema_path = Path(ray.autoscaler.__file__).with_name("ray-schema.json")
    jsonschema.validate(cluster, json.loads(schema_path.read_text()))
    # What `ray up` does: fill in the provider's defaults, then validate the result.
    validate_config(prepare_config(copy.deepcopy(cluster)))


def test_head_has_no_training_resources_and_workers_have_gpus(cluster: dict[str, Any]) -> None:
    node_types = cluster["available_node_types"]
    head = node_types[cluster["head_node_type"]]
    assert head["resources"].get("CPU") == 0
    assert head["resources"].get("GPU", 0) == 0
    (start,) = [c for c in cluster["head_start_ray_commands"] if "ray start" in c]
    assert "--head" in shlex.split(start) and "--num-cpus=0" in shlex.split(start)
    workers = {name: t for name, t in node_types.items() if name != cluster["head_node_type"]}
    assert workers
    for name, node_type in workers.items():
        assert node_type["resources"].get("GPU", 0) >= 1, name
        assert node_type["resources"].get("CPU", 0) >= node_type["resources"]["GPU"], name


def test_image_pins_the_installed_ray_and_sets_shared_memory(
    cluster: dict[str, Any], dockerfile: dict[str, Any]
) -> None:
    docker = cluster["docker"]
    match = re.fullmatch(r"rayproject/ray:(?P<ray>[\d.]+)-py(?P<py>\d+)-gpu", docker["image"])
    assert match, docker["image"]
    assert match["ray"] == ray.__version__
    assert match["py"] == f"{sys.version_info.major}{sys.version_info.minor}"
    shm = [o for o in docker["run_options"] if o.startswith("--shm-size=")]
    assert len(shm) == 1 and re.fullmatch(r"--shm-size=\d+g", shm[0]), shm
    # The Kubernetes image is built on the same pinned base.
    assert dockerfile["from"] == [docker["image"]]


def test_setup_installs_raydlrm_after_the_pinned_torch(
    cluster: dict[str, Any], dockerfile: dict[str, Any], torch_pin: str
) -> None:
    for commands in (" && ".join(cluster["setup_commands"]), " && ".join(dockerfile["run"])):
        steps = [shlex.split(step) for step in commands.split("&&")]
        installs = [s[s.index("install") + 1 :] for s in steps if s[:2] == ["pip", "install"]]
        packages = [[a for a in args if not a.startswith("-")] for args in installs]
        torch_at = next(i for i, p in enumerate(packages) if torch_pin in p)
        raydlrm_at = next(i for i, p in enumerate(packages) if any(a.endswith("[gpu]") for a in p))
        assert torch_at < raydlrm_at, commands


def test_every_ray_node_uses_token_authentication(cluster: dict[str, Any]) -> None:
    assert "--env=RAY_AUTH_MODE=token" in cluster["docker"]["run_options"]
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


# --- deploy/ ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_every_deploy_yaml_parses(path: Path) -> None:
    docs = _load(path)
    assert docs and all(isinstance(d, dict) for d in docs)
    if path.name != "runtime_env.yaml":
        assert all({"apiVersion", "kind", "metadata", "spec"} <= d.keys() for d in docs)


_CRON_RANGES = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]


def _is_cron(expr: str) -> bool:
    """A standard five-field cron expression (numbers, ``*``, ranges, lists, steps)."""
    fields = expr.split()
    if len(fields) != len(_CRON_RANGES):
        return False
    for text, (low, high) in zip(fields, _CRON_RANGES, strict=True):
        for part in text.split(","):
            m = re.fullmatch(r"(?:\*|(\d+)(?:-(\d+))?)(?:/(\d+))?", part)
            if m is None or (m[3] is not None and int(m[3]) == 0):
                return False
            if m[1] is not None and not low <= int(m[1]) <= int(m[2] or m[1]) <= high:
                return False
    return True


@pytest.mark.parametrize(
    ("expr", "valid"),
    [("0 3 * * *", True), ("*/15 0-6 1,15 * 1-5", True), ("0 3 * *", False),
     ("61 * * * *", False), ("0 3 * * * *", False), ("@daily", False), ("5-1 * * * *", False)],
)  # fmt: skip
def test_cron_check(expr: str, valid: bool) -> None:
    assert _is_cron(expr) is valid


def _workdir(dockerfile: dict[str, Any]) -> str:
    (workdir,) = dockerfile["workdir"]
    return workdir.rstrip("/") + "/"


def _raydlrm_command(argv: list[str], dockerfile: dict[str, Any]) -> tuple[str, Path, list[str]]:
    """(subcommand, config file in this checkout, overrides) of ``python -m raydlrm ...``;
    a config under the image's raydlrm directory (the Dockerfile's WORKDIR) is the same file
    in this checkout."""
    assert argv[:3] == ["python", "-m", "raydlrm"], argv
    config = argv[argv.index("--config") + 1]
    config = config.removeprefix(_workdir(dockerfile))
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    return argv[3], REPO / config, overrides


KUBERAY = [
    ("rayjob.yaml", "RayJob", "train"),
    ("raycronjob.yaml", "RayCronJob", "retrain"),
    ("cronjob.yaml", "RayCluster", None),
]


@pytest.mark.parametrize(("name", "kind", "command"), KUBERAY)
def test_kuberay_manifests(
    name: str, kind: str, command: str | None, dockerfile: dict[str, Any]
) -> None:
    doc = _one(DEPLOY / name, kind)
    assert doc["apiVersion"] == "ray.io/v1"
    job = doc["spec"]["jobTemplate"] if kind == "RayCronJob" else doc["spec"]
    cluster = job.get("rayClusterSpec", job)
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    groups = cluster["workerGroupSpecs"]
    assert groups
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        mounts = group["template"]["spec"]["containers"][0].get("volumeMounts", [])
        assert any(m["mountPath"] == "/dev/shm" for m in mounts), group["groupName"]
    images = {
        c["image"] for spec in [head, *groups] for c in spec["template"]["spec"]["containers"]
    }
    assert len(images) == 1 and not next(iter(images)).endswith(":latest"), images
    if kind == "RayCronJob":
        # The fields of KubeRay's RayCronJobSpec (ray-operator/apis/ray/v1/raycronjob_types.go).
        assert doc["spec"].keys() <= {"schedule", "jobTemplate", "timeZone", "suspend"}
        assert _is_cron(doc["spec"]["schedule"])
    if command is not None:
        subcommand, config, overrides = _raydlrm_command(shlex.split(job["entrypoint"]), dockerfile)
        assert subcommand == command
        assert config.parent == REPO / "configs" and config.is_file(), config
        load_config(config, overrides=overrides)


def test_cronjob_submits_retrain_to_the_long_lived_cluster(dockerfile: dict[str, Any]) -> None:
    path = DEPLOY / "cronjob.yaml"
    cluster, cron = _one(path, "RayCluster"), _one(path, "CronJob")
    assert cron["apiVersion"] == "batch/v1"
    assert _is_cron(cron["spec"]["schedule"])
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["workingDir"] == _workdir(dockerfile).rstrip("/")
    argv = [*container.get("command", []), *container.get("args", [])]
    split = argv.index("--")
    submit, entrypoint = argv[:split], argv[split + 1 :]
    assert submit[:3] == ["ray", "job", "submit"] and "--no-wait" not in submit
    # KubeRay names a RayCluster's head Service <name>-head-svc; 8265 is the Jobs API.
    address = submit[submit.index("--address") + 1]
    assert address == f"http://{cluster['metadata']['name']}-head-svc:8265"
    runtime_env = submit[submit.index("--runtime-env") + 1]
    assert (REPO / runtime_env).is_file() and runtime_env.startswith("deploy/")
    subcommand, config, overrides = _raydlrm_command(entrypoint, dockerfile)
    assert subcommand == "retrain" and config == REPO / "configs" / "retrain.toml"
    load_config(config, overrides=overrides)
    env = {e["name"]: e for e in container["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    secret = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    # The token the cluster runs with: KubeRay reads key auth_token of authOptions.secretName.
    assert secret == {"name": cluster["spec"]["authOptions"]["secretName"], "key": "auth_token"}


def test_runtime_env_keeps_local_state_out_of_the_upload() -> None:
    from ray._private.runtime_env.packaging import _get_excludes
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert env.keys() <= set(RuntimeEnv.known_fields)
    RuntimeEnv(**env)
    assert env["working_dir"] == "."
    assert env["env_vars"]["PYTHONPATH"] == "src"
    # Ray's own matcher, on the excludes alone: the image's copy of the repo has no .gitignore.
    excluded = _get_excludes(REPO, env["excludes"])
    for local_state in (
        ".venv/bin/python",
        ".git/HEAD",
        "data/synthetic/train/part-0.parquet",
        "runs/raydlrm-1/checkpoint_000001/state.json",
        "mlruns/0/meta.yaml",
        "notebooks/mlruns/1/meta.yaml",
        "notebooks/quickstart-run/mlflow.db",
        "exported/artifacts/checkpoint/model.safetensors",
        "preds/part-0.parquet",
        "model.safetensors",
        "mlartifacts/1/model.pt",
        "mlflow.db",
        "src/raydlrm.egg-info/PKG-INFO",
        "src/raydlrm/__pycache__/cli.cpython-311.pyc",
    ):
        assert excluded(REPO / local_state), local_state
    for code in (
        "src/raydlrm/__init__.py",
        "src/raydlrm/ingestion/reader.py",
        "configs/retrain.toml",
        "deploy/runtime_env.yaml",
        "pyproject.toml",
    ):
        assert not excluded(REPO / code), code


def test_runtime_env_example_says_where_relative_paths_go() -> None:
    """The header's example command passes ``RAYDLRM_BASE_DIR`` (the job runs in a copy Ray
    deletes; without it a config with relative paths stops at once), and its config loads."""
    text = (DEPLOY / "runtime_env.yaml").read_text()
    example = " ".join(
        line.lstrip("#").strip().rstrip("\\")
        for line in text.splitlines()
        if line.startswith("#   ") or line.startswith("#       ")
    )
    assert "ray job submit" in example and "--runtime-env deploy/runtime_env.yaml" in example
    entrypoint = shlex.split(example.split(" -- ", 1)[1])
    assert entrypoint[0].startswith("RAYDLRM_BASE_DIR=/"), entrypoint
    assert entrypoint[1:5] == ["python", "-m", "raydlrm", "train"], entrypoint
    load_config(REPO / entrypoint[entrypoint.index("--config") + 1])


_OUTPUT_COMMANDS = (
    # (what writes, the pattern of its output argument in README.md)
    ("raydlrm score", r"raydlrm score \S+ \S+ (\S+)"),
    ("raydlrm export", r"raydlrm export \S+ --output (\S+)"),
    ("raydlrm checkpoint unshard", r"checkpoint unshard \S+ (\S+?)`"),
    ("raydlrm.score", r'raydlrm\.score\("[^"]+", "[^"]+", "([^"]+)"\)'),
)


@pytest.mark.parametrize(
    ("what", "pattern"), _OUTPUT_COMMANDS, ids=[c[0] for c in _OUTPUT_COMMANDS]
)
def test_readme_writes_outputs_where_neither_git_nor_an_upload_looks(what: str, pattern: str):
    """A model or predictions written into the checkout would be uploaded by the next ``ray
    job submit --working-dir .`` (an 80 MiB model.safetensors: HTTP 413): the README's examples
    write under an ignored folder, which the runtime env's excludes also skip."""
    from ray._private.runtime_env.packaging import _get_excludes, _get_ignore_file

    outputs = re.findall(pattern, (REPO / "README.md").read_text())
    assert outputs, f"README.md has no {what} example"
    gitignored = _get_ignore_file(REPO, ".gitignore")
    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    excluded = _get_excludes(REPO, env["excludes"])
    for output in outputs:
        written = REPO / output.replace("<run>", "raydlrm-1") / "part-0.parquet"
        assert gitignored(written) and excluded(written), f"{what} writes {output}"

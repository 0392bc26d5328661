"""The package's layering, read from its source (every import, lazy ones included), against the
rules docs/architecture.md states: which folder may import what, and no import cycle anywhere."""

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "megatron_sao"


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


def in_folder(folder: str) -> dict[str, set[str]]:
    return {str(p.relative_to(PKG)): imports(p) for p in (PKG / folder).rglob("*.py")}


def offending(folder: str, allowed) -> dict[str, list[str]]:
    bad = {f: sorted(i for i in imps if not allowed(i)) for f, imps in in_folder(folder).items()}
    return {f: v for f, v in bad.items() if v}


def project(prefixes: tuple[str, ...]):
    """Allowed: anything outside megatron_sao, and the megatron_sao packages named by `prefixes`."""
    return lambda i: not i.startswith("megatron_sao") or i.startswith(prefixes)


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


def test_the_rollout_side_knows_no_trainer_config_or_megatron():
    """rollout/ (every sub-folder) sees trajectories, environments and the process-wide helpers only."""
    assert {"rollout/colocate/cycle.py", "rollout/engines/vllm_engine.py"} <= set(in_folder("rollout"))
    allowed = project(("megatron_sao.rollout", "megatron_sao.trajectory", "megatron_sao.envs",
                       "megatron_sao.distributed"))
    assert offending("rollout", lambda i: allowed(i) and not i.startswith("megatron.")) == {}


def test_code_that_runs_in_vllm_workers_imports_only_torch_vllm_and_itself():
    stdlib = sys.stdlib_module_names
    allowed = {"torch", "vllm", "safetensors"}
    ok = project(("megatron_sao.rollout.vllm_worker",))
    assert "rollout/vllm_worker/extension.py" in in_folder("rollout/vllm_worker")
    assert offending("rollout/vllm_worker", lambda i: ok(i) and (i.startswith("megatron_sao") or i == "__future__"
                                                               or i.split(".")[0] in stdlib | allowed)) == {}


def test_the_worker_extension_path_names_the_class_vllm_imports():
    from megatron_sao.rollout.vllm_worker import WORKER_EXTENSION

    module, cls = WORKER_EXTENSION.rsplit(".", 1)
    assert module in MODULES and f"class {cls}" in MODULES[module].read_text()


def test_process_wide_helpers_and_the_algorithms_stand_alone():
    assert offending("distributed", project(("megatron_sao.distributed",))) == {}
    assert offending("algorithms", project(("megatron_sao.algorithms",))) == {}


def test_the_engine_protocol_is_types_only_and_the_factory_imports_the_backends():
    proto = imports(MODULES["megatron_sao.rollout.engines.protocol"])
    assert not {i for i in proto if i.startswith("megatron_sao.rollout")}
    factory = imports(MODULES["megatron_sao.rollout.engines.factory"])
    assert {f"megatron_sao.rollout.engines.{b}" for b in ("hf_engine", "vllm_engine", "vllm_server_client")} <= factory

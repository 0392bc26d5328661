"""The rollout package's layering, read from its source (every import, lazy ones included):
nothing in rollout/ imports trainer/ (or the run config), and its modules import each other without
a cycle (the protocol apart from the backend factory)."""

import ast
from pathlib import Path

ROLLOUT = Path(__file__).resolve().parents[2] / "megatron_sao" / "rollout"


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def graph() -> dict[str, set[str]]:
    mods = {p.stem: p for p in ROLLOUT.glob("*.py") if p.stem != "__init__"}
    return {m: {i.split(".")[2] for i in imports(p) if i.startswith("megatron_sao.rollout.")
                and i.split(".")[2] in mods and i.split(".")[2] != m} for m, p in mods.items()}


def test_rollout_imports_nothing_of_the_trainer():
    bad = {p.name: sorted(i for i in imports(p) if i.startswith(("megatron_sao.trainer", "megatron_sao.config")))
           for p in ROLLOUT.glob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_rollout_modules_import_each_other_without_a_cycle():
    g = graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            assert state.get(n) != 1, f"import cycle: {' -> '.join(path + [m, n])}"
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert g["protocol"] == set()  # the protocol is types only; the factory imports the backends
    assert {"hf_engine", "vllm_engine", "vllm_server_client"} <= g["factory"]

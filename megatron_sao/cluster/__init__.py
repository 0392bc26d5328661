"""Cluster launch: layout/memory planner, SLURM launch plan, local multi-process launcher.

Modules (one idea each):
    hostlist     SLURM hostlist expansion ("node[01-04],gpu7"), no scontrol needed
    memory       per-GPU memory formulas (params, optimizer, activations, KV cache), cited
    layout       divisibility/placement checks naming the config field to change
    planner      `sao plan`: plan(cfg, hf_config) -> Plan, main(argv) -> exit code
    launch_plan  roles/ranks/ports/commands of a SLURM job (consumed by slurm/common.sh)
    supervisor   start/health-check/stop process groups (local twin of slurm/common.sh)
    launch_local the disaggregated launch on one machine (CI)
    convert_cmd  the checkpoint-conversion command with the recipe's TP/PP/EP
"""

# Lazy re-exports: the planner pulls in transformers (seconds to import), which the launch-plan
# CLI that every node runs at start-up does not need.
_EXPORTS = {
    "HostlistError": "hostlist", "expand_hostlist": "hostlist",
    "Layout": "layout", "LayoutError": "layout", "LayoutProblem": "layout", "check_layout": "layout",
    "Plan": "planner", "PlanOptions": "planner", "plan": "planner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"megatron_sao.cluster.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megatron_sao.cluster' has no attribute {name!r}")

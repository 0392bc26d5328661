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

from megatron_sao.cluster.hostlist import HostlistError, expand_hostlist
from megatron_sao.cluster.layout import Layout, LayoutError, LayoutIssue, check_layout
from megatron_sao.cluster.planner import Plan, PlanOptions, plan

__all__ = ["HostlistError", "expand_hostlist", "Layout", "LayoutError", "LayoutIssue", "check_layout", "Plan",
           "PlanOptions", "plan"]

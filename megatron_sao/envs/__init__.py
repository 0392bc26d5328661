"""Environments: the protocol, the Python sandbox, and the math / coding / SWE / style-shift / toy tasks.

Import concrete environments from their modules (``megatron_sao.envs.toy_tool`` ...) or by name
through ``make_env`` / ``load_tasks``; this package only re-exports the light-weight protocol.
"""

from megatron_sao.envs.base import Environment, ListTaskSource, StepResult, Task, TaskSource
from megatron_sao.envs.registry import available_envs, load_tasks, make_env, register_env

__all__ = ["Environment", "ListTaskSource", "StepResult", "Task", "TaskSource",
           "available_envs", "load_tasks", "make_env", "register_env"]

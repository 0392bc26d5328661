"""mini-swe-agent as the harness: its own agent loop, its model over litellm pointed at the episode's endpoint.

``run_agent`` runs in a harness thread (mini-swe-agent is synchronous): ``DefaultAgent`` with a
``LitellmModel`` whose ``model_name`` is ``openai/<endpoint model>`` and whose ``api_base`` / ``api_key`` are
the episode's (rollout/agent_endpoint/), and ``SandboxShell`` as its environment. Its prompts come from
``agent_config``:

* ``"swebench"``: mini-swe-agent's own ``benchmarks/swebench.yaml`` (the agent's system and instance
  templates, the model's observation and format-error templates, its model kwargs), read from the
  installed package, with its ``/testbed`` replaced by the workspace's path;
* ``"compact"``: short prompts of our own for models with a small context (the char-level demo model);
* a path to a YAML file with mini-swe-agent's ``agent:`` and ``model:`` sections.

The run's limits replace the config's: ``step_limit`` (model calls), no cost limit (a local model costs
nothing, and litellm knows no price for it: cost tracking is off), ``wall_time_limit_seconds``.
Environment variables set here before mini-swe-agent is imported: no start-up banner, litellm's bundled
price map (no download at import: compute nodes are usually offline), mini-swe-agent's model retries
capped at 3 (a request to the local endpoint that fails twice will not succeed later).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml

from megatron_sao.envs.base import ModelEndpoint

COMPACT = {
    "agent": {
        "system_template": "You fix bugs in a Python repository. Call the bash tool with one command per reply.",
        "instance_template": "{{task}}\nWhen the fix is done, run: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
    },
    "model": {
        "observation_template": "<returncode>{{output.returncode}}</returncode>\n<output>\n"
                                "{{ output.output[-2000:] }}</output>",
        "format_error_template": "{{error}}",
    },
}
_ENV = {"MSWEA_SILENT_STARTUP": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_COST_TRACKING": "ignore_errors",
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "3"}


def load_agent_config(spec: str, cwd: str) -> dict:
    """mini-swe-agent's ``agent`` and ``model`` sections for ``spec`` (module docstring)."""
    if spec == "compact":
        return {k: dict(v) for k, v in COMPACT.items()}
    if spec == "swebench":
        from minisweagent.config import builtin_config_dir

        path = builtin_config_dir / "benchmarks" / "swebench.yaml"
    else:
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"mini-swe-agent config {spec!r} not found (env.kwargs.agent_config: swebench, "
                                    "compact or a YAML path)")
    data = yaml.safe_load(path.read_text().replace("/testbed", cwd))
    return {"agent": dict(data.get("agent") or {}), "model": dict(data.get("model") or {})}


def run_agent(problem: str, endpoint: ModelEndpoint, shell: Any, agent_config: str, *, step_limit: int,
              wall_limit_s: float, request_timeout_s: float, model_class: str = "litellm",
              model_kwargs: dict | None = None) -> dict:
    """Run one mini-swe-agent episode to its end (in a harness thread: its imports and its config file are
    read here, off the rollout's loop); returns what the agent says about it."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    config = load_agent_config(agent_config, shell.config.cwd)
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models import get_model_class

    litellm.suppress_debug_info = True  # its "Provider List" banner on every price it does not know
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "httpx", "agent", "minisweagent", "litellm_model"):
        logging.getLogger(name).setLevel(logging.WARNING)  # a line per model call otherwise, under the trainer's INFO

    model_cfg = {k: v for k, v in config["model"].items() if k not in ("model_name", "model_class", "model_kwargs",
                                                                       "cost_tracking")}
    kwargs = {**(config["model"].get("model_kwargs") or {}), **(model_kwargs or {}),
              "api_base": endpoint.base_url, "api_key": endpoint.api_key, "timeout": request_timeout_s}
    cls = get_model_class(f"openai/{endpoint.model}", model_class)
    model = cls(model_name=f"openai/{endpoint.model}", model_kwargs=kwargs, cost_tracking="ignore_errors", **model_cfg)
    agent_cfg = {k: v for k, v in config["agent"].items() if k not in ("step_limit", "cost_limit",
                                                                       "wall_time_limit_seconds", "output_path")}
    agent = DefaultAgent(model, shell, **agent_cfg, step_limit=step_limit, cost_limit=0.0,
                         wall_time_limit_seconds=max(1, int(wall_limit_s)))
    try:
        result = agent.run(problem)
        exit_status, error = result.get("exit_status", ""), None
    except Exception as e:  # the harness crashed (its model refused: the episode ended, or the endpoint failed)
        exit_status, error = type(e).__name__, f"{type(e).__name__}: {e}"
    return {"exit_status": exit_status, "model_calls": agent.n_calls, "commands": shell.commands,
            "harness_error": error}

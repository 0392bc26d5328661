"""Per-domain settings (the paper's math and coding runs) that a YAML selects with `preset: math`.

Each preset is a partial config tree; it sits between the dataclass defaults and the file.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Paper settings for reasoning with a Python tool (AIME): DIS band 0.7..6.0.
    "math": {"algorithm": {"eps_low": 0.3, "eps_high": 5.0, "critic_steps": 2, "critic_warmup_steps": 10,
                           "policy_alpha": 1.5, "critic_lambda": 1.0, "gamma": 1.0},
             "actor": {"optim": {"lr": 1e-6}}, "critic": {"optim": {"lr": 5e-6}},
             "buffer": {"batch_size": 128},
             "rollout": {"max_total_tokens": 131072, "max_turns": 50, "temperature": 1.0, "top_p": 1.0},
             "env": {"name": "math_python"}},
    # The paper's settings for its coding (SWE) runs: DIS eps_low 0.8 / eps_high 3.0 (band 0.2..4.0), 300
    # turns, 128K context; the SWE environment (mini-swe-agent through the agent endpoint, envs/swe/).
    "coding": {"algorithm": {"eps_low": 0.8, "eps_high": 3.0, "critic_steps": 2, "critic_warmup_steps": 10,
                             "policy_alpha": 1.5, "critic_lambda": 1.0, "gamma": 1.0},
               "actor": {"optim": {"lr": 1e-6}}, "critic": {"optim": {"lr": 5e-6}},
               "buffer": {"batch_size": 128},
               # timeout_s: a harness episode's wall limit (env.kwargs.wall_limit_s, 3000 s by default) and
               # its grading must end within the trainer's wait for trajectories.
               "rollout": {"max_total_tokens": 131072, "max_turns": 300, "timeout_s": 4200},
               "env": {"name": "swe"}},
}

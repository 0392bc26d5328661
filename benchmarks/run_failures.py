"""How a run's episodes ended, by phase: the environment's verdict (`env_info.reason`: correct,
broken_chain, incomplete, wrong, ...; `cut: <end_reason>` for an episode the rollout cut) of every
trajectory the trainer consumed, counted over the critic warm-up and over each block of `--block` actor
steps; then the held-out failures of each evaluation the run wrote, by episode length in turns; and on a
chain task (envs/chain_python.py) the episodes solved by chain length, per phase and per evaluation, where
a policy that drifts on the long chains shows (docs/results.md, section 9). Reads the run directory only
(`batches.jsonl`, the trajectory buffer `buffer/`, `config.yaml`, `eval/`) and regenerates the config's
tasks; no model runs. A checkpoint prunes the trajectory files it covers, so the training counts come
from batches.jsonl's episode records; a checkpointed run from before those were kept gives its held-out
counts only (`--held-out-only`).

    PYTHONPATH=. .venv/bin/python benchmarks/run_failures.py runs/critic35/chain_sao_s1 runs/critic35/chain_sao_s3

A shift in how the policy fails is what a critic pretrained on the SFT policy's rollouts cannot know
(docs/results.md, section 7: one seed learned to answer one step early, and its batch EV fell).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def phase_of(step: int, warmup: int, block: int) -> str:
    if step < warmup:
        return f"warm-up 0-{warmup - 1}"
    lo = (step - warmup) // block * block
    return f"actor {lo}-{lo + block - 1}"


class Episode(NamedTuple):
    """What the counts need of one trained trajectory."""

    prompt_id: str
    reward: float
    ending: str  # trainer/run_dir.py's episode_record


def trained(run_dir: Path, block: int = 5):
    """(phase, Episode) for every trajectory the run trained on, in step order: from `batches.jsonl`, which
    records each one's reward and ending; a run that predates those records is read from its trajectory files
    in `buffer/` (all there when the run kept no checkpoints, which prune the trajectories they cover)."""
    from megatron_sao.config import load_config
    from megatron_sao.trainer.run_dir import episode_record
    from megatron_sao.trajectory import load_trajectories

    warmup = load_config(run_dir / "config.yaml", []).algorithm.warmup_steps
    files = {f.stem.split("-", 1)[1]: f for f in (run_dir / "buffer").glob("*.safetensors")}
    for line in (run_dir / "batches.jsonl").read_text().splitlines():
        batch = json.loads(line)
        phase = phase_of(batch["step"], warmup, block)
        if "episodes" in batch:
            for prompt_id, e in zip(batch["prompt_ids"], batch["episodes"], strict=True):
                yield phase, Episode(prompt_id, e["reward"], e["ending"])
            continue
        for tid in batch["traj_ids"]:
            if tid not in files:
                raise SystemExit(f"{run_dir}: trajectory {tid} of step {batch['step']} is not in buffer/ (pruned at "
                                 "a checkpoint) and batches.jsonl predates the episode records it keeps now: "
                                 "this run's training episodes cannot be counted, its held-out ones can "
                                 "(--held-out-only)")
            for t in load_trajectories(files[tid]):
                yield phase, Episode(t.prompt_id, t.reward, episode_record(t)["ending"])


def endings(run_dir: Path, block: int = 5, episodes=None) -> dict[str, dict[str, int]]:
    """{phase: {reason: trajectories}} of the trajectories the run trained on (`episodes`: `trained()`'s
    pairs when the caller has read them already)."""
    out: dict[str, collections.Counter] = {}
    for phase, e in trained(run_dir, block) if episodes is None else episodes:
        out.setdefault(phase, collections.Counter())[e.ending] += 1
    return {phase: dict(c.most_common()) for phase, c in out.items()}


def eval_files(run_dir: Path) -> list[tuple[int, list[dict]]]:
    """(step, episode rows) of each held-out evaluation the run wrote (`eval/step_*.jsonl`), in step order."""
    return [(int(f.stem.split("_")[1]), [json.loads(line) for line in f.read_text().splitlines() if line.strip()])
            for f in sorted((run_dir / "eval").glob("step_*.jsonl"))]


def held_out_failures(run_dir: Path) -> dict[str, dict[str, int]]:
    """{"held-out at step N": {"T turns[, truncated]": failed episodes}} of each evaluation the run wrote
    (`eval/step_*.jsonl`): where in the episode length a policy's held-out failures lie."""
    out = {}
    for step, rows in eval_files(run_dir):
        c = collections.Counter(f"{r['turns']} turns" + (", truncated" if r["status"] == "truncated" else "")
                                for r in rows if not r["correct"])
        out[f"held-out at step {step}"] = {"episodes": len(rows), **dict(sorted(c.items()))}
    return out


def chain_lengths(run_dir: Path, block: int = 5, episodes=None) -> dict[str, dict[str, str]]:
    """{phase or "held-out at step N": {"K steps": "solved/episodes"}} on a task whose tasks list their
    steps (`meta["steps"]`: envs/chain_python.py); {} on any other task. The tasks come back from the
    run's config as training and evaluation drew them (trainer/components.py), matched by prompt id."""
    from megatron_sao.config import load_config
    from megatron_sao.trainer.components import eval_tasks, train_tasks

    cfg = load_config(run_dir / "config.yaml", [])
    train = train_tasks(cfg)
    tasks = {t.prompt_id: t for t in (*(train[i] for i in range(len(train))), *eval_tasks(cfg))}
    if not all("steps" in t.meta for t in tasks.values()):
        return {}

    def tally(out: dict, phase: str, prompt_id: str, solved: bool) -> None:
        prompt_id = prompt_id.rsplit("@", 1)[0]  # the rollout's "@<position in the prompt stream>"
        if prompt_id not in tasks:
            raise SystemExit(f"{run_dir}: episode of prompt {prompt_id!r} is not among the config's tasks")
        cell = out.setdefault(phase, {}).setdefault(len(tasks[prompt_id].meta["steps"]), [0, 0])
        cell[0] += solved
        cell[1] += 1

    out: dict[str, dict[int, list[int]]] = {}
    for phase, e in trained(run_dir, block) if episodes is None else episodes:
        tally(out, phase, e.prompt_id, e.reward == 1.0)
    for step, rows in eval_files(run_dir):
        for r in rows:
            tally(out, f"held-out at step {step}", r["prompt_id"], bool(r["correct"]))
    return {phase: {f"{k} steps": f"{s}/{n}" for k, (s, n) in sorted(c.items())} for phase, c in out.items()}


def report(run_dir: Path, block: int = 5, held_out_only: bool = False) -> dict[str, dict]:
    episodes = [] if held_out_only else list(trained(run_dir, block))  # read once for both tallies
    by_length = chain_lengths(run_dir, block, episodes)
    return {**endings(run_dir, block, episodes), **held_out_failures(run_dir),
            **({"by chain length": by_length} if by_length else {})}


def per_run_dir(report, description: str, block: int, argv=None) -> int:
    """The command line of a script that prints `report(run_dir, block)` as JSON for each run directory
    given, with rows of `--block` actor steps."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--block", type=int, default=block, help=f"actor steps per row (default {block})")
    args = ap.parse_args(argv)
    print(json.dumps({str(d): report(d, args.block) for d in args.run_dirs}, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--block", type=int, default=5, help="actor steps per row (default 5)")
    ap.add_argument("--held-out-only", action="store_true",
                    help="count the evaluations only (a checkpointed run from before batches.jsonl kept rewards)")
    args = ap.parse_args(argv)
    print(json.dumps({str(d): report(d, args.block, args.held_out_only) for d in args.run_dirs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

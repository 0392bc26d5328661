"""What the agent endpoint costs per turn, and harness episodes per second: ``python benchmarks/bench_agent_endpoint.py
[--json] [--rounds 5] [--episodes 4] [--turns 6] [--tokens 48] [--concurrent 16] [--clock wall|cpu] [--model DIR]``.

Per-turn overhead: a harness (the plain ``openai`` client, tool calls and tool results, as mini-swe-agent
sends them) plays ``--episodes`` episodes of ``--turns`` turns through the endpoint against an HF engine
(the tiny built-in model, or ``--model``); every generate call the endpoint makes is recorded (prompt ids
and sampling, its seed fixed per turn), and the same calls are then made on the engine directly. Both
paths run one episode at a time, so each generates exactly the same tokens unbatched; rounds alternate
endpoint / direct (``--rounds``), and the report gives each path's per-turn seconds (min / median / max
over rounds of the round's mean) and ``overhead_ratio`` = median endpoint / median direct (target <= 1.10).
``--clock cpu`` times with the process's CPU seconds (every thread: the engine's loop, the endpoint, the
client) instead of the wall clock, which on a loaded machine mostly counts the waits for a core that each
thread hop of the HTTP path adds.

Throughput: ``--concurrent`` harness episodes at once (one client thread each), every turn through the
endpoint to one engine: ``trajectories_per_s`` (the episodes' trajectories over the wall time) beside the
same turns as direct engine calls, ``--concurrent`` at once (``direct_trajectories_per_s``).

Timings on a shared machine are noisy: compare the ratio measured in one run, and note the load
(``uptime``) with any figure; the JSON carries the load average it was taken at.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

TOOL = {"type": "function", "function": {"name": "bash", "description": "Execute a bash command",
                                         "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                        "required": ["command"]}}}


class Recorder:
    """The engine behind the endpoint, recording every call (prompt, sampling) to replay it directly."""

    def __init__(self, engine) -> None:
        self.engine, self.calls, self.sampled = engine, [], []

    async def generate(self, prompt_ids, sampling):
        self.calls.append((list(prompt_ids), sampling))
        result = await self.engine.generate(prompt_ids, sampling)
        self.sampled.append(list(result.token_ids))
        return result


def play(client, episode: int, turns: int) -> int:
    """One harness episode over the openai client; returns the turns played."""
    msgs = [{"role": "system", "content": "You fix bugs with the bash tool."},
            {"role": "user", "content": f"Episode {episode}: the test test_add fails; fix calc.py."}]
    for t in range(turns):
        m = client.chat.completions.create(model="policy", messages=msgs, tools=[TOOL]).choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        if m.tool_calls:
            msgs += [{"role": "tool", "tool_call_id": c.id, "content": f"output {t}"} for c in m.tool_calls]
        else:
            msgs.append({"role": "user", "content": f"Observation {t}: run the tests again."})
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens per turn")
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--model", default=None, help="an HF model directory (default: the tiny built-in model)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import openai
    from transformers import AutoTokenizer

    from megatron_sao.models.builtin import materialize_builtin_model
    from megatron_sao.rollout.agent_endpoint.server import AgentEndpoint
    from megatron_sao.rollout.chat import ChatFormatter
    from megatron_sao.rollout.engines.factory import make_engine
    from megatron_sao.rollout.engines.protocol import EngineConfig, SamplingParams
    from megatron_sao.rollout.turns import AgentLoopConfig

    model = Path(args.model) if args.model else materialize_builtin_model(
        "tiny_qwen3_moe_ci", Path(tempfile.mkdtemp(prefix="bench-endpoint-")) / "tiny", seed=0)
    formatter = ChatFormatter(AutoTokenizer.from_pretrained(str(model)))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro, timeout=3600):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def build():
        engine = make_engine(EngineConfig(backend="hf", model_path=str(model), max_model_len=16384, seed=0,
                                          max_batch_size=args.concurrent))
        ep = AgentEndpoint(formatter)
        await ep.start()
        return engine, ep
    engine, ep = on_loop(build())
    cfg = AgentLoopConfig(max_turns=args.turns + 1, max_total_tokens=16384, max_new_tokens_per_turn=args.tokens,
                          sampling=SamplingParams(args.tokens, seed=1234))

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def endpoint_round(tag: str) -> tuple[float, list]:
        rec = Recorder(engine)
        t0 = clock()
        for e in range(args.episodes):
            s = ep.open_session(rec, cfg, prompt_id=f"{tag}-{e}", env="bench")
            me = ep.model_endpoint(s)
            play(openai.OpenAI(base_url=me.base_url, api_key=me.api_key, max_retries=0), e, args.turns)
            s.finish(0.0)
            ep.close_session(s)
        return (clock() - t0) / (args.episodes * args.turns), rec

    same_tokens = []

    def direct_round(rec: Recorder) -> float:
        t0 = clock()
        sampled = [on_loop(engine.generate(prompt, sampling)).token_ids for prompt, sampling in rec.calls]
        wall = clock() - t0
        same_tokens.append(sampled == rec.sampled)  # both paths generated exactly the same turns
        return wall / len(rec.calls)

    endpoint_round("warm-up")  # first calls pay allocations and imports
    via, direct = [], []
    for r in range(args.rounds):
        per_turn, rec = endpoint_round(f"r{r}")  # the same prompt ids for every round (fixed seeds)
        via.append(per_turn)
        direct.append(direct_round(rec))

    # Throughput: `concurrent` episodes at once through the endpoint, then their calls at once, directly.
    rec = Recorder(engine)
    sessions = [ep.open_session(rec, cfg, prompt_id=f"c-{e}", env="bench") for e in range(args.concurrent)]
    threads = [threading.Thread(target=play, args=(openai.OpenAI(base_url=ep.model_endpoint(s).base_url,
                                                                 api_key=s.key, max_retries=0), e, args.turns))
               for e, s in enumerate(sessions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trajs = sum(len(s.finish(0.0)) for s in sessions)
    wall = time.perf_counter() - t0
    chains: list[list] = []  # each episode's calls in order: a turn's prompt extends its previous one
    for prompt, sampling in rec.calls:
        chain = next((c for c in chains if prompt[:len(c[-1][0])] == c[-1][0]), None)
        if chain is None:
            chains.append([(prompt, sampling)])
        else:
            chain.append((prompt, sampling))

    async def direct_concurrent():
        async def one(calls):
            for prompt, sampling in calls:
                await engine.generate(prompt, sampling)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in chains))
        return time.perf_counter() - t0
    direct_wall = on_loop(direct_concurrent())

    def stats(xs):
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}
    out = {
        "endpoint_s_per_turn": stats(via), "direct_s_per_turn": stats(direct),
        "overhead_ratio": statistics.median(via) / statistics.median(direct),
        "overhead_ms_per_turn": (statistics.median(via) - statistics.median(direct)) * 1e3,
        "same_tokens": all(same_tokens),
        "concurrent_episodes": args.concurrent, "trajectories": trajs, "wall_s": wall,
        "trajectories_per_s": trajs / wall, "direct_trajectories_per_s": trajs / direct_wall,
        "episodes": args.episodes, "turns": args.turns, "max_new_tokens": args.tokens, "rounds": args.rounds,
        "model": str(model) if args.model else "tiny_qwen3_moe_ci", "clock": args.clock,
        "loadavg": os.getloadavg()[0],
    }
    on_loop(ep.stop())
    on_loop(engine.close())
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()

"""`sao`: the command-line entry point.

Each sub-command lives in its own module and is imported only when it runs, so `sao --help` is
instant and a machine without vLLM can still convert checkpoints or plan a cluster.

    sao demo                          the CPU demo: sft -> value-pretrain -> train -> eval
    sao sft CONFIG [k=v ...]          supervised warm start on demonstrations (actions only)
    sao value-pretrain CONFIG ...     fit the critic on rollouts of the fixed SFT policy
    sao train CONFIG [k=v ...]        the asynchronous SAO loop (torchrun for several ranks)
    sao eval CONFIG ...               Pass@1 at temperature 1.0, top-p 1.0, per-item results saved
    sao convert hf-to-megatron|megatron-to-hf ...
    sao plan CONFIG ...               per-GPU memory and layout checks for a cluster
    sao serve-rollout CONFIG ...      a rollout HTTP server (disaggregated runs on CPU)
    sao bench NAME                    run one of benchmarks/
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from typing import Callable, Sequence

# name -> (module, function, one-line help). The function takes the parsed argparse namespace,
# except for PASSTHROUGH commands, which own their argument parser and take the raw argv.
PASSTHROUGH = {"plan"}
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("megatron_sao.trainer.demo", "main", "CPU demo: sft -> value-pretrain -> async SAO train"),
    "sft": ("megatron_sao.trainer.sft", "main", "supervised warm start on demonstrations (actions only)"),
    "value-pretrain": ("megatron_sao.trainer.value_pretrain", "main",
                       "fit the critic on rollouts of a fixed policy before RL"),
    "train": ("megatron_sao.trainer.train", "main", "asynchronous single-rollout SAO training"),
    "eval": ("megatron_sao.trainer.evaluate", "main", "Pass@1 at temperature 1.0, top-p 1.0"),
    "convert": ("megatron_sao.checkpoint.convert_cli", "cli_main", "HF <-> Megatron checkpoint conversion"),
    "plan": ("megatron_sao.cluster.planner", "main", "per-GPU memory and parallel layout checks"),
    "serve-rollout": ("megatron_sao.trainer.serve_rollout", "main", "serve a rollout engine over HTTP"),
    "bench": ("megatron_sao.benchmarks_cli", "main", "run a benchmark from benchmarks/"),
}


def _add_config_args(p: argparse.ArgumentParser, config_required: bool = True) -> None:
    p.add_argument("config", nargs=None if config_required else "?", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.critic_steps=1")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sao", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_) in COMMANDS.items():
        # PASSTHROUGH commands print their own --help.
        p = sub.add_parser(name, help=help_, description=help_, add_help=name not in PASSTHROUGH)
        if name == "demo":
            p.add_argument("--config", default=None, help="demo config (default: examples/tiny_cpu.yaml)")
            p.add_argument("--run-dir", default=None, help="run directory (default: runs/demo)")
            p.add_argument("overrides", nargs="*", help="dotted overrides")
        elif name == "convert":
            p.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"])
            p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the converter (--help for them)")
        elif name in PASSTHROUGH:
            p.add_argument("args", nargs=argparse.REMAINDER)
        elif name == "bench":
            p.add_argument("name", help="benchmark name, e.g. gae, actor_step, rollout, async_vs_sync")
            p.add_argument("args", nargs=argparse.REMAINDER)
        elif name == "serve-rollout":
            _add_config_args(p)
            p.add_argument("--host", default="127.0.0.1")
            p.add_argument("--port", type=int, default=8000)
        elif name == "eval":
            _add_config_args(p)
            p.add_argument("--checkpoint", default=None, help="actor HF directory (default: <run.dir>/final_model)")
            p.add_argument("--out", default=None, help="per-item results (jsonl)")
        else:
            _add_config_args(p)
            if name == "train":
                p.add_argument("--overwrite", action="store_true",
                               help="start over in a run directory that already holds a training run")
    return parser


def _load(name: str) -> Callable:
    module, func, _ = COMMANDS[name]
    return getattr(importlib.import_module(module), func)


# Known-benign warnings that would otherwise bury the training log on every step.
_QUIET_WARNINGS = (
    r".*Transformer Engine and Apex are not installed.*",  # expected on CPU
    r"Apex is not installed.*",
    r".*is deprecated\. Please use `torch\.distributed\..*",  # Megatron's collectives, torch 2.13
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed.*",  # Megatron DDP hooks
)


def setup_logging() -> None:
    """INFO for megatron-sao, WARNING for Megatron-Core (it logs every parameter bucket at INFO)."""
    import logging
    import warnings

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def _user_errors() -> tuple[type[BaseException], ...]:
    from megatron_sao.config import ConfigError
    from megatron_sao.errors import UserError

    return ConfigError, UserError


def exit_on_sigterm() -> None:
    """SIGTERM (`kill`, `timeout`, a scheduler's cancel) ends a command as Ctrl-C does, through the
    `finally` blocks: an in-process vLLM engine then shuts its EngineCore process down. Python's default
    for SIGTERM is to die at once, which left that process running, orphaned, with the model and its KV
    cache in memory. `sao train` replaces this with its own handler once its models are built (finish
    the step, write a checkpoint); `sao serve-rollout`'s HTTP server with its own shutdown."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)
    if threading.current_thread() is threading.main_thread():  # signal.signal's rule (main() run in a thread)
        signal.signal(signal.SIGTERM, stop)


def _run(command: str, fn: Callable, arg) -> int:
    """Run a command; a user error (bad config, missing or damaged input file, run directory clash)
    is printed as one line and exits 2. Anything else is a bug and keeps its traceback."""
    try:
        return int(fn(arg) or 0)
    except _user_errors() as e:
        message = " ".join(str(e).split())  # one line, whatever the message held
        print(f"sao {command}: error: {message}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    exit_on_sigterm()
    if argv and argv[0] in PASSTHROUGH:  # the command parses its own arguments, --help included
        return _run(argv[0], _load(argv[0]), argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come after flags (`sao train C --resume a.b=1`): argparse leaves those as extras.
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    if args.command is None:
        parser.print_help()
        return 0
    return _run(args.command, _load(args.command), args)


if __name__ == "__main__":
    sys.exit(main())

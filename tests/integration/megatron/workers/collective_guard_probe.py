"""The collective guard's verdicts, one process (world size 1, gloo, SAO_COLLECTIVE_GUARD=1).

Usage: python -m tests.integration.megatron.workers.collective_guard_probe
  -> prints RESULT guard {case: "ok" | error text}

The probe functions are compiled into a module named megatron_sao._guard_probe, because the guard
judges megatron_sao's own frames only; the project's real call sites (freeze, the trainer's stop
agreement and broadcast) are called as they are.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types

import torch
import torch.distributed as dist

os.environ["SAO_COLLECTIVE_GUARD"] = "1"

from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

torch.set_num_threads(1)
ensure_cpu_compat()

from megatron_sao.distributed import collective_guard  # noqa: E402
from megatron_sao.distributed.devices import collective_device  # noqa: E402
from megatron_sao.distributed.gated import GatedCollectives  # noqa: E402
from megatron_sao.megatron.parallel import init_parallel  # noqa: E402
from megatron_sao.models.freeze import FreezeReport, check_patterns_matched_globally  # noqa: E402
from megatron_sao.models.parallel_sizes import ParallelSizes  # noqa: E402

PROBE = '''
import torch
import torch.distributed as dist

def host_factory(ctx):
    dist.all_reduce(torch.tensor([1.0]))

def explicit_cpu(ctx):
    dist.all_reduce(torch.zeros(1, device="cpu"))

def named_device(ctx):
    dist.all_reduce(torch.tensor([1.0], device=ctx.device))

def moved(ctx):
    dist.all_reduce(torch.zeros(2).to(ctx.device))

def source_stays_on_host(ctx):
    x = torch.zeros(2)
    dist.all_reduce(x.to(ctx.device))
    dist.all_reduce(x)

def derived_from_host(ctx):
    dist.all_reduce(torch.tensor([1.0, 2.0]).double().sum().reshape(1))

def stacked_host(ctx):
    dist.all_reduce(torch.stack([torch.tensor(1.0), torch.tensor(2.0)]))

def follows_device_of(ctx):
    a = torch.ones(3, device=ctx.device) * 2
    dist.all_reduce(torch.zeros(1, device=a.device))
    dist.all_reduce(torch.zeros_like(a))

def moved_back_to_host(ctx):
    dist.all_reduce(torch.ones(1, device=ctx.device).cpu())

def to_cpu_string(ctx):
    dist.all_reduce(torch.ones(1, device=ctx.device).to("cpu"))

def all_gather_list(ctx):
    out = [torch.empty(1, device=ctx.device)]
    dist.all_gather(out, torch.zeros(1))

def object_without_device(ctx):
    dist.broadcast_object_list([1], src=0)

def object_with_device(ctx):
    dist.broadcast_object_list([1], src=0, device=ctx.device)

def gloo_group_takes_host(ctx):
    g = dist.new_group([0], backend="gloo")
    dist.all_reduce(torch.tensor([1.0]), group=g)

def default_group_object(ctx):
    g = dist.new_group([0])
    dist.all_reduce(torch.tensor([1.0]), group=g)

def monitored_barrier_on_nccl_group(ctx):
    dist.monitored_barrier()
'''


def verdict(fn) -> str:
    try:
        fn()
        return "ok"
    except collective_guard.CollectiveDeviceError as e:
        return f"CollectiveDeviceError: {e}"


ctx = init_parallel(ParallelSizes())
probe = types.ModuleType("megatron_sao._guard_probe")
exec(compile(PROBE, "megatron_sao/_guard_probe.py", "exec"), probe.__dict__)
out = {name: verdict(lambda f=f: f(ctx)) for name, f in vars(probe).items() if callable(f) and name.islower()
       and getattr(f, "__module__", None) == "megatron_sao._guard_probe"}

# The project's own call sites.
out["freeze_check"] = verdict(lambda: check_patterns_matched_globally(FreezeReport(matches_per_pattern={"a*": 1})))
collectives = GatedCollectives(dataclasses.replace(ctx, world_size=2))  # a 2-rank trainer's code path
out["loop_stop_agreed"] = verdict(lambda: collectives.any_rank(False, "the stop agreement"))
out["loop_broadcast"] = verdict(lambda: collectives.broadcast({"x": 1}))
# Outside megatron_sao (this script, megatron-core): not judged.
out["caller_outside_the_package"] = verdict(lambda: dist.all_reduce(torch.tensor([1.0])))
out["_facts"] = {"ctx_device": str(ctx.device), "collective_device": str(collective_device()),
                 "installed": collective_guard.installed()}
print("RESULT guard " + json.dumps(out), flush=True)

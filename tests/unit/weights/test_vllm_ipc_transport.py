"""The in-process vLLM engine's CUDA IPC weight transport, at its CPU boundary.

No GPU here: the CUDA calls (``reduce_tensor``'s handle export, the device's UUID, ``ipc_collect``, and
on the worker side ``rebuild_cuda_tensor``) are faked; everything else is the real code: the selection
rule, the update-info the trainer sends through vLLM's msgpack encoder, the worker extension's decode
into vLLM's own ``IPCWeightTransferEngine.receive_weights``, the bucket lifetime rule, the abort path,
and ``VLLMEngine`` driving the transport over a stand-in AsyncLLM.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing import reductions

pytest.importorskip("vllm")

from megatron_sao.config import ConfigError, load_config
from megatron_sao.rollout.engines.protocol import EngineConfig
from megatron_sao.weights.inprocess_transports import (
    GroupTransport,
    IPCTransport,
    ReloadTransport,
    make_transport,
)
from megatron_sao.weights.vllm_worker.extension import SAOWorkerExtension
from megatron_sao.weights.vllm_worker.ipc_handles import decode_ipc_args, decode_update_info
from tests.paths import REPO

UUID = "GPU-4f1c-trainer"


class FakeCuda:
    """The CUDA calls of the IPC path. ``reduce_tensor`` returns the argument tuple torch builds for a
    CUDA tensor (``torch/multiprocessing/reductions.py``), with a handle naming the shared tensor."""

    def __init__(self, monkeypatch) -> None:
        self.shared: dict[bytes, weakref.ref] = {}  # handle -> the shared tensor: the memory a worker maps
        self.args: list[tuple] = []  # what each reduce_tensor call returned
        self.ptrs: dict[bytes, int] = {}  # handle -> the address it maps
        self.collects = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=UUID))
        monkeypatch.setattr(torch.cuda, "ipc_collect", self._collect)
        monkeypatch.setattr(reductions, "reduce_tensor", self._reduce)

    def _collect(self) -> None:
        self.collects += 1

    def _reduce(self, t: torch.Tensor):
        handle = f"cudaIpcMemHandle-{len(self.shared)}".encode()
        self.shared[handle] = weakref.ref(t)
        self.ptrs[handle] = t.data_ptr()
        self.args.append((type(t), t.size(), t.stride(), t.storage_offset(), torch.storage.TypedStorage, t.dtype, 0,
                          handle, t.untyped_storage().nbytes(), 0, t.requires_grad, b"/torch_ipc_refcounter_7",
                          len(self.shared) - 1, None, False))
        return reductions.rebuild_cuda_tensor, self.args[-1]


class FakeLLM:
    """The AsyncLLM calls the transports and ``VLLMEngine`` make, recorded in order."""

    def __init__(self, worker_uuids=(UUID,)) -> None:
        self.calls: list[tuple] = []
        self.worker_uuids = list(worker_uuids)
        self.gate: asyncio.Event | None = None  # set: sao_ipc_update_weights waits for it
        self.fail_update: str | None = None
        self.during_abort = None  # called while sao_abort_weight_update runs
        self.errored = False

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, kwargs))
        if method == "sao_gpu_uuid":
            return self.worker_uuids
        if method == "sao_ipc_update_weights":
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_update:
                raise RuntimeError(self.fail_update)
        if method == "sao_abort_weight_update" and self.during_abort:
            self.during_abort()
        return [None] * len(self.worker_uuids)

    async def init_weight_transfer_engine(self, request):
        self.calls.append(("init_weight_transfer_engine", request.init_info))

    async def start_weight_update(self):
        self.calls.append(("start_weight_update",))

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish_weight_update", weight_version))

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.calls.append(("pause_generation", mode))

    async def resume_generation(self):
        self.calls.append(("resume_generation",))

    async def update_weight_version(self, version):
        self.calls.append(("update_weight_version", version))

    def methods(self) -> list[str]:
        return [c[0] if c[0] != "collective_rpc" else c[1] for c in self.calls]


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(backend="vllm", model_path="/models/tiny", **kw)


def _bucket() -> list[tuple[str, torch.Tensor]]:
    return [("model.layers.0.mlp.down_proj.weight", torch.randn(4, 6, dtype=torch.bfloat16)),
            ("model.norm.weight", torch.ones(6))]


async def _ready(transport: IPCTransport, llm: FakeLLM) -> None:
    await transport.setup(llm)
    await transport.begin(llm, 1)


# --- selection -------------------------------------------------------------------------------------


def test_cpu_selection_is_unchanged():
    assert not torch.cuda.is_available()
    t = make_transport(_cfg())
    assert isinstance(t, GroupTransport) and t.backend == "gloo" and t.engine_backend == "sao_gloo"
    assert isinstance(make_transport(_cfg(weight_transport="reload")), ReloadTransport)
    assert make_transport(_cfg(weight_transport="reload")).engine_backend is None


def test_cuda_selects_ipc_and_refuses_what_cannot_work(monkeypatch):
    FakeCuda(monkeypatch)
    t = make_transport(_cfg())
    assert isinstance(t, IPCTransport) and t.engine_backend == "ipc" and t.pauses_during_transfer
    assert isinstance(make_transport(_cfg(weight_transport="reload")), ReloadTransport)  # asked for: kept
    assert make_transport(_cfg(weight_transport="gloo")).backend == "gloo"
    with pytest.raises(ValueError, match=r"weight_transport='nccl'.*two ranks on one device"):
        make_transport(_cfg(weight_transport="nccl"))
    with pytest.raises(ValueError, match=r"EngineConfig.tensor_parallel_size=2.*trainer's own GPU"):
        make_transport(_cfg(tensor_parallel_size=2))


def test_config_refuses_nccl_for_the_embedded_vllm_backend():
    with pytest.raises(ConfigError, match=r"rollout.weight_transport: nccl cannot reach the embedded rollout.backend"):
        load_config(None, ["rollout.backend=vllm", "rollout.weight_transport=nccl"])
    load_config(None, ["rollout.backend=vllm"])  # auto stays valid
    # disaggregated: the launch plan turns backend vllm into vllm serve on other GPUs, one NCCL group for all
    load_config(REPO / "examples" / "qwen3_30b_a3b" / "aime_disaggregated.yaml")
    load_config(None, ["rollout.backend=vllm_server", "rollout.server_urls=[http://a:1]",
                       "rollout.weight_transport=nccl"])  # servers keep their NCCL group


# --- the update-info the trainer sends, and what vLLM's ipc engine makes of it -------------------


def test_setup_checks_the_worker_gpu_and_inits_packed(monkeypatch):
    FakeCuda(monkeypatch)
    llm = FakeLLM()
    t = IPCTransport(_cfg(), device=torch.device("cpu"))
    asyncio.run(t.setup(llm))
    assert llm.calls == [("sao_gpu_uuid", None), ("init_weight_transfer_engine", {"packed": True})]
    other = IPCTransport(_cfg(), device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"on the trainer's GPU .*GPU-4f1c-trainer.*\['GPU-other'\]"):
        asyncio.run(other.setup(FakeLLM(worker_uuids=["GPU-other"])))
    with pytest.raises(RuntimeError, match="before setup"):
        asyncio.run(IPCTransport(_cfg()).begin(llm, 1))


def test_one_handle_per_bucket_crosses_msgpack_and_vllm_packed_receive_loads_the_tensors(monkeypatch):
    """Issue 39: a handle per bucket, not per tensor (18,867 of them for Qwen3-30B-A3B:
    benchmarks/bench_ipc_handles.py). Two buckets of one update go through one staging buffer, exported
    once; vLLM's real packed receive opens it once on the worker's device and loads every tensor."""
    from vllm.distributed.weight_transfer import ipc_engine, packed_tensor
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    cuda = FakeCuda(monkeypatch)
    llm = FakeLLM()
    t = IPCTransport(_cfg(), device=torch.device("cpu"))
    first, second = _bucket(), [("model.embed_tokens.weight", torch.randn(3, 6, dtype=torch.bfloat16))]

    async def run():
        await _ready(t, llm)
        return [await t.push_bucket(llm, first), await t.push_bucket(llm, second)]

    assert asyncio.run(run()) == [4 * 6 * 2 + 6 * 4, 3 * 6 * 2]
    rpcs = [c[1] for c in llm.calls if c[0] == "sao_ipc_update_weights"]
    sent = [kw["update_info"] for kw in rpcs]
    assert len(sent) == 2 and ("start_weight_update",) in llm.calls
    info = sent[0]
    assert info["names"] == [n for n, _ in first] and info["tensor_sizes"] == [4 * 6 * 2, 6 * 4]
    assert info["dtype_names"] == ["bfloat16", "float32"] and info["shapes"] == [[4, 6], [6]]
    # One reduce_tensor export for the update: the staging buffer, in plain data the worker turns back exactly.
    assert len(cuda.args) == 1 and list(info["ipc_handles"]) == [UUID]
    assert decode_ipc_args(info["ipc_handles"][UUID]) == cuda.args[0] and sent[1]["ipc_handles"] == info["ipc_handles"]
    # AsyncLLM's process boundary: vLLM's msgpack encoder refuses the raw tuple (classes, dtypes) but
    # takes the plain form unchanged.
    raw = reductions.reduce_tensor(torch.zeros(2))[1]
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        MsgpackEncoder().encode({"update_info": {"ipc_handles": {UUID: raw}}})

    # The worker extension hands vLLM's Worker.update_weights the fields vLLM's ipc engine takes; its
    # receive_weights (the real one, packed) opens the buffer on the worker's device and unpacks it.
    engine = object.__new__(ipc_engine.IPCWeightTransferEngine)
    loaded = []
    engine.packed, engine.device = True, torch.device("cuda", 3)
    engine._packed_importer = packed_tensor.PackedBufferImporter()
    engine.model = SimpleNamespace(load_weights=lambda weights: loaded.extend(weights))
    opened = []
    staging = t.staging

    def rebuild(*args):  # the CUDA call: map the producer's memory
        opened.append(args[6])
        assert cuda.ptrs[args[7]] == staging.data_ptr()
        return staging

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)  # what vLLM's PackedBufferImporter calls
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=UUID))
    for kwargs, bucket in zip(rpcs, (first, second)):
        received = MsgpackDecoder().decode(MsgpackEncoder().encode(kwargs))["update_info"]
        assert received == kwargs["update_info"]
        seen = {}
        worker = SimpleNamespace(update_weights=lambda d: seen.setdefault("info", d))
        SAOWorkerExtension.sao_ipc_update_weights(worker, received)
        # (the buffer holds this bucket when the worker reads it: the trainer writes the next one after)
        staging[:sum(received["tensor_sizes"])].copy_(torch.cat([x.reshape(-1).view(torch.uint8)
                                                                 for _, x in bucket]))
        engine.receive_weights(engine.parse_update_info(seen["info"]))
    assert [n for n, _ in loaded] == [n for n, _ in first + second]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(loaded, first + second))
    assert opened == [3]  # once for the update, on the worker's own device index


def test_decode_refuses_anything_but_the_handle_types():
    with pytest.raises(ValueError, match="class 'os.system'"):
        decode_ipc_args([["class", "os.system"]])
    with pytest.raises(ValueError, match="dtype 'Tensor'"):
        decode_ipc_args([["dtype", "Tensor"]])
    with pytest.raises(ValueError, match="ipc_handles"):
        decode_update_info({"names": ["a"]})
    assert decode_update_info({"ipc_handles": {UUID: [["value", 1]]}})["ipc_handles"] == {UUID: (1,)}


# --- the bucket lifetime rule and the abort path ---------------------------------------------------


def test_the_staging_buffer_is_held_until_the_workers_left_the_update(monkeypatch):
    """The buffer the worker maps stays with the transport through the update's buckets (each written
    only after the worker acknowledged the previous one) and is dropped once the workers have left the
    update (vLLM's engine releases its mapping in finish_weight_update), then ipc_collect."""
    cuda = FakeCuda(monkeypatch)
    llm = FakeLLM()
    t = IPCTransport(_cfg(), device=torch.device("cpu"))

    async def run():
        await _ready(t, llm)
        llm.gate = asyncio.Event()
        push = asyncio.ensure_future(t.push_bucket(llm, _bucket()))
        while "sao_ipc_update_weights" not in llm.methods():
            await asyncio.sleep(0)
        [shared] = [r() for r in cuda.shared.values()]
        assert t.staging is shared  # held by the transport while the worker reads it
        del shared
        llm.gate.set()  # the worker acknowledges
        await push
        assert t.staging is not None and cuda.collects == 0  # the next bucket of the update reuses it
        await t.push_bucket(llm, _bucket())
        await t.finish(llm, 1)

    asyncio.run(run())
    assert t.staging is None and cuda.collects == 1 and len(cuda.shared) == 1
    gc.collect()
    assert all(r() is None for r in cuda.shared.values())  # the transport keeps nothing after the update


def test_abort_after_a_failed_bucket_closes_the_reload_then_releases(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    llm = FakeLLM()
    t = IPCTransport(_cfg(), device=torch.device("cpu"))
    async def push_failing():
        await _ready(t, llm)
        llm.fail_update = "IPC handle not found for GPU UUID"
        await t.push_bucket(llm, _bucket())

    with pytest.raises(RuntimeError, match="IPC handle not found"):
        asyncio.run(push_failing())
    gc.collect()
    refs = list(cuda.shared.values())  # the shared buffer, weakly
    assert len(refs) == 1 and refs[0]() is not None  # the worker has not left the update: still held
    alive_during_abort = []
    llm.during_abort = lambda: alive_during_abort.append(refs[0]() is not None)
    asyncio.run(t.abort(llm))
    assert llm.methods()[-1] == "sao_abort_weight_update" and alive_during_abort == [True]
    gc.collect()
    assert refs[0]() is None and t.staging is None and cuda.collects == 1
    asyncio.run(t.abort(llm))  # nothing open: no second abort call
    assert llm.methods().count("sao_abort_weight_update") == 1

    async def next_update():  # the engine takes the next update
        llm.fail_update = None
        await t.begin(llm, 2)
        await t.push_bucket(llm, _bucket())
        await t.finish(llm, 2)

    asyncio.run(next_update())
    assert llm.methods()[-3:] == ["start_weight_update", "sao_ipc_update_weights", "finish_weight_update"]
    assert llm.calls[-1] == ("finish_weight_update", "2") and len(cuda.args) == 2  # a new export per update


def test_worker_abort_finishes_the_reload_after_vllm_ended_the_session():
    """vLLM's Worker.update_weights ends the session on a receive error; its finish_weight_update then
    refuses, leaving the layerwise reload open. The extension's abort still reaches the engine's finish."""
    from vllm.v1.worker.gpu_worker import Worker

    finished = []

    class Engine:
        def update_weights(self, info):
            raise ValueError("IPC handle not found for GPU UUID GPU-x")

        def finish_weight_update(self):
            finished.append(True)

        def reset_weight_update_target(self):
            pass

    worker = SimpleNamespace(weight_transfer_engine=Engine(), _weight_update_active=True,
                             _weight_update_is_draft=False, vllm_config=None,
                             model_runner=SimpleNamespace(reset_lora_state=lambda: None),
                             _check_weight_transfer_engine=lambda: None)
    worker.finish_weight_update = lambda: Worker.finish_weight_update(worker)
    worker.update_weights = lambda info: Worker.update_weights(worker, info)
    with pytest.raises(ValueError, match="IPC handle not found"):
        SAOWorkerExtension.sao_ipc_update_weights(worker, {"names": [], "ipc_handles": []})
    assert worker._weight_update_active is False
    with pytest.raises(RuntimeError, match="without a matching start_weight_update"):
        worker.finish_weight_update()
    SAOWorkerExtension.sao_abort_weight_update(worker)
    assert finished == [True] and worker._weight_update_active is False


# --- VLLMEngine over the transport ----------------------------------------------------------------


def _engine(monkeypatch, tmp_path, llm: FakeLLM):
    from safetensors.torch import save_file
    from vllm.v1.engine.async_llm import AsyncLLM

    from megatron_sao.rollout.engines.vllm_engine import VLLMEngine

    save_file({n: t.contiguous() for n, t in _bucket()}, str(tmp_path / "model.safetensors"))
    started = {}

    def from_engine_args(args, **kw):
        started["args"] = args
        return llm

    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(from_engine_args))
    engine = VLLMEngine(EngineConfig(backend="vllm", model_path=str(tmp_path)))
    engine.transport.device = torch.device("cpu")  # the host stands in for the trainer's GPU
    return engine, started["args"]


def test_vllm_engine_starts_vllm_with_the_ipc_backend_and_streams_through_it(monkeypatch, tmp_path):
    cuda = FakeCuda(monkeypatch)
    llm = FakeLLM()
    engine, args = _engine(monkeypatch, tmp_path, llm)
    assert isinstance(engine.transport, IPCTransport)
    assert args.weight_transfer_config.backend == "ipc"
    assert args.distributed_executor_backend is None  # vLLM's own choice (uni at TP 1)
    asyncio.run(engine.update_weights([_bucket()[:1], _bucket()[1:]], version=1))
    assert engine.version == 1 and cuda.collects == 1 and len(cuda.args) == 1  # one export, released at the finish
    assert llm.methods() == ["update_weight_version", "sao_gpu_uuid", "init_weight_transfer_engine",
                             "pause_generation", "start_weight_update", "sao_ipc_update_weights",
                             "sao_ipc_update_weights", "finish_weight_update", "update_weight_version",
                             "resume_generation"]


def test_vllm_engine_aborts_an_incomplete_update_and_stays_usable(monkeypatch, tmp_path):
    FakeCuda(monkeypatch)
    llm = FakeLLM()
    engine, _ = _engine(monkeypatch, tmp_path, llm)
    with pytest.raises(ValueError, match="missing 1 of 2"):
        asyncio.run(engine.update_weights([_bucket()[:1]], version=1))
    assert engine.version == 0 and "sao_abort_weight_update" in llm.methods()
    assert engine.transport.staging is None and llm.methods()[-1] == "resume_generation"
    asyncio.run(engine.update_weights([_bucket()], version=1))
    assert engine.version == 1 and llm.calls[-2] == ("update_weight_version", "1")

"""Loading straight to the device: meta-device construction, no float32 host copy, the fit check before any
allocation, and the load report; results identical to building the model on the host first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_factory import make_hf_model, write_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

import runners.engine.loader as loader
from runners.engine import Engine
from runners.engine.loader import FP32_SUFFIXES, load_model, plan_load
from runners.engine.memory import InsufficientMemoryError, check_memory_fits
from runners.engine.models.config import HybridConfig, family_module
from runners.engine.models.hybrid import HybridLM
from runners.engine.options import EngineOptions

CHECKPOINTS = Path(__file__).resolve().parents[1] / "registry" / "checkpoints"
TINY = ["tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp"]


def _host_first_load(path: Path, dtype: torch.dtype) -> HybridLM:
    """The loader before direct loading: build the model in float32 on the host, copy every checkpoint tensor
    in, then cast (the router kept in float32)."""
    config = HybridConfig.from_pretrained(path)
    model = HybridLM(config, with_mtp=True)
    targets = family_module(config.family).checkpoint_targets(model)
    with torch.no_grad(), safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            targets[name].copy_(f.get_tensor(name))
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not name.endswith(FP32_SUFFIXES):
            t.data = t.data.to(dtype)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", TINY)
def test_direct_load_equals_host_first_load(name, dtype):
    path = CHECKPOINTS / name
    direct, host = load_model(path, dtype=dtype), _host_first_load(path, dtype)
    a, b = direct.state_dict(), host.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].device.type == "cpu", k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", TINY)
def test_generated_tokens_identical_to_host_first_load(name):
    path = CHECKPOINTS / name
    prompts = [[1, 17, 300, 42, 9], [1, 5, 6, 7]]
    kw = dict(draft_len=3, ssm_replay=True, max_batch_size=2, max_seq_len=128)
    direct = Engine.from_pretrained(path, EngineOptions(**kw)).generate(prompts, 20, stop_token_ids=[])
    host = Engine(_host_first_load(path, torch.float32), EngineOptions(**kw)).generate(prompts, 20,
                                                                                       stop_token_ids=[])
    assert direct.tokens == host.tokens and all(len(t) == 20 for t in direct.tokens)


class _Allocations(TorchDispatchMode):
    """Records (op, dtype, numel) of every tensor with memory an aten op returns (meta tensors have none)."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.outputs.append((str(func.overloadpacket.__name__), t.dtype, t.numel()))
        return out


@pytest.mark.parametrize("name", TINY)
def test_bf16_load_creates_no_float32_tensor_but_the_routers(name):
    path = CHECKPOINTS / name
    config = HybridConfig.from_pretrained(path)
    # kept in float32 (FP32_SUFFIXES): router [E, D], correction bias [E], Qwen's shared_expert_gate [1, D]
    router_sizes = {config.n_routed_experts * config.hidden_size, config.n_routed_experts, config.hidden_size}
    with _Allocations() as direct:
        model = load_model(path, dtype=torch.bfloat16)
    fp32 = [(op, n) for op, dt, n in direct.outputs if dt == torch.float32 and n > 0]
    assert fp32 and all(n in router_sizes for _op, n in fp32), sorted(set(fp32))[:10]
    for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
        want = torch.float32 if pname.endswith(FP32_SUFFIXES) else torch.bfloat16
        assert p.dtype == want, pname
    # the check can fail: the host-first loader builds every tensor in float32 first
    with _Allocations() as host:
        _host_first_load(path, torch.bfloat16)
    assert any(dt == torch.float32 and n not in router_sizes for _op, dt, n in host.outputs)


def test_plan_allocates_nothing_and_counts_the_weights():
    path = CHECKPOINTS / "tiny_nemotron_h_mtp"
    plan = plan_load(path, dtype=torch.bfloat16, load_mtp=True)
    assert all(p.device.type == "meta" for p in plan.model.parameters())
    model = loader.materialize(plan, "cpu")
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    assert plan.weight_bytes == sum(t.numel() * t.element_size() for t in tensors)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:  # bf16 on disk, fp32 router
        on_disk = sum(_numel(f, k) * _size(f, k) for k in f.keys())
    assert plan.weight_bytes == on_disk


def _numel(f, k):
    n = 1
    for d in f.get_slice(k).get_shape():
        n *= d
    return n


def _size(f, k):
    return {"BF16": 2, "F32": 4, "F16": 2}[f.get_slice(k).get_dtype()]


def test_fit_check_fires_before_any_allocation(monkeypatch):
    path = CHECKPOINTS / "tiny_qwen3_next_mtp"

    def no_alloc(*a, **k):
        raise AssertionError("weights were allocated before the fit check")

    monkeypatch.setattr("runners.engine.engine.materialize", no_alloc)
    with pytest.raises(InsufficientMemoryError) as e:
        Engine.from_pretrained(path, EngineOptions(draft_len=3, max_batch_size=64, max_seq_len=4096,
                                                   memory_budget_bytes=10 * 2**20))
    msg = e.value.problem
    assert "of weights +" in msg and "of caches (max_batch_size=64, max_seq_len=4096)" in msg
    assert "more than the 0.01 GiB of the given memory budget on cpu" in msg
    # on the CPU more GPUs cannot help; a bf16 model can shrink to FP8 / NVFP4
    assert "max_batch_size" in e.value.fix and "FP8 or NVFP4" in e.value.fix
    assert "world_size" not in e.value.fix


def test_fit_check_numbers_and_skip():
    want = r"3\.00 GiB of weights \+ 2\.00 GiB of caches = 5\.00 GiB"
    with pytest.raises(InsufficientMemoryError, match=want):
        check_memory_fits(3 * 2**30, 2 * 2**30, "cpu", budget_bytes=4 * 2**30)
    assert check_memory_fits(1, 1, "cpu", budget_bytes=2) == 2
    free = check_memory_fits(1, 1, "cpu")  # MemAvailable of this Linux machine
    assert free is None or free > 2**20
    assert check_memory_fits(1, 1, "mps") is None  # no free-memory query: skipped


def test_load_report_matches_the_engine():
    path = CHECKPOINTS / "tiny_nemotron_h_mtp"
    engine = Engine.from_pretrained(path, EngineOptions(dtype="bfloat16", draft_len=3, max_batch_size=4,
                                                        max_seq_len=256))
    r = engine.load_report
    params = {id(t): t for t in list(engine.model.parameters()) + list(engine.model.buffers())}.values()
    assert r.weight_bytes == sum(t.numel() * t.element_size() for t in params)
    assert r.cache_bytes == sum(engine.cache_memory().values()) > 0
    assert 0 < r.weights_seconds <= r.seconds and r.dtype == "bfloat16" and r.device == "cpu"
    assert r.device_peak_bytes is None and r.budget_bytes is None or r.budget_bytes > r.weight_bytes
    assert r.host_peak_rss_bytes is None or r.host_peak_rss_bytes > r.weight_bytes
    assert set(r.to_dict()) >= {"seconds", "weight_bytes", "cache_bytes", "host_peak_rss_bytes"}


def test_non_persistent_buffers_are_computed_after_meta_construction(tmp_path, monkeypatch):
    """A module with a computed buffer (e.g. a RoPE cache) gets it from init_buffers(), not the checkpoint."""
    from runners.engine.models import layers

    orig_init = layers.RMSNorm.__init__

    def init(self, dim, eps, offset=0.0):
        orig_init(self, dim, eps, offset)
        self.register_buffer("inv_dim", torch.empty(1), persistent=False)

    def init_buffers(self):
        self.inv_dim.fill_(1.0 / self.weight.shape[0])

    monkeypatch.setattr(layers.RMSNorm, "__init__", init)
    monkeypatch.setattr(layers.RMSNorm, "init_buffers", init_buffers, raising=False)
    model = load_model(CHECKPOINTS / "tiny_nemotron_h_mtp")
    assert model.norm_f.inv_dim.item() == pytest.approx(1 / model.config.hidden_size)
    monkeypatch.delattr(layers.RMSNorm, "init_buffers")
    with pytest.raises(TypeError, match="non-persistent buffers .* no init_buffers"):
        load_model(CHECKPOINTS / "tiny_nemotron_h_mtp")


def test_tied_embeddings_stay_tied(tmp_path):
    """tie_word_embeddings: lm_head shares the embedding after to_empty (one allocation, loaded once)."""
    hf = make_hf_model(seed=2, tie_word_embeddings=True)
    path = write_checkpoint(tmp_path / "tied", hf, with_mtp=False)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]  # a tied checkpoint stores the matrix once
    save_file(tensors, str(path / "model.safetensors"))
    plan = plan_load(path, dtype=torch.bfloat16)
    model = loader.materialize(plan, "cpu")
    assert model.lm_head.weight is model.embeddings.weight
    assert torch.equal(model.lm_head.weight, tensors["backbone.embeddings.weight"].bfloat16())
    untied = sum(p.numel() * 2 for n, p in model.named_parameters(remove_duplicate=False))
    assert plan.weight_bytes < untied  # the shared matrix is counted once


@pytest.mark.gpu
def test_gpu_free_memory_counts_blocks_the_allocator_holds():
    """A model freed earlier in the process leaves its blocks reserved by the caching allocator: the driver
    does not count them free, but the next load can use them (compare=replay's second arm at real
    dimensions failed the fit check without this)."""
    from runners.engine.memory import free_device_memory

    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    x = torch.empty(2**30, dtype=torch.uint8, device=dev)
    del x  # 1 GiB now reserved, unallocated
    driver_free, _ = torch.cuda.mem_get_info(dev)
    free, source = free_device_memory(dev)
    assert free - driver_free >= 2**30 and "reserved" in source
    torch.cuda.empty_cache()


def test_prefill_chunk_lowered_to_what_memory_leaves_or_refused(caplog):
    """After weights and caches, the prefill's temporaries (runners.engine.memory.prefill_bytes_per_token)
    must fit what is left: prefill_chunk_tokens is lowered with a warning, or the load refused when fewer
    than MIN_PREFILL_CHUNK_TOKENS fit (Super V3 FP8 at full depth ran out of memory in its first prefill)."""
    import logging

    from runners.engine.memory import MIN_PREFILL_CHUNK_TOKENS, PREFILL_MARGIN_BYTES, prefill_bytes_per_token

    path = CHECKPOINTS / "tiny_qwen3_next_mtp"
    options = EngineOptions(draft_len=3, max_batch_size=4, max_seq_len=2048, prefix_cache=False)
    engine = Engine.from_pretrained(path, options)
    weights, caches = engine.load_report.weight_bytes, engine.load_report.cache_bytes
    per_token = prefill_bytes_per_token(engine.config)
    assert per_token > engine.config.hidden_size  # every token needs more than its residual
    assert engine.options.prefill_chunk_tokens == options.prefill_chunk_tokens  # memory: untouched
    room = weights + caches + PREFILL_MARGIN_BYTES
    with caplog.at_level(logging.WARNING, logger="runners.engine.build"):
        small = Engine.from_pretrained(path, options.replace(memory_budget_bytes=room + 1000 * per_token))
    assert small.options.prefill_chunk_tokens == 1000
    assert "prefill_chunk_tokens lowered from 8192 to 1000 to fit the device" in caplog.text
    out = small.generate([[1, 2, 3, 4] * 300], 2, stop_token_ids=[])  # a 1200-token prompt: two forwards
    assert len(out.tokens[0]) == 2
    with pytest.raises(InsufficientMemoryError, match=f"no room for a prefill of {MIN_PREFILL_CHUNK_TOKENS}"):
        Engine.from_pretrained(path, options.replace(memory_budget_bytes=room + 10 * per_token))

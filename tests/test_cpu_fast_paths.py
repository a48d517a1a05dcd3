"""The CPU fast paths of the default job compute the same bits as the code they replace.

- oneDNN linear layers (runners/engine/onednn.py) equal ``F.linear`` bit for bit, take ``F.linear`` where
  they cannot, see in-place weight changes, and an engine with them generates the same tokens, acceptance
  and logits as one without;
- the chunked SSD scan (``kernels.mamba2.ssd_chunked_scan``, laid out head-major without gathers) equals its
  gathered formulation bit for bit;
- the health flags' peak reduction is no ``linalg_vector_norm`` (20x slower on the CPU) and still flags;
- plain int token lists are checked at once, not id by id.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import runners.engine.onednn as onednn
from kernels.mamba2 import ssd_chunked_scan
from runners.engine.engine import Engine
from runners.engine.onednn import MIN_OUTPUTS, MIN_ROWS, OneDNNLinear, linear_plan, use_onednn_linears
from runners.engine.options import EngineOptions
from runners.engine.scheduler import token_rows

TINY = Path(__file__).resolve().parents[1] / "registry/checkpoints/tiny_nemotron_h_mtp"
# (out, in) of the tiny NemotronH's linear layers (in_proj, out_proj / eh_proj, q / o, k / v, MLP up, down,
# shared expert up, down, latent projections, LM head) and two shapes of no plan here
SHAPES = [(844, 192), (192, 384), (192, 192), (64, 192), (512, 192), (192, 512), (256, 192), (192, 256),
          (96, 192), (192, 96), (2048, 192), (8, 192), (100, 300)]

needs_onednn = pytest.mark.skipif(not onednn.onednn_available(), reason="torch without oneDNN's linear op")


def _linear(N: int, K: int, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * K ** -0.5)
    return lin


@needs_onednn
@pytest.mark.parametrize("N,K", SHAPES)
def test_onednn_linear_is_f_linear_bit_for_bit(N, K):
    """Every row count, 2-D and 3-D inputs, a strided input: the swapped layer's output is F.linear's."""
    lin = _linear(N, K, seed=N + K)
    blocks = linear_plan(N, K)
    if blocks is None:
        return  # F.linear itself (covered below)
    fast = OneDNNLinear.from_linear(lin, blocks)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 8, 31, 64, 100, 257, 1100):
            x = torch.randn(rows, K, generator=g)
            assert torch.equal(fast(x), F.linear(x, lin.weight)), (N, K, rows)
        x3 = torch.randn(6, 9, K, generator=g)
        assert torch.equal(fast(x3), F.linear(x3, lin.weight))
        wide = torch.randn(300, K + 7, generator=g)[:, 3:K + 3]  # rows with a stride
        assert torch.equal(fast(wide), F.linear(wide, lin.weight))


@needs_onednn
def test_plans_on_this_machine_cover_the_tiny_models_big_shapes():
    """What the speed-up rests on: the probe finds a bit-exact blocking for the largest layers (a build or
    CPU where it does not would keep F.linear; this test says so instead of slowing down unnoticed)."""
    for N, K in [(844, 192), (2048, 192), (192, 384), (192, 512)]:
        assert linear_plan(N, K) is not None, (N, K)
    assert linear_plan(8, 192) is None  # MKL computes so few output features another way


def test_small_products_autograd_and_other_dtypes_take_f_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(onednn, "_onednn", lambda x, w: calls.append(x.shape) or F.linear(x, w))
    lin = _linear(256, 192, seed=0)
    fast = OneDNNLinear.from_linear(lin, (192,))
    with torch.inference_mode():
        fast(torch.randn(MIN_ROWS - 1, 192))
        fast(torch.randn(MIN_OUTPUTS // 256 - 1, 192))  # too few outputs
        fast(torch.empty(0, 192))
    assert calls == []
    y = fast(torch.randn(300, 192, requires_grad=True))  # autograd: F.linear, with a gradient
    y.sum().backward()
    assert calls == [] and lin.weight.grad is not None
    with torch.inference_mode():
        fast(torch.randn(300, 192))
        fast(torch.randn(4, 70, 192))
    assert calls == [(320, 192), (320, 192)]  # rows padded to a multiple of ROW_BUCKET (64): few shapes


@needs_onednn
def test_swap_keeps_parameters_and_sees_in_place_weight_changes():
    model = nn.Sequential(_linear(192, 384, 1), nn.Linear(192, 192, bias=True), _linear(8, 192, 2),
                          _linear(192, 192, 3).to(torch.bfloat16))
    weights = [m.weight for m in model]
    keys = list(model.state_dict())
    assert use_onednn_linears(model) == 1  # the bias, the 8-feature gate and the bf16 layer stay
    assert [type(m) for m in model] == [OneDNNLinear, nn.Linear, nn.Linear, nn.Linear]
    assert [m.weight for m in model] == weights and list(model.state_dict()) == keys
    x = torch.randn(300, 384)
    with torch.inference_mode():
        assert torch.equal(model[0](x), F.linear(x, weights[0]))
    with torch.no_grad():
        model[0].weight[:, 200] = 5.0  # in the second K block, which the layer keeps as a copy
    with torch.inference_mode():
        assert torch.equal(model[0](x), F.linear(x, model[0].weight))


def test_engine_with_onednn_generates_the_same_tokens_and_logits():
    """The shipped tiny NemotronH with MTP (K = 3): tokens, accepted drafts and a full forward's logits are
    the same bits with and without oneDNN linears."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (300, 41, 170, 5, 96)]
    out = {}
    for on in (False, True):
        eng = Engine.from_pretrained(TINY, EngineOptions(draft_len=3, max_batch_size=4, max_seq_len=512,
                                                         onednn_linear=on))
        swapped = sum(isinstance(m, OneDNNLinear) for m in eng.model.modules())
        assert (swapped > 0) == (on and onednn.onednn_available())
        gen = eng.generate(prompts, 24, stop_token_ids=[])
        with torch.inference_mode():
            logits = eng.logits(torch.tensor([prompts[0][:64], prompts[2][:64]]))
        out[on] = (gen.tokens, gen.stats.accepted_drafts, gen.stats.accepted_per_position, logits)
    assert out[True][:3] == out[False][:3]
    assert torch.equal(out[True][3], out[False][3])


def _gathered_ssd_scan(x, dt, A, B, C, chunk_size, initial_state=None):
    """The chunked SSD scan as first written (heads read their group by gathering): the bits
    ssd_chunked_scan must keep."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    L = chunk_size
    pad = (-T) % L
    nc = (T + pad) // L
    head_group = torch.arange(H) // (H // G)
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    x, dt = x.view(b, nc, L, H, P), dt.view(b, nc, L, H)
    B, C = B.view(b, nc, L, G, N), C.view(b, nc, L, G, N)
    cum = torch.cumsum(dt * A.float(), dim=2)
    xdt = x * dt[..., None]
    seg = cum[:, :, :, None, :] - cum[:, :, None, :, :]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    decay = torch.exp(seg.masked_fill(~causal[None, None, :, :, None], float("-inf")))
    CB = torch.einsum("bclgn,bcsgn->bclsg", C, B)[..., head_group]
    y = torch.einsum("bclsh,bcshp->bclhp", CB * decay, xdt)
    B_h = B[:, :, :, head_group]
    decay_to_end = torch.exp(cum[:, :, -1:, :] - cum)
    chunk_states = torch.einsum("bclh,bclhp,bclhn->bchpn", decay_to_end, xdt, B_h)
    state = x.new_zeros(b, H, P, N) if initial_state is None else initial_state.float()
    chunk_decay = torch.exp(cum[:, :, -1, :])
    entering = []
    for c in range(nc):
        entering.append(state)
        state = state * chunk_decay[:, c, :, None, None] + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)
    C_h = C[:, :, :, head_group]
    y = y + torch.einsum("bclhn,bchpn->bclhp", C_h, entering) * torch.exp(cum)[..., None]
    return y.reshape(b, nc * L, H, P)[:, :T], state


@pytest.mark.parametrize("b,T,H,P,G,N,L", [(1, 1100, 12, 32, 2, 16, 32), (3, 77, 12, 32, 2, 16, 32),
                                           (2, 5, 4, 8, 1, 4, 4), (1, 1, 12, 32, 2, 16, 32),
                                           (2, 64, 6, 16, 3, 8, 16), (1, 513, 12, 32, 2, 16, 128)])
def test_chunked_scan_is_its_gathered_formulation_bit_for_bit(b, T, H, P, G, N, L):
    g = torch.Generator().manual_seed(T * 7 + H)
    x, dt = torch.randn(b, T, H, P, generator=g), torch.rand(b, T, H, generator=g) * 0.2
    A = -torch.rand(H, generator=g) * 3
    B, C = torch.randn(b, T, G, N, generator=g), torch.randn(b, T, G, N, generator=g)
    for h0 in (None, torch.randn(b, H, P, N, generator=g)):
        y, h = ssd_chunked_scan(x, dt, A, B, C, L, h0)
        y_ref, h_ref = _gathered_ssd_scan(x, dt, A, B, C, L, h0)
        assert torch.equal(y, y_ref) and torch.equal(h, h_ref)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_health_flags_use_no_vector_norm_and_still_flag():
    from runners.engine.loader import load_model

    model = load_model(TINY)
    model.track_nonfinite("cpu")
    ids = torch.randint(3, 2048, (2, 40))
    with torch.inference_mode(), _Ops() as ops:
        model.lm_logits(model(ids))
    assert "linalg_vector_norm" not in ops.names and "amax" in ops.names
    assert model.take_nonfinite() == []
    with torch.no_grad():
        model.layers[3].mixer.out_proj.weight[0, 0] = float("nan")
    with torch.inference_mode():
        model.lm_logits(model(ids))
    assert model.take_nonfinite()[0] == "layers.3.mamba2"


def test_plain_int_token_lists_are_checked_at_once(monkeypatch):
    import runners.engine.scheduler as scheduler_mod

    def per_id(value, where):
        raise AssertionError("checked id by id")

    rows = [[1, 2, 3], list(range(2000))]
    monkeypatch.setattr(scheduler_mod, "token_id", per_id)
    got = token_rows(rows, "prompts")
    assert got == rows and got[0] is not rows[0]  # copies: the caller's lists are not kept
    with pytest.raises(AssertionError):  # anything else still goes id by id (and is refused there)
        token_rows([[1, True]], "prompts")


def test_mtp_kept_positions_are_the_full_forwards_rows_bit_for_bit():
    """MTPModule.forward(keep=...) runs the blocks after the MTP attention on the kept positions alone:
    on the CPU in float32 their outputs are the full forward's rows, bit for bit (and the KV it writes the
    same), for one position, several of one row, positions of several rows, and none."""
    from runners.engine.cache import HybridCache
    from runners.engine.loader import load_model
    from runners.engine.state import BatchMeta

    model = load_model(TINY, load_mtp=True)
    use_onednn_linears(model)
    g = torch.Generator().manual_seed(3)
    B, T, D = 3, 300, model.config.hidden_size
    ids, h = torch.randint(3, 2048, (B, T), generator=g), torch.randn(B, T, D, generator=g)
    kinds = model.cache_kinds()
    meta = BatchMeta(torch.arange(B), torch.zeros(B, dtype=torch.long), torch.full((B,), T), all_valid=True,
                     max_kv_len=T, fresh=True)
    with torch.inference_mode():
        full_cache = HybridCache(model.config, kinds, max_batch_size=B, max_seq_len=T, dtype=torch.float32)
        full = model.mtp(model.embeddings(ids), h, full_cache, meta)
        for keep in ([T - 1], [5, 6, T - 1], [T - 1, T + 40, 2 * T + 299], []):
            cache = HybridCache(model.config, kinds, max_batch_size=B, max_seq_len=T, dtype=torch.float32)
            got = model.mtp(model.embeddings(ids), h, cache, meta, keep=torch.tensor(keep, dtype=torch.long))
            assert got.shape == (len(keep), D)
            assert torch.equal(got, full.reshape(-1, D)[keep]), keep
            mtp_kv = [i for i, layer in cache.layers.items() if hasattr(layer, "k")]  # the MTP attention's
            assert mtp_kv and all(torch.equal(cache.layers[i].k, full_cache.layers[i].k)
                                  and torch.equal(cache.layers[i].v, full_cache.layers[i].v) for i in mtp_kv)


@pytest.mark.parametrize("chunk", [8192, 300])
def test_prefill_with_drafts_rows_only_gives_the_same_drafts_and_tokens(monkeypatch, chunk):
    """The engine's prefill with and without the kept-rows MTP path: the same tokens, accepted drafts and
    slot states (first drafts, their MTP hidden), with prompts that share prefixes (prefix-cache hits: a
    restored hidden starts the MTP one position earlier) and prefills cut into chunks."""
    import runners.engine.prefill as prefill

    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 2048, (400,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 2048, (n,), generator=g).tolist() for n in (3, 90, 250)]
    prompts += [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (700, 7)] + [shared]
    out = {}
    for rows_only in (False, True):
        monkeypatch.setattr(prefill, "drafts_rows_only", lambda device, dtype, on=rows_only: on)
        eng = Engine.from_pretrained(TINY, EngineOptions(draft_len=3, max_batch_size=2, max_seq_len=1024,
                                                         prefill_chunk_tokens=chunk))
        gen = eng.generate(prompts, 20, stop_token_ids=[])
        assert gen.stats.prefix_cache_hit_tokens > 0
        out[rows_only] = (gen.tokens, gen.stats.accepted_per_position, gen.stats.num_accepted_hist,
                          eng.step.slots.mtp_hidden.clone(), eng.step.slots.draft1.clone())
    assert out[True][:3] == out[False][:3]
    assert torch.equal(out[True][3], out[False][3]) and torch.equal(out[True][4], out[False][4])


@pytest.mark.parametrize("T", [4, 5, 31, 32, 36, 100, 191, 192, 300, 513, 767, 768, 800, 1025, 1086, 1300,
                               2000])
def test_attention_forward_last_is_forwards_last_rows_bit_for_bit(T):
    """Attention.forward_last over a fresh full-width prefill: the last 4 columns' output equals forward's
    bit for bit and the KV entries written are the same, at widths on every side of the CPU flash kernel's
    query-block sizes (32, 64, 256 rows); a width whose last 32-row block would hold fewer than 4 rows is
    declined (None, nothing written)."""
    from runners.engine.cache import HybridCache
    from runners.engine.loader import load_model
    from runners.engine.state import BatchMeta

    model = load_model(TINY, load_mtp=True)
    block = model.mtp.blocks[0]
    assert block.kind == "attention"
    kinds = model.cache_kinds()
    B, rows = 2, 4
    g = torch.Generator().manual_seed(T)
    hidden = torch.randn(B, T, model.config.hidden_size, generator=g)
    meta = BatchMeta(torch.tensor([1, 0]), torch.zeros(B, dtype=torch.long), torch.full((B,), T),
                     all_valid=True, max_kv_len=T, fresh=True)
    caches = [HybridCache(model.config, kinds, max_batch_size=2, max_seq_len=T + 8, dtype=torch.float32)
              for _ in range(2)]
    with torch.inference_mode():
        full = block.mixer(hidden, caches[0][block.cache_index], meta)
        last = block.mixer.forward_last(hidden, caches[1][block.cache_index], meta, rows)
    kv = [c[block.cache_index] for c in caches]
    if 0 < T % 32 < rows:
        assert last is None and not kv[1].k.any()
        return
    assert torch.equal(last, full[:, T - rows:])
    assert torch.equal(kv[0].k, kv[1].k) and torch.equal(kv[0].v, kv[1].v)


def test_cpu_prefills_one_prompt_per_forward_with_the_tokens_of_grouped_rows(monkeypatch):
    """On the CPU each admitted prompt is prefilled in forwards of its own (no padding); prompts prefilled
    together as padded rows (prefill_max_rows, a GPU's way) give the same tokens and accepted drafts."""
    from runners.engine.prefill import Prefill

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (300, 41, 170, 96, 250, 12)]
    out, widths = {}, {}
    group = Prefill._group
    for rows in (None, 4):
        seen = []
        monkeypatch.setattr(Prefill, "_group",
                            lambda self, rows_, seen=seen: seen.append(len(rows_)) or group(self, rows_))
        eng = Engine.from_pretrained(TINY, EngineOptions(draft_len=3, max_batch_size=4, max_seq_len=512,
                                                         prefill_max_rows=rows, prefix_cache=False))
        gen = eng.generate(prompts, 16, stop_token_ids=[])
        out[rows], widths[rows] = (gen.tokens, gen.stats.accepted_per_position), seen
    assert set(widths[None]) == {1} and len(widths[None]) == len(prompts)
    assert max(widths[4]) == 4  # the first admission's four prompts together
    assert out[None] == out[4]


def test_ssd_chunked_scan_is_differentiable():
    """Training (runners/tools/train.py) backpropagates through the chunked scan into dt, A, B, C and x: every
    input that requires grad gets a finite gradient (an ``out=`` in the scan once made autograd refuse)."""
    gen = torch.Generator().manual_seed(0)
    b, T, H, P, G, N = 2, 11, 4, 3, 2, 5
    x = torch.randn(b, T, H, P, generator=gen, requires_grad=True)
    dt = torch.rand(b, T, H, generator=gen).requires_grad_()
    A = (-torch.rand(H, generator=gen)).requires_grad_()
    B = torch.randn(b, T, G, N, generator=gen, requires_grad=True)
    C = torch.randn(b, T, G, N, generator=gen, requires_grad=True)
    y, state = ssd_chunked_scan(x, dt, A, B, C, 4)
    (y.sum() + state.sum()).backward()
    for t in (x, dt, A, B, C):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


@needs_onednn
def test_plan_is_checked_per_thread_count_and_a_layer_keeps_to_its_own(monkeypatch):
    """A library may split a product by threads: the plan is checked with the thread count of the moment,
    and a swapped layer runs oneDNN only under the count it was checked with (F.linear otherwise)."""
    calls = []
    lin = _linear(844, 192, seed=4)
    threads = torch.get_num_threads()
    fast = OneDNNLinear.from_linear(lin, linear_plan(844, 192))
    monkeypatch.setattr(onednn, "_onednn", lambda x, w: calls.append(x.shape) or F.linear(x, w))
    x = torch.randn(256, 192)
    with torch.inference_mode():
        fast(x)
        torch.set_num_threads(threads + 1)
        try:
            assert torch.equal(fast(x), F.linear(x, lin.weight))
            assert calls == [(256, 192)]  # the second call, under another thread count, took F.linear
            linear_plan(844, 192)  # checked anew under this count
            assert (844, 192, threads + 1) in onednn._PLANS
        finally:
            torch.set_num_threads(threads)

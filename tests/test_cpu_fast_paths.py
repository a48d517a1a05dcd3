"""The CPU fast paths of the default job compute the same bits as the code they replace.

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
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.mamba2 import ssd_chunked_scan
from runners.engine.engine import _token_rows

TINY = Path(__file__).resolve().parents[1] / "registry/checkpoints/tiny_nemotron_h_mtp"


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
    import runners.engine.engine as engine_mod

    def per_id(value, where):
        raise AssertionError("checked id by id")

    rows = [[1, 2, 3], list(range(2000))]
    monkeypatch.setattr(engine_mod, "_token_id", per_id)
    got = _token_rows(rows, "prompts")
    assert got == rows and got[0] is not rows[0]  # copies: the caller's lists are not kept
    with pytest.raises(AssertionError):  # anything else still goes id by id (and is refused there)
        _token_rows([[1, True]], "prompts")

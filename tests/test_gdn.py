"""Gated DeltaNet mixer (runners/engine/models/gdn.py) and its rules (kernels/gdn/chunk.py, recurrent.py)
against
transformers' Qwen3NextGatedDeltaNet and themselves.

Sizes are deliberately awkward: HV = 2H, K = 32 != V = 48 (a transposed [K, V] state fails), T = 37 with chunk
sizes that do not divide it.
"""

from __future__ import annotations

import pytest
import torch

from kernels.gdn import chunk_gated_delta_rule_ref, l2norm, recurrent_gated_delta_rule
from runners.engine.models.gdn import GatedDeltaNet

D, H, HV, K, V, W, T = 64, 2, 4, 32, 48, 4, 37


def layer_from_config(config, **kwargs) -> GatedDeltaNet:
    """Our layer with the sizes of any object with Qwen3NextConfig's attribute names."""
    return GatedDeltaNet(
        hidden_size=config.hidden_size, num_k_heads=config.linear_num_key_heads,
        num_v_heads=config.linear_num_value_heads, head_k_dim=config.linear_key_head_dim,
        head_v_dim=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim,
        rms_norm_eps=config.rms_norm_eps, **kwargs,
    )


@pytest.fixture(scope="module")
def layers():
    """(transformers' layer, ours) with identical random weights loaded through the HF state_dict names."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(
        hidden_size=D, linear_num_key_heads=H, linear_num_value_heads=HV, linear_key_head_dim=K,
        linear_value_head_dim=V, linear_conv_kernel_dim=W, num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    hf = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name == "A_log":  # moderate decay so the state carries across all 37 tokens
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
            elif name in ("dt_bias", "norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    ours = layer_from_config(config).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def _rule_inputs(B=2, T=T, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=g))
    k = l2norm(torch.randn(B, T, H, K, generator=g))
    v = torch.randn(B, T, HV, V, generator=g)
    gate = -torch.rand(B, T, HV, generator=g) * 0.3
    beta = torch.rand(B, T, HV, generator=g)
    s0 = torch.randn(B, HV, V, K, generator=g)
    return q, k, v, gate, beta, s0


def _close(a, b, tol=1e-4):
    # in_proj over different batch shapes rounds differently (~1e-6), so even conv windows are not bit-equal
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@torch.no_grad()
def test_prefill_matches_transformers(layers):
    hf, ours = layers
    torch.manual_seed(2)
    x = torch.randn(3, T, D)
    ref = hf(x)
    _close(ours(x), ref)
    ours.chunk_size = 16  # does not divide T
    try:
        _close(ours(x), ref)
    finally:
        ours.chunk_size = 64


@torch.no_grad()
def test_recurrent_rule_matches_transformers_reference_with_state_layout():
    """Our (B, HV, V, K) state is transformers' (B, HV, K, V) transposed; a transposed state cannot pass."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, s0 = _rule_inputs()
    # transformers < 5.24 (the GPU image has 5.17) expects q, k already repeated to the value heads; newer
    # versions accept both. Value head j reads key head j // (HV / H), i.e. repeat_interleave.
    r = v.shape[2] // q.shape[2]
    q_hv, k_hv = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    o_ref, s_ref = torch_recurrent_gated_delta_rule(
        q_hv, k_hv, v, g, beta, initial_state=s0.transpose(-1, -2), output_final_state=True
    )
    o, s, _ = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    _close(o, o_ref)
    _close(s, s_ref.transpose(-1, -2))
    with pytest.raises(ValueError, match="transposed"):
        recurrent_gated_delta_rule(q, k, v, g, beta, s0.transpose(-1, -2))


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@torch.no_grad()
def test_chunked_equals_recurrent(chunk_size):
    q, k, v, g, beta, s0 = _rule_inputs()
    o_ref, s_ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, s0, chunk_size=chunk_size)
    _close(o, o_ref, 1e-5)
    _close(s, s_ref, 1e-5)
    # lengths mask: final state after each row's last valid token, zeros out there
    lengths = torch.tensor([37, 11])
    o_l, s_l = chunk_gated_delta_rule_ref(q, k, v, g, beta, s0, chunk_size=chunk_size, lengths=lengths)
    o_r, s_r, _ = recurrent_gated_delta_rule(q[1:, :11], k[1:, :11], v[1:, :11], g[1:, :11], beta[1:, :11],
                                             s0[1:])
    _close(s_l[0], s_ref[0], 1e-5)
    _close(s_l[1:], s_r, 1e-5)
    _close(o_l[1:, :11], o_r, 1e-5)
    assert torch.count_nonzero(o_l[1, 11:]) == 0


@torch.no_grad()
def test_rule_does_not_write_initial_state():
    q, k, v, g, beta, s0 = _rule_inputs()
    keep = s0.clone()
    chunk_gated_delta_rule_ref(q, k, v, g, beta, s0, chunk_size=8)
    recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert torch.equal(s0, keep)


@pytest.mark.parametrize("block", [1, 3])
@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(layers, block):
    _, ours = layers
    torch.manual_seed(3)
    x = torch.randn(2, T, D)
    full = ours.prefill(x)
    t0 = 10  # 27 decode tokens: 27 steps of 1 or 9 blocks of 3
    out = ours.prefill(x[:, :t0])
    ys, state, conv = [out.y], out.recurrent_state, out.conv_state
    for t in range(t0, T, block):
        step = ours.decode(x[:, t:t + block], state, conv)
        ys.append(step.y)
        state, conv = step.recurrent_state, step.conv_state
    _close(torch.cat(ys, dim=1), full.y)
    _close(state, full.recurrent_state)
    _close(conv, full.conv_state, 1e-5)


@torch.no_grad()
def test_chunked_prefill_in_pieces_equals_one_prefill(layers):
    _, ours = layers
    torch.manual_seed(4)
    x = torch.randn(2, T, D)
    full = ours.prefill(x)
    a = ours.prefill(x[:, :2])  # shorter than the conv window
    b = ours.prefill(x[:, 2:21], recurrent_state=a.recurrent_state, conv_state=a.conv_state)
    c = ours.prefill(x[:, 21:], recurrent_state=b.recurrent_state, conv_state=b.conv_state)
    _close(torch.cat([a.y, b.y, c.y], dim=1), full.y)
    _close(c.recurrent_state, full.recurrent_state)


@torch.no_grad()
def test_right_padded_batch_equals_rows_alone(layers):
    _, ours = layers
    torch.manual_seed(5)
    lengths = torch.tensor([T, 20, 2, 0])
    B = len(lengths)
    x = torch.randn(B, T, D)
    for i, n in enumerate(lengths.tolist()):
        x[i, n:] = float("nan")  # padding must never be read
    s0 = torch.randn(ours.recurrent_state_shape(B))
    c0 = torch.randn(ours.conv_state_shape(B))
    out = ours.prefill(x, lengths, recurrent_state=s0, conv_state=c0)
    for i, n in enumerate(lengths.tolist()):
        alone = ours.prefill(x[i:i + 1, :n], recurrent_state=s0[i:i + 1], conv_state=c0[i:i + 1])
        _close(out.y[i:i + 1, :n], alone.y)
        _close(out.recurrent_state[i:i + 1], alone.recurrent_state)
        _close(out.conv_state[i:i + 1], alone.conv_state, 1e-5)
        assert torch.count_nonzero(out.y[i, n:]) == 0
    # a row of length 0 keeps its state exactly
    assert torch.equal(out.recurrent_state[3], s0[3]) and torch.equal(out.conv_state[3], c0[3])


@torch.no_grad()
def test_intermediate_states_equal_token_by_token_decode(layers):
    _, ours = layers
    torch.manual_seed(6)
    x = torch.randn(2, 12 + 4, D)
    pre = ours.prefill(x[:, :12])
    s0, c0 = pre.recurrent_state.clone(), pre.conv_state.clone()
    verify = ours.decode(x[:, 12:], pre.recurrent_state, pre.conv_state, output_intermediate_states=True)
    assert verify.intermediate_states.shape == (2, 4, HV, V, K)
    assert verify.intermediate_conv_states.shape == (2, 4, ours.conv_dim, W - 1)
    assert torch.equal(pre.recurrent_state, s0) and torch.equal(pre.conv_state, c0)  # inputs untouched
    state, conv, ys = s0, c0, []
    for t in range(4):
        step = ours.decode(x[:, 12 + t:13 + t], state, conv)
        state, conv = step.recurrent_state, step.conv_state
        ys.append(step.y)
        _close(verify.intermediate_states[:, t], state, 1e-5)
        _close(verify.intermediate_conv_states[:, t], conv, 1e-5)
    _close(verify.y, torch.cat(ys, dim=1), 1e-5)
    _close(verify.recurrent_state, verify.intermediate_states[:, -1], 0)


@torch.no_grad()
def test_bf16_state_round_trips_dtype(layers):
    _, ours = layers
    x = torch.randn(1, 3, D)
    s = torch.zeros(ours.recurrent_state_shape(1), dtype=torch.bfloat16)
    out = ours.decode(x, s, torch.zeros(ours.conv_state_shape(1)), output_intermediate_states=True)
    assert out.recurrent_state.dtype == torch.bfloat16 and out.intermediate_states.dtype == torch.bfloat16


def test_bad_inputs_raise_clear_errors(layers):
    _, ours = layers
    x = torch.randn(2, 5, D)
    with pytest.raises(ValueError, match="lengths must lie in"):
        ours.prefill(x, torch.tensor([5, 6]))
    with pytest.raises(ValueError, match=r"\(B, HV, V, K\)"):
        ours.decode(x, torch.zeros(2, HV, K, V), torch.zeros(ours.conv_state_shape(2)))
    with pytest.raises(ValueError, match="conv state layout"):
        ours.decode(x, torch.zeros(ours.recurrent_state_shape(2)), torch.zeros(2, ours.conv_dim, W))
    with pytest.raises(ValueError, match="x must be"):
        ours.prefill(torch.randn(2, 5, D + 1))


@torch.no_grad()
def test_chunked_is_finite_under_extreme_decay():
    """g as low as -60 per token (exp(G) underflows inside a chunk): no inf / NaN, still equal to the spec."""
    q, k, v, g, beta, s0 = _rule_inputs()
    g = g * 200.0
    o_ref, s_ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o, s = chunk_gated_delta_rule_ref(q, k, v, g, beta, s0, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    _close(o, o_ref, 1e-5)
    _close(s, s_ref, 1e-5)


@torch.no_grad()
def test_bf16_module_no_worse_than_transformers_bf16(layers):
    """bf16 weights and activations: our error vs the float32 result is no larger than transformers' own."""
    import copy

    hf, ours = layers
    torch.manual_seed(7)
    x = torch.randn(2, T, D)
    ref = ours(x)
    low = layer_from_config(ours_config(ours), dtype=torch.bfloat16)
    low.load_state_dict(ours.state_dict())
    y = low(x.bfloat16())
    assert y.dtype == torch.bfloat16
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    rel_hf = ((copy.deepcopy(hf).bfloat16()(x.bfloat16()).float() - ref).norm() / ref.norm()).item()
    assert rel < 1.25 * rel_hf + 1e-3, f"bf16 relative error {rel:.3g} vs transformers' {rel_hf:.3g}"


def ours_config(m: GatedDeltaNet):
    from types import SimpleNamespace

    return SimpleNamespace(hidden_size=m.hidden_size, linear_num_key_heads=m.num_k_heads,
                           linear_num_value_heads=m.num_v_heads, linear_key_head_dim=m.head_k_dim,
                           linear_value_head_dim=m.head_v_dim, linear_conv_kernel_dim=m.conv_kernel,
                           rms_norm_eps=m.norm.eps)


@torch.no_grad()
def test_rewind_commit_equals_decoding_only_accepted_tokens(layers):
    """Verify T = 4 tokens, keep the state after num_accepted_tokens (different per row), decode on: the same
    as never having seen the rejected tokens. The conv window comes from `conv_state_after`."""
    _, ours = layers
    torch.manual_seed(8)
    B, Tv = 3, 4
    x = torch.randn(B, 9 + Tv + 1, D)
    pre = ours.prefill(x[:, :9])
    num_accepted = torch.tensor([1, 4, 2])
    verify = ours.decode(x[:, 9:9 + Tv], pre.recurrent_state, pre.conv_state, output_intermediate_states=True)
    rows = torch.arange(B)
    state = verify.intermediate_states[rows, num_accepted - 1]
    conv_in = ours.rule_inputs(x[:, 9:9 + Tv], pre.conv_state).conv_in
    conv = ours.conv_state_after(conv_in, num_accepted)
    _close(conv, verify.intermediate_conv_states[rows, num_accepted - 1], 0)
    for i, n in enumerate(num_accepted.tolist()):
        alone = ours.decode(x[i:i + 1, 9:9 + n], pre.recurrent_state[i:i + 1], pre.conv_state[i:i + 1])
        _close(state[i:i + 1], alone.recurrent_state, 1e-5)
        _close(conv[i:i + 1], alone.conv_state, 1e-5)
        nxt = torch.randn(1, 1, D)
        _close(ours.decode(nxt, state[i:i + 1], conv[i:i + 1]).y,
               ours.decode(nxt, alone.recurrent_state, alone.conv_state).y, 1e-5)
    with pytest.raises(ValueError, match="num_tokens"):
        ours.conv_state_after(conv_in, torch.tensor([0, 5, 1]))


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_matches_cpu(layers):
    """Same algorithm on the GPU: prefill (chunked) and a T = 3 verify (recurrent) agree with the CPU run."""
    _, ours = layers
    torch.manual_seed(9)
    x = torch.randn(2, T, D)
    lengths = torch.tensor([T, 17])
    cpu = ours.prefill(x, lengths)
    cpu_v = ours.decode(x[:, :3], cpu.recurrent_state, cpu.conv_state, output_intermediate_states=True)
    gpu_layer = layer_from_config(ours_config(ours), device="cuda")
    gpu_layer.load_state_dict(ours.state_dict())
    gpu = gpu_layer.prefill(x.cuda(), lengths.cuda())
    gpu_v = gpu_layer.decode(x[:, :3].cuda(), gpu.recurrent_state, gpu.conv_state,
                             output_intermediate_states=True)
    for a, b in ((gpu.y, cpu.y), (gpu.recurrent_state, cpu.recurrent_state), (gpu.conv_state, cpu.conv_state),
                 (gpu_v.y, cpu_v.y), (gpu_v.intermediate_states, cpu_v.intermediate_states)):
        # TF32 matmuls are off by default for fp32 in torch; 1e-3 still leaves room for reduction order
        _close(a.cpu(), b, 1e-3)

"""Gated DeltaNet's per-token inputs from its projections in one Triton launch (decode / verify sizes), and the
PyTorch reference: what Qwen3-Next's linear-attention layer computes between its two input projections and the
gated delta rule.

From ``qkvz`` (B, T, H, 2K + 2rV) = in_proj_qkvz(x) (per key head h: q_h (K), k_h (K), v_h (rV), z_h (rV)),
``ba`` (B, T, H, 2r) = in_proj_ba(x) (per key head: b (r), a (r)), the conv window ``conv_state`` (B, C, W - 1)
(C = 2HK + HV V channels de-interleaved as [Q | K | V], oldest column first), the depthwise conv weight
``conv_weight`` (C, W) and the gate parameters ``A_log``, ``dt_bias`` (HV,), with HV = H r:

    conv_in = [conv_state, mixed_qkv^T]                          (B, C, W - 1 + T), x's dtype
    u[b, t, c] = silu(sum_w conv_weight[c, w] conv_in[b, c, t + w])    (float32), rounded to x's dtype
    q, k, v = u split as [Q | K | V]                              (B, T, H, K), (B, T, H, K), (B, T, HV, V)
    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)      (B, T, HV) float32

(transformers' ``Qwen3NextGatedDeltaNet.forward``, its ``fix_query_key_value_ordering`` and causal conv; the
layout of ``runners.engine.models.gdn.GatedDeltaNet``). q and k come back raw: the rule L2-normalises them
(``use_qk_l2norm_in_kernel``) or the caller does (``kernels.gdn.l2norm``).

:func:`gdn_prologue_ref` is that computation in PyTorch (what the mixer runs on the CPU, in training and under
torch.compile); :func:`gdn_prologue` runs it as one kernel: one program per (row, block of channels) reads
the window and the T new inputs of its channels straight from the interleaved projection (no de-interleave
copy), convolves in float32 registers and writes conv_in, q / k / v; the programs of the first channel block
also write the row's gates. In the eager decode step it replaces about 20 launches per GDN block (the
de-interleave copies, the concatenation, the casts, conv1d, SiLU and the gates' elementwise chain; issue 27).
It agrees with the reference to float32 rounding (the conv's four products are summed in another order, and
Triton's exp / log are the hardware approximations), so a 16-bit q / k / v element may differ in its last bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_launchable, round_rne

# decode / verify sizes: a program loops over the T new tokens in registers
MAX_T = 64


def gdn_prologue_ref(qkvz: torch.Tensor, ba: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                     A_log: torch.Tensor, dt_bias: torch.Tensor, head_v_dim: int,
                     conv_rows: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GDN prologue in PyTorch (module docstring). Pure function.

    Args:
        qkvz: (B, T, H, 2K + 2rV) in_proj_qkvz's output (any strides), x's dtype.
        ba: (B, T, H, 2r) in_proj_ba's output.
        conv_state: (B, C, W - 1) the conv window before these tokens (any float dtype; cast to x's), or None
            (zeros: a fresh request); with ``conv_rows``, the whole cache (S, C, W - 1), of which row
            ``conv_rows[b]`` is row b's window.
        conv_rows: (B,) integer rows of ``conv_state`` (the engine's slot rows, PAD mapped to its scratch
            row), or None; in [-S, S), a negative row counting from the end as torch indexing does (-1: the
            last, scratch, row).
        conv_weight: (C, W) or (C, 1, W) depthwise conv weight (float32 math).
        A_log, dt_bias: (HV,).
        head_v_dim: V (K = (last dim of qkvz - 2 r V) / 2 with r = ba's last dim / 2).

    Returns:
        (q (B, T, H, K), k (B, T, H, K), v (B, T, HV, V) in x's dtype; g, beta (B, T, HV) float32; conv_in
        (B, C, W - 1 + T) in x's dtype).
    """
    B, T, H, width = qkvz.shape
    r = ba.shape[-1] // 2
    V = head_v_dim
    K = (width - 2 * r * V) // 2
    W = conv_weight.shape[-1]
    if conv_rows is not None:
        conv_state = conv_state[conv_rows]
    mixed_qkv = torch.cat([
        qkvz[..., :K].reshape(B, T, H * K), qkvz[..., K:2 * K].reshape(B, T, H * K),
        qkvz[..., 2 * K:2 * K + r * V].reshape(B, T, H * r * V)], dim=-1)  # de-interleaved [Q | K | V]
    if conv_state is None:
        conv_in = F.pad(mixed_qkv.transpose(1, 2), (W - 1, 0))
    else:
        conv_in = torch.cat([conv_state.to(mixed_qkv.dtype), mixed_qkv.transpose(1, 2)], dim=-1)
    C = conv_in.shape[1]
    u = F.silu(F.conv1d(conv_in.float(), conv_weight.reshape(C, 1, W).float(), groups=C))
    q, k, v = u.to(qkvz.dtype).transpose(1, 2).split([H * K, H * K, H * r * V], dim=-1)
    b, a = ba.split([r, r], dim=-1)
    beta = b.reshape(B, T, H * r).float().sigmoid()
    g = -A_log.float().exp() * F.softplus(a.reshape(B, T, H * r).float() + dt_bias.float())
    return (q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H * r, V), g, beta, conv_in)


@triton.jit
def _gdn_prologue_kernel(qkvz_ptr, ba_ptr, cs_ptr, rows_ptr, w_ptr, alog_ptr, dtb_ptr, q_ptr, k_ptr, v_ptr, g_ptr,
                         beta_ptr, cin_ptr, T, H, K, RV, R, C, HK, S,
                         s_qb, s_qt, s_qh, s_bab, s_bat, s_bah, s_csb, s_csc, s_csw,
                         HAS_STATE: tl.constexpr, HAS_ROWS: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_G: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    # channel c of [Q | K | V] -> its column in the interleaved projection row (head h: q_h, k_h, v_h, z_h)
    is_q = c < HK
    is_k = (c >= HK) & (c < 2 * HK)
    cv = c - 2 * HK
    head = tl.where(is_q, c // K, tl.where(is_k, (c - HK) // K, cv // RV))
    col = tl.where(is_q, c % K, tl.where(is_k, K + (c - HK) % K, 2 * K + cv % RV))
    src = qkvz_ptr + b * s_qb + head.to(tl.int64) * s_qh + col
    dt = qkvz_ptr.dtype.element_ty
    L = W - 1 + T
    cin_row = cin_ptr + (b * C + c) * L
    srow = tl.load(rows_ptr + b).to(tl.int64) if HAS_ROWS else b  # the row's window in the cache
    if HAS_ROWS:
        srow = tl.where(srow < 0, srow + S, srow)  # -1: the last (scratch) row, as torch indexes it
    cs_row = cs_ptr + srow * s_csb + c.to(tl.int64) * s_csc
    for j in tl.static_range(W - 1):  # the window, rounded to x's dtype (as conv_state.to(x.dtype))
        if HAS_STATE:
            wv = tl.load(cs_row + j * s_csw, mask=cm, other=0.0).to(tl.float32)
        else:
            wv = tl.zeros([BLOCK_C], dtype=tl.float32)
        tl.store(cin_row + j, round_rne(wv, dt).to(dt), mask=cm)
    for t in range(T):
        xt = tl.load(src + t * s_qt, mask=cm, other=0.0)
        tl.store(cin_row + (W - 1) + t, xt, mask=cm)
        # conv over conv_in columns t .. t + W - 1: column i < W - 1 is the window's, else token i - (W - 1)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(W):
            pos = tl.zeros([BLOCK_C], dtype=tl.int32) + (t + j - (W - 1))  # token index, < 0 in the window
            tok = tl.load(src + pos * s_qt, mask=cm & (pos >= 0), other=0.0).to(tl.float32)
            if HAS_STATE:
                win = tl.load(cs_row + (W - 1 + pos) * s_csw, mask=cm & (pos < 0), other=0.0).to(tl.float32)
                win = round_rne(win, dt)
            else:
                win = tl.zeros([BLOCK_C], dtype=tl.float32)
            tap = tl.load(w_ptr + c * W + j, mask=cm, other=0.0).to(tl.float32)
            acc += tap * tl.where(pos >= 0, tok, win)
        u = acc / (1.0 + tl.exp(-acc))  # silu
        uo = round_rne(u, dt).to(dt)
        row = (b * T + t) * HK
        tl.store(q_ptr + row + c, uo, mask=cm & is_q)
        tl.store(k_ptr + row + (c - HK), uo, mask=cm & is_k)
        tl.store(v_ptr + (b * T + t) * (C - 2 * HK) + cv, uo, mask=cm & (c >= 2 * HK))
    if cb == 0:  # the row's gates: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)
        hv = tl.arange(0, BLOCK_G)
        hm = hv < H * R
        kh, ri = hv // R, hv % R
        alog = tl.load(alog_ptr + hv, mask=hm, other=0.0).to(tl.float32)
        dtb = tl.load(dtb_ptr + hv, mask=hm, other=0.0).to(tl.float32)
        for t in range(T):
            base = ba_ptr + b * s_bab + t * s_bat + kh.to(tl.int64) * s_bah
            bb = tl.load(base + ri, mask=hm, other=0.0).to(tl.float32)
            aa = tl.load(base + R + ri, mask=hm, other=0.0).to(tl.float32) + dtb
            # softplus with torch's threshold (x > 20: x); log1p(e^x) ~ e^x below -15 (the log form rounds to 0)
            sp = tl.where(aa > 20.0, aa, tl.where(aa < -15.0, tl.exp(aa), tl.log(1.0 + tl.exp(aa))))
            out = (b * T + t) * (H * R) + hv
            tl.store(g_ptr + out, -tl.exp(alog) * sp, mask=hm)
            tl.store(beta_ptr + out, 1.0 / (1.0 + tl.exp(-bb)), mask=hm)


def gdn_prologue(qkvz: torch.Tensor, ba: torch.Tensor, conv_state: torch.Tensor | None, conv_weight: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, head_v_dim: int,
                 conv_rows: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gdn_prologue_ref` in one Triton launch (grid: rows x blocks of 128 channels). Same arguments and
    results (new contiguous tensors; nothing is mutated). qkvz / ba / conv_state may be strided views (any
    strides of conv_state); T <= MAX_T. With ``conv_rows`` the kernel reads each row's window from the cache
    itself (no gather copy before it); a strided conv_rows is copied first. Rows are not bounds-checked
    (that would take a host synchronisation): a row outside [-S, S) reads outside the cache.

    Raises:
        ValueError: CPU tensors without the Triton interpreter, shapes that do not fit together, T > MAX_T,
            conv_rows without a conv_state or not a (B,) integer tensor.
    """
    name = "gdn_prologue"
    if conv_rows is not None and (conv_state is None or conv_rows.dim() != 1 or conv_rows.shape[0] != qkvz.shape[0]
                                  or conv_rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{name}: conv_rows must be a ({qkvz.shape[0]},) int32 / int64 tensor of conv_state's rows, "
                         f"with a conv_state; got {None if conv_rows is None else (tuple(conv_rows.shape), conv_rows.dtype)}"
                         f" and conv_state {None if conv_state is None else tuple(conv_state.shape)}")
    tensors = [qkvz, ba, conv_weight, A_log, dt_bias] + ([conv_state] if conv_state is not None else [])
    if conv_rows is not None:
        conv_rows = conv_rows.contiguous()  # the kernel reads conv_rows[b] at offset b
        tensors.append(conv_rows)
    check_launchable(*tensors, name=name)
    if qkvz.dim() != 4 or ba.dim() != 4 or ba.shape[:3] != qkvz.shape[:3] or ba.shape[-1] % 2:
        raise ValueError(f"{name}: qkvz must be (B, T, H, 2K + 2rV) and ba (B, T, H, 2r); got "
                         f"{tuple(qkvz.shape)} and {tuple(ba.shape)}")
    B, T, H, width = qkvz.shape
    R = ba.shape[-1] // 2
    V = head_v_dim
    K = (width - 2 * R * V) // 2
    if K <= 0 or 2 * K + 2 * R * V != width:
        raise ValueError(f"{name}: qkvz's last dim {width} is not 2K + 2rV with r = {R}, V = {V}")
    HK, C = H * K, 2 * H * K + H * R * V
    W = conv_weight.shape[-1]
    if conv_weight.numel() != C * W:
        raise ValueError(f"{name}: conv_weight must be ({C}, {W}) (or ({C}, 1, {W})), got {tuple(conv_weight.shape)}")
    if conv_state is not None and (tuple(conv_state.shape[1:]) != (C, W - 1)
                                   or (conv_rows is None and conv_state.shape[0] != B)):
        rows = "S" if conv_rows is not None else B
        raise ValueError(f"{name}: conv_state must be ({rows}, {C}, {W - 1}), got {tuple(conv_state.shape)}")
    if A_log.numel() != H * R or dt_bias.numel() != H * R:
        raise ValueError(f"{name}: A_log and dt_bias must have HV = {H * R} elements")
    if T > MAX_T:
        raise ValueError(f"{name}: T = {T} new tokens > {MAX_T} (decode / verify sizes); use gdn_prologue_ref")
    if qkvz.stride(-1) != 1:
        qkvz = qkvz.contiguous()
    if ba.stride(-1) != 1:
        ba = ba.contiguous()
    dev, dt = qkvz.device, qkvz.dtype
    q = torch.empty(B, T, H, K, device=dev, dtype=dt)
    k = torch.empty(B, T, H, K, device=dev, dtype=dt)
    v = torch.empty(B, T, H * R, V, device=dev, dtype=dt)
    g = torch.empty(B, T, H * R, device=dev, dtype=torch.float32)
    beta = torch.empty(B, T, H * R, device=dev, dtype=torch.float32)
    conv_in = torch.empty(B, C, W - 1 + T, device=dev, dtype=dt)
    if B == 0 or T == 0:
        if conv_state is not None and B:
            conv_in.copy_(conv_state if conv_rows is None else conv_state[conv_rows])
        elif B:
            conv_in.zero_()
        return q, k, v, g, beta, conv_in
    cs = conv_state if conv_state is not None else conv_in  # not read without a state
    block_c = 128
    _gdn_prologue_kernel[(B, triton.cdiv(C, block_c))](
        qkvz, ba, cs, conv_rows if conv_rows is not None else cs, conv_weight.reshape(C, W).contiguous(), A_log,
        dt_bias, q, k, v, g, beta, conv_in, T, H, K, R * V, R, C, HK, cs.shape[0],
        qkvz.stride(0), qkvz.stride(1), qkvz.stride(2), ba.stride(0), ba.stride(1), ba.stride(2),
        cs.stride(0), cs.stride(1), cs.stride(2),
        HAS_STATE=conv_state is not None, HAS_ROWS=conv_rows is not None, W=W, BLOCK_C=block_c,
        BLOCK_G=triton.next_power_of_2(H * R), num_warps=4)
    return q, k, v, g, beta, conv_in

"""benchmarks/count_step_ops.py (ATen ops per decode-step phase, issue 27) on a tiny synthetic model, and the
exactness of the op reductions it guided (norm weight casts dropped by promotion)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.count_step_ops import count_step_ops, format_report, main
from runners.tools.synth import num_layers_range

TINY = {"hidden_size": 64, "vocab_size": 512, "mamba_num_heads": 8, "moe_latent_size": 32,
        "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32}


@pytest.mark.parametrize("family,draft_len,replay", [("nemotron_h", 3, True), ("qwen3_next", 0, False)])
def test_counts_every_phase_and_no_host_sync(family, draft_len, replay):
    report = count_step_ops(family, layers=4, draft_len=draft_len, replay=replay, steps=1, experts=4,
                            shrink=TINY, prompt_len=6)
    phases = report["phases"]
    want = ["draft", "verify", "commit", "catchup"] if draft_len else ["decode"]
    assert list(phases) == want
    for name, p in phases.items():
        assert p["ops"] > 0, name
        assert p["host_syncs"] == 0, (name, p)  # a step must not read device values (CUDA graphs)
    forward = phases["verify" if draft_len else "decode"]["kinds"]
    for kind in report["config"]["block_kinds"]:
        if not kind.startswith("mtp."):
            assert forward[kind]["ops"] > 0 and forward[kind]["ops_per_block"] > 0, kind
    assert report["total_ops"] == pytest.approx(sum(p["ops"] for p in phases.values()))
    assert family in format_report(report)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_norms_without_weight_cast_are_bitwise_equal(dtype):
    from runners.engine.models.layers import GatedGroupRMSNorm, RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-5).to(dtype)
    norm.weight.data.copy_(torch.randn(64, generator=g))
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(norm(x), (norm.weight.float() * xf).to(dtype))
    gated = GatedGroupRMSNorm(64, 16, 1e-5).to(dtype)
    gated.weight.data.copy_(torch.randn(64, generator=g))
    y, z = torch.randn(3, 64, generator=g).to(dtype), torch.randn(3, 64, generator=g).to(dtype)
    h = (y.float() * torch.nn.functional.silu(z.float())).unflatten(-1, (-1, 16))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    out = gated(y, z)
    assert out.dtype == torch.float32 and torch.equal(out, gated.weight.float() * h.flatten(-2))


def _peak_agrees(device: str) -> None:
    from runners.engine.models.block import abs_peak as _abs_peak

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for bad in (float("nan"), float("inf"), float("-inf"), None):
            x = torch.randn(2, 3, 700, device=device).to(dtype)
            if bad is not None:
                x[1, 2, 555] = bad
            assert bool(torch.isfinite(_abs_peak(x))) == bool(torch.isfinite(x).all()), (dtype, bad)
        top = torch.full((2, 3, 8), torch.finfo(dtype).max, dtype=dtype, device=device)
        assert bool(torch.isfinite(_abs_peak(top)))  # a max of finite values never overflows
        assert bool(torch.isfinite(_abs_peak(torch.empty(0, 8, dtype=dtype, device=device))))


def test_health_peak_is_finite_exactly_when_the_output_is():
    _peak_agrees("cpu")


@pytest.mark.gpu
def test_health_peak_is_finite_exactly_when_the_output_is_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _peak_agrees("cuda")


NEMOTRON_LAYERS, QWEN_LAYERS = num_layers_range("nemotron_h"), num_layers_range("qwen3_next")


@pytest.mark.parametrize("args, says", [
    (["--family", "nemotron_h", "--draft-len", "-1"], "draft_len=-1 must be an integer >= 0"),
    (["--family", "qwen3_next", "--json", "/nonexistent-dir/ops.json"], "does not exist"),
    (["--family", "nemotron_h", "--dtype", "foo"], "--dtype: invalid choice: 'foo'"),
    (["--family", "nemotron_h", "--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
    (["--family", "nemotron_h", "--format", "nvfp4", "--quant-moe-gemv-max-pairs", "-5"],
     "--quant-moe-gemv-max-pairs -5: a pair bound is a count; use 0"),
    (["--family", "nemotron_h", "--layers", str(NEMOTRON_LAYERS[0] - 1)],
     f"--layers {NEMOTRON_LAYERS[0] - 1}: a nemotron_h model has between {NEMOTRON_LAYERS[0]} and "
     f"{NEMOTRON_LAYERS[1]} layers; use --layers between {NEMOTRON_LAYERS[0]} and {NEMOTRON_LAYERS[1]}"),
    (["--family", "nemotron_h", "--layers", str(NEMOTRON_LAYERS[1] + 1)], "use --layers between"),
    (["--family", "qwen3_next", "--layers", str(QWEN_LAYERS[0] - 1)],
     f"--layers {QWEN_LAYERS[0] - 1}: a qwen3_next model has {QWEN_LAYERS[0]} or more layers"),
    (["--family", "qwen3_next", "--experts", "0"], "--experts 0: a model has at least 1 routed expert; use "
                                                   "--experts 1 or more"),
])
def test_cli_refuses_bad_arguments(args, says, capsys):
    """Bad arguments exit 2 with argparse's `error:` line naming the problem, not a traceback."""
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err
    assert "--num-layers" not in err and "--num-experts" not in err  # the builder's names, not this script's


def test_cli_checks_come_before_any_model(monkeypatch, capsys):
    """The argument checks refuse before a model is built: the builder is never reached."""
    import benchmarks.count_step_ops as mod

    def no_build(*a, **k):
        raise AssertionError("a model was built for refused arguments")

    monkeypatch.setattr(mod, "_synthetic_model", no_build)
    for args in (["--layers", "0"], ["--experts", "0"], ["--quant-moe-gemv-max-pairs", "-1"],
                 ["--dtype", "x"]):
        with pytest.raises(SystemExit) as e:
            main(["--family", "nemotron_h", *args])
        assert e.value.code == 2, args
    capsys.readouterr()


@pytest.mark.parametrize("max_pairs", [None, 0], ids=["engine default: pair path", "grouped path"])
def test_quantized_format_counts_its_kernels(max_pairs):
    """--format nvfp4 builds the release's module classes: the quantized GEMMs count as kernel ops, and the
    NVFP4 experts count as the per-pair path (one op per MoE block) within the pair bound (the engine's
    per-format bound, WeightFormat.moe_gemv_bound of the format's PAIR_KERNEL setting, above this step's
    pairs), else (a bound of 0) as the grouped path (a grouped GEMM per projection plus the routing glue,
    more ops per block)."""
    from runners.engine.formats import get_format

    shrink = {**TINY, "moe_latent_size": 32, "moe_intermediate_size": 48}
    report = count_step_ops("nemotron_h", layers=4, steps=1, experts=4, shrink=shrink, prompt_len=6,
                            fmt="nvfp4", quant_moe_gemv_max_pairs=max_pairs)
    assert report["config"]["format"] == "nvfp4"
    bound = report["config"]["quant_moe_gemv_max_pairs"]["nvfp4"]
    assert bound == (get_format("nvfp4").moe_gemv_bound() if max_pairs is None else max_pairs)
    pair_path = bound >= 8  # batch 1 x at most 4 experts chosen
    assert pair_path == (max_pairs != 0)
    p = report["phases"]["decode"]
    assert p["host_syncs"] == 0
    moe_ops = dict(p["kinds"]["moe"]["top"])
    blocks = p["kinds"]["moe"]["blocks"]
    if pair_path:
        assert moe_ops["kernel:moe_experts"] == blocks and "kernel:nvfp4_grouped_mm" not in moe_ops
    else:
        assert moe_ops["kernel:nvfp4_grouped_mm"] == 2 * blocks and "kernel:moe_experts" not in moe_ops
        # the grouped path's expert grouping, activation and combine: one launch each on CUDA
        assert moe_ops["kernel:sort_pairs"] == moe_ops["kernel:combine_sorted"] == blocks
        assert moe_ops["kernel:relu2"] == 2 * blocks  # the shared expert's and the routed experts'
        assert "argsort" not in moe_ops
    assert any(op.startswith("kernel:nvfp4_linear") or op.startswith("kernel:fp8_linear")
               for kind in p["kinds"].values() for op, _ in kind["top"])
    # the release's per-tensor FP8 linears (Mamba2's in / out projections, the shared experts' up / down)
    # read the codes their producer's launch wrote (the block norm, Mamba2's gated norm, relu2): no
    # quantization launch of their own in the decode step
    for kind in ("mamba2", "moe"):
        ops = dict(p["kinds"][kind]["top"])
        assert ops["kernel:fp8_linear"] == 2 * p["kinds"][kind]["blocks"], kind
        assert "kernel:fp8_linear.prep" not in ops, kind


def test_unknown_format_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--family", "qwen3_next", "--format", "nvfp4"])
    assert e.value.code == 2 and "no nvfp4 release rule for family qwen3_next" in capsys.readouterr().err


def test_patches_are_restored_on_exit_and_when_patching_fails(monkeypatch):
    """_patched puts back every attribute it replaced: after the block, after an error in the block, and after
    an error while it is still patching (here a QUANT_KERNELS entry naming a missing attribute, after the
    fused-stage dispatch was already switched)."""
    import benchmarks.count_step_ops as cso
    import runners.engine.models.attention as attention_mod
    import runners.engine.models.block as block_mod
    import runners.engine.models.gdn as gdn_mod
    import runners.engine.models.hybrid as hybrid_mod
    import runners.engine.models.layers as layers_mod
    import runners.engine.models.mamba2 as mamba2_mod
    import runners.engine.models.moe as moe_mod
    import runners.engine.models.mtp as mtp_mod
    import runners.engine.state as state_mod

    watched = [(layers_mod, "use_inference_kernel"), (gdn_mod, "use_inference_kernel"),
               (hybrid_mod, "use_inference_kernel"), (block_mod, "residual_add"),
               (hybrid_mod, "flag_nonfinite"), (block_mod, "flag_nonfinite"),
               (mtp_mod, "use_inference_kernel"), (mtp_mod, "flag_nonfinite"),
               (layers_mod, "relu2"), (layers_mod, "silu_mul"),
               (mamba2_mod, "causal_conv_step"), (mamba2_mod, "use_inference_kernel"),
               (attention_mod, "norm_rope"), (attention_mod, "use_inference_kernel"),
               (layers_mod, "rms_norm"), (gdn_mod, "gdn_prologue"),
               (state_mod, "kernel_or_reference"), (moe_mod.MoE, "_experts"),
               (moe_mod, "use_inference_kernel"), (moe_mod, "topk_route_ref"),
               (moe_mod, "shared_gate_combine")]
    before = [getattr(m, a) for m, a in watched]
    counter = cso.StepOpCounter()
    with cso._patched(counter, {}):
        assert layers_mod.use_inference_kernel(torch.zeros(1))
    assert [getattr(m, a) for m, a in watched] == before
    with pytest.raises(RuntimeError), cso._patched(counter, {}):
        raise RuntimeError("in the block")
    assert [getattr(m, a) for m, a in watched] == before
    monkeypatch.setattr(cso, "QUANT_KERNELS", (("runners.engine.quant", "no_such_kernel", False),))
    with pytest.raises(AttributeError), cso._patched(counter, {}):
        pass
    assert [getattr(m, a) for m, a in watched] == before


def test_block_fp8_counts_its_quantization_launch_only_under_w8a8():
    """A block-FP8 call's `.prep` (the activation-quantization launch) is counted where the format's scheme
    for its rows is w8a8, not under the w8a16 decode scheme (no such launch); per-tensor FP8 casts where no
    producer wrote its input's codes."""
    from benchmarks import count_step_ops as cso
    from runners.engine.formats import get_format

    fmt = get_format("block_fp8")
    assert fmt.decode_scheme == "w8a16"
    rows = fmt.decode_rows
    prep = {attr: p for _, attr, p in cso.QUANT_KERNELS}
    w = torch.zeros(4, 8, 128)  # 4 experts
    assert prep["block_fp8_linear"](torch.zeros(1, 128)) is False
    assert prep["block_fp8_linear"](torch.zeros(1, rows, 128)) is False  # [B, T, K]: B * T rows
    assert prep["block_fp8_linear"](torch.zeros(2, rows, 128)) is True  # 2 x decode_rows: w8a8
    assert prep["block_fp8_grouped_mm"](torch.zeros(4 * rows, 128), w) is False  # decode_rows per expert
    assert prep["block_fp8_grouped_mm"](torch.zeros(4 * rows + 4, 128), w) is True
    x, w8 = torch.zeros(1, 128), torch.zeros(8, 128)
    assert prep["fp8_linear"](x, w8, 1.0, 1.0) is True  # per-tensor FP8 casts x itself ...
    assert prep["fp8_linear"](x, w8, 1.0, 1.0, None, x) is False  # ... unless its producer wrote the codes


def test_fused_eager_step_hands_every_fp8_linear_its_producers_codes(monkeypatch):
    """A synthetic Super V3 NVFP4 model (FP8 Mamba2 projections and shared experts) through HybridLM's eager
    inference step with CUDA's decisions (the kernels' path, FP8Linear asking as on an FP8 GPU,
    count_step_ops' stand-in): every fp8_linear call receives codes, bitwise the quantize rule on the input
    it receives, and the hidden state equals the forward without health flags (the block-by-block path)."""
    import runners.engine.models.attention as attention_mod
    import runners.engine.models.block as block_mod
    import runners.engine.models.fp8_modules as fp8_modules
    import runners.engine.models.hybrid as hybrid_mod
    import runners.engine.models.layers as layers_mod
    import runners.engine.models.mamba2 as mamba2_mod
    import runners.engine.models.moe as moe_mod
    from benchmarks import count_step_ops as cso
    from kernels.quant.fp8 import quantize_fp8_ref

    for mod in (block_mod, hybrid_mod, layers_mod, moe_mod, mamba2_mod, attention_mod):
        monkeypatch.setattr(mod, "use_inference_kernel", lambda t: True)
    monkeypatch.setattr(fp8_modules.FP8Linear, "prequant_scale", cso._fp8_prequant_scale_on_cuda)
    seen = []
    linear = fp8_modules.fp8_linear

    def recorded(x, w, ws, s, b=None, xq=None):
        want = quantize_fp8_ref(x, s).view(torch.uint8)
        seen.append(xq is not None and torch.equal(xq.view(torch.uint8), want))
        return linear(x, w, ws, s, b, xq)

    monkeypatch.setattr(fp8_modules, "fp8_linear", recorded)
    torch.manual_seed(0)
    model = cso._synthetic_model("nemotron_h", "nvfp4", 6, 8, dict(cso.FORMAT_SHRINK), torch.bfloat16)
    ids = torch.randint(1, 500, (1, 12))
    with torch.no_grad():
        model.track_nonfinite("cpu")
        fused = model(ids)
        assert len(seen) >= 6 and all(seen), seen
        assert not model.nonfinite.any()
        model.nonfinite = None
        plain = model(ids)
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("form", ["fused", "logits"])
def test_router_forms_are_counted_as_on_cuda(form, monkeypatch):
    """With moe.ROUTER_FORMS giving batch 1 a decode form, the count follows CUDA's dispatch: the router is
    router_fused (one op per MoE block) or router_logits + topk_route (two), with no float32 copy or GEMM of
    its own; with the table empty, the three launches' top-k (topk_route) and no fused op."""
    import runners.engine.models.moe as moe_mod

    def moe_ops(forms):
        monkeypatch.setattr(moe_mod, "ROUTER_FORMS", forms)
        report = count_step_ops("nemotron_h", layers=4, steps=1, experts=4, shrink=TINY, prompt_len=6)
        kind = report["phases"]["decode"]["kinds"]["moe"]
        return dict(kind["top"]), kind["blocks"]

    ops, blocks = moe_ops(((8, form),))
    names = ["kernel:router_fused"] if form == "fused" else ["kernel:router_logits", "kernel:topk_route"]
    for name in names:
        assert ops.get(name) == blocks, (name, ops)
    assert "kernel:topk_route" not in ops or form == "logits"
    plain, _ = moe_ops(())
    assert plain.get("kernel:topk_route") == blocks and "kernel:router_fused" not in plain
    assert sum(plain.values()) - sum(ops.values()) >= (2 if form == "fused" else 1) * blocks

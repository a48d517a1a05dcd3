"""The release checkpoint formats end to end on the CPU (issue 25): ModelOpt FP8 as Nemotron 3 Super FP8 ships
it (MTP and attention excluded), ModelOpt MIXED_PRECISION / NVFP4 run W4A16, Qwen's block FP8. Checkpoints are
written by runners.tools.quantize from the shipped tiny checkpoints (trained weights) and by
runners.tools.synth at release layouts (random weights); each loads with the release's tensor names and
dtypes, matches the same weights dequantized, and drafts with MTP and SSM replay. `gpu` tests load
synthetic checkpoints of each format at released widths on the H200."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from registry.checkpoint import CheckpointError
from registry.hf_config import FORMAT_BLOCK_FP8, FORMAT_FP8, FORMAT_NVFP4
from registry.schema import REPO_ROOT
from runners.engine.engine import Engine
from runners.engine.loader import load_model, plan_load
from runners.engine.models.block_fp8 import BlockFP8Linear, BlockFP8MoE
from runners.engine.models.fp8_modules import FP8Linear
from runners.engine.models.nvfp4 import NVFP4MoE
from runners.engine.options import EngineOptions
from runners.engine.quant import kv_cache_scales
from runners.tools.quantize import quantize_checkpoint
from runners.tools.synth import release_layout, synth_config, tensor_specs, write_synthetic_checkpoint

CKPTS = REPO_ROOT / "registry" / "checkpoints"
SMALL = {  # CPU widths (as tests/test_synth.py): release layouts, small hidden / expert sizes
    "nemotron_h": dict(hidden_size=128, vocab_size=2048, mamba_num_heads=16, moe_latent_size=64,
                       moe_intermediate_size=96, moe_shared_expert_intermediate_size=192,
                       num_attention_heads=8, head_dim=32),
    "qwen3_next": dict(hidden_size=128, vocab_size=2048, linear_key_head_dim=32, linear_value_head_dim=48,
                       head_dim=64, num_attention_heads=4, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64),
}
# (family, format) of each release; the tiny source checkpoint of the family
RELEASES = [("nemotron_h", "fp8"), ("nemotron_h", "nvfp4"), ("qwen3_next", "block_fp8")]
TINY = {"nemotron_h": CKPTS / "tiny_nemotron_h_mtp", "qwen3_next": CKPTS / "tiny_qwen3_next_mtp"}


@pytest.fixture(scope="module")
def tiny_formats(tmp_path_factory, gsm8k_dir) -> dict[str, Path]:
    """The shipped tiny checkpoints quantized into each release format by runners.tools.quantize (small
    calibration: 4 GSM8K train prompts)."""
    out = {}
    for family, fmt in RELEASES:
        dst = tmp_path_factory.mktemp(f"{family}_{fmt}")
        quantize_checkpoint(TINY[family], dst, fmt=fmt, calib_samples=4, calib_tokens=8,
                            data_dir=str(gsm8k_dir), say=lambda _m: None)
        out[fmt] = dst
    return out


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src`` (a quantized checkpoint) with every quantized weight replaced by its float32 dequantization
    (kernels.quant / runners.engine.models.fp8 references), the scale tensors dropped and the quantization
    config removed: the same weights, unquantized."""
    from kernels.quant.block_fp8 import block_fp8_dequantize
    from kernels.quant.nvfp4 import nvfp4_dequantize

    shutil.copytree(src, dst)
    (dst / "hf_quant_config.json").unlink(missing_ok=True)
    raw = json.loads((dst / "config.json").read_text())
    del raw["quantization_config"]
    (dst / "config.json").write_text(json.dumps(raw))
    t = load_file(dst / "model.safetensors")
    out = {}
    for name, w in t.items():
        module = name.removesuffix(".weight")
        if name.endswith((".weight_scale", ".input_scale", ".weight_scale_2", ".weight_scale_inv", ".k_scale",
                          ".v_scale")):
            continue
        if f"{module}.weight_scale_2" in t:
            w = nvfp4_dequantize(w, t[f"{module}.weight_scale"], t[f"{module}.weight_scale_2"], torch.float32)
        elif f"{module}.weight_scale_inv" in t:
            w = block_fp8_dequantize(w, t[f"{module}.weight_scale_inv"], torch.float32)
        elif f"{module}.weight_scale" in t:
            w = w.float() * t[f"{module}.weight_scale"]
        out[name] = w.contiguous()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# ------------------------------------------------------------------------------------------------ layouts


def _dtypes(path: Path) -> dict[str, str]:
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    out = {}
    for f in files:
        with safe_open(str(path / f), "pt") as st:
            out.update({n: st.get_slice(n).get_dtype() for n in st.keys()})
    return out


def test_synth_writes_the_super_fp8_release_layout(tmp_path):
    """ModelOpt FP8 as Nemotron 3 Super FP8: Mamba / shared-expert / routed-expert FP8 with per-tensor
    scales, attention, latent projections, router and MTP in BF16 without scales; backbone KV scales only;
    both spellings of the quantization config."""
    write_synthetic_checkpoint(tmp_path, "nemotron_h", num_layers=8, num_experts=4,
                               overrides=SMALL["nemotron_h"], fmt="fp8")
    d = _dtypes(tmp_path)
    assert d["backbone.layers.0.mixer.in_proj.weight"] == "F8_E4M3"
    m = "backbone.layers.0.mixer.in_proj"
    assert d[f"{m}.weight_scale"] == d[f"{m}.input_scale"] == "F32"
    assert d["backbone.layers.1.mixer.experts.3.down_proj.weight"] == "F8_E4M3"
    for bf16 in ("backbone.layers.1.mixer.fc1_latent_proj.weight", "mtp.layers.0.mixer.q_proj.weight",
                 "mtp.layers.1.mixer.experts.0.up_proj.weight", "lm_head.weight"):
        assert d[bf16] == "BF16", bf16
    attn = [n.removesuffix("q_proj.weight") for n in d
            if n.endswith("q_proj.weight") and n.startswith("backbone.")]
    assert d[attn[0] + "q_proj.weight"] == "BF16" and d[attn[0] + "k_proj.k_scale"] == "F32"
    assert not any(n.startswith("mtp.") and n.endswith(("_scale", "scale_2")) for n in d)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    hf = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert (cfg["quant_method"], cfg["quant_algo"], hf["kv_cache_quant_algo"]) == ("modelopt", "FP8", "FP8")
    assert "mtp*" in cfg["ignore"] and cfg["ignore"] == hf["exclude_modules"]
    model = load_model(tmp_path)  # the MTP module loads unquantized from an FP8 checkpoint
    assert model.mtp is not None and type(model.mtp.blocks[1].mixer).__name__ == "MoE"
    assert [s is not None for s in kv_cache_scales(model).values()] == [True] * len(attn) + [False]


def test_synth_writes_the_super_nvfp4_release_layout(tmp_path):
    """MIXED_PRECISION: routed experts NVFP4 (uint8 weight [N, K/2], e4m3 weight_scale [N, K/16], fp32
    weight_scale_2 / input_scale), Mamba and shared experts FP8, the rest BF16; quantized_layers per module
    in hf_quant_config.json, config_groups in config.json."""
    write_synthetic_checkpoint(tmp_path, "nemotron_h", num_layers=8, num_experts=4,
                               overrides=SMALL["nemotron_h"], fmt="nvfp4")
    d = _dtypes(tmp_path)
    e = "backbone.layers.1.mixer.experts.2.up_proj"
    assert (d[f"{e}.weight"], d[f"{e}.weight_scale"], d[f"{e}.weight_scale_2"], d[f"{e}.input_scale"]) == (
        "U8", "F8_E4M3", "F32", "F32")
    with safe_open(str(next(tmp_path.glob("model-*.safetensors"))), "pt") as st:
        if f"{e}.weight" in st.keys():
            L, I = SMALL["nemotron_h"]["moe_latent_size"], SMALL["nemotron_h"]["moe_intermediate_size"]
            assert st.get_slice(f"{e}.weight").get_shape() == [I, L // 2]
            assert st.get_slice(f"{e}.weight_scale").get_shape() == [I, L // 16]
    assert d["backbone.layers.0.mixer.in_proj.weight"] == "F8_E4M3"
    assert d["backbone.layers.1.mixer.shared_experts.up_proj.weight_scale"] == "F32"
    assert d["backbone.layers.1.mixer.fc2_latent_proj.weight"] == "BF16"
    assert d["mtp.layers.1.mixer.experts.0.up_proj.weight"] == "BF16"
    hf = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "MIXED_PRECISION" and hf["quantized_layers"][e] == {"quant_algo": "NVFP4",
                                                                                 "group_size": 16}
    assert hf["quantized_layers"]["backbone.layers.0.mixer.in_proj"] == {"quant_algo": "FP8"}
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert {g["weights"]["num_bits"] for g in cfg["config_groups"].values()} == {4, 8}
    model = load_model(tmp_path)
    assert sum(isinstance(m, NVFP4MoE) for m in model.modules()) == len(
        [c for c in model.config.layer_types if c == "moe"])
    assert model.quant_report["nvfp4_moe"] == {"reference": 3} and model.quant_report["fp8_linears"]


def test_synth_writes_the_qwen_block_fp8_release_layout(tmp_path):
    """Qwen's block FP8: weight_scale_inv per 128 x 128 block in BF16, modules_to_not_convert naming each
    module left out (MTP's fc, norms and gates; MTP's projections quantized), no hf_quant_config.json."""
    write_synthetic_checkpoint(tmp_path, "qwen3_next", num_layers=4, num_experts=4,
                               overrides=SMALL["qwen3_next"], fmt="block_fp8")
    d = _dtypes(tmp_path)
    for m in ("model.layers.0.linear_attn.in_proj_qkvz", "model.layers.3.self_attn.o_proj",
              "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.mlp.experts.1.gate_proj",
              "model.layers.0.mlp.shared_expert.down_proj"):
        assert (d[f"{m}.weight"], d[f"{m}.weight_scale_inv"]) == ("F8_E4M3", "BF16"), m
    for m in ("mtp.fc", "model.layers.0.linear_attn.in_proj_ba", "lm_head", "model.layers.0.mlp.gate"):
        assert d[f"{m}.weight"] == "BF16" and f"{m}.weight_scale_inv" not in d, m
    assert not (tmp_path / "hf_quant_config.json").exists()
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["fmt"], cfg["activation_scheme"], cfg["weight_block_size"]) == (
        "fp8", "e4m3", "dynamic", [128, 128])
    skip = set(cfg["modules_to_not_convert"])
    assert {"mtp.fc", "mtp.norm", "mtp.layers.0.mlp.shared_expert_gate", "model.layers.0.linear_attn.A_log",
            "model.layers.0.linear_attn.dt_bias", "model.layers.0.linear_attn.conv1d", "lm_head"} <= skip
    assert not any(s.startswith("mtp.layers.0.self_attn.") and s.endswith("_proj") for s in skip)
    model = load_model(tmp_path)
    assert isinstance(model.mtp.blocks[0].mixer.q_proj, BlockFP8Linear)
    assert isinstance(model.layers[0].mlp if hasattr(model.layers[0], "mlp") else model.layers[1].mixer,
                      BlockFP8MoE) or any(isinstance(m, BlockFP8MoE) for m in model.modules())
    assert model.quant_report["block_fp8_linears"] == {"reference": 29}


def test_synth_rejects_a_format_the_family_has_no_release_in(tmp_path):
    from runners.tools.synth import SynthError

    with pytest.raises(SynthError, match="no nvfp4 release rule for family qwen3_next"):
        write_synthetic_checkpoint(tmp_path, "qwen3_next", num_layers=4, num_experts=4,
                                   overrides=SMALL["qwen3_next"], fmt="nvfp4")


@pytest.mark.parametrize("family, fmt", RELEASES)
def test_registry_validate_accepts_each_release_config(family, fmt, tmp_path, monkeypatch):
    """`python -m registry validate` on a models_root holding the release's config.json (and
    hf_quant_config.json) at full depth: the entry's arch and quant agree with it."""
    from registry.validate import validate_one

    entry = {("nemotron_h", "fp8"): ("super_v3_mtp_fp8", "NVIDIA-Nemotron-3-Super-120B-A12B-FP8"),
             ("nemotron_h", "nvfp4"): ("super_v3_mtp_nvfp4", "NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4"),
             ("qwen3_next", "block_fp8"): ("qwen3_next_mtp_fp8", "Qwen3-Next-80B-A3B-Instruct-FP8")}[
        (family, fmt)]
    name, folder = entry
    d = tmp_path / folder
    d.mkdir()
    config = synth_config(family)
    layout = release_layout(config, fmt, [s.name for s in tensor_specs(config)])
    (d / "config.json").write_text(json.dumps(dict(config, quantization_config=layout.config_json)))
    if layout.hf_quant_config is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(layout.hf_quant_config))
    monkeypatch.setenv("LLM_MODELS_ROOT", str(tmp_path))
    report = validate_one(name)
    assert not report.errors, report.errors
    q = report.resolved.checkpoint_config.quantization
    assert q.method == ("nvfp4" if fmt == "nvfp4" else "fp8")


# ------------------------------------------------------------------------------------------------ numerics


# relative logit error against the dequantized weights and greedy agreement, per format, on the first GSM8K
# test answer: the bounds tests/test_fp8.py holds FP8 to against BF16 (not tuned per format; the activation
# rounding of FP8 / block-FP8 layers is the only error source left, NVFP4's W4A16 GEMMs add none)
TOLERANCE = {"fp8": (0.1, 0.9), "nvfp4": (0.1, 0.9), "block_fp8": (0.1, 0.9)}


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "block_fp8"])
def test_tiny_format_matches_its_dequantized_weights(fmt, tiny_formats, tmp_path, gsm8k_dir):
    """Each format's tiny checkpoint against the same weights dequantized into an unquantized checkpoint: the
    only differences left are the activation quantization of FP8 layers (static per tensor, dynamic per
    128-column group for block FP8) and accumulation order; NVFP4's W4A16 GEMMs add none."""
    from tokenizers import Tokenizer

    ckpt = tiny_formats[fmt]
    plain = dequantized_copy(ckpt, tmp_path / "deq")
    row = json.loads((gsm8k_dir / "test.jsonl").read_text().splitlines()[0])
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    ids = torch.tensor([tok.encode(f"Question: {row['question']}\nAnswer: {row['answer']}").ids])
    a = Engine.from_pretrained(ckpt, EngineOptions(max_batch_size=1, max_seq_len=512)).logits(ids)
    b = Engine.from_pretrained(plain, EngineOptions(max_batch_size=1, max_seq_len=512)).logits(ids)
    rel, agree = ((a - b).norm() / b.norm()).item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    tol_rel, tol_agree = TOLERANCE[fmt]
    assert rel < tol_rel and agree > tol_agree, (rel, agree)


def test_nvfp4_experts_equal_their_dequantized_product():
    """An NVFP4 MoE block (W4A16, no activation quantization) equals the same block with the dequantized
    expert weights, to float32 rounding."""
    from kernels.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
    from runners.engine.models.config import HybridConfig
    from runners.engine.models.moe import MoE
    from runners.engine.quant import _to_quantized_moe

    cfg = HybridConfig.from_dict(synth_config("nemotron_h", num_layers=3, num_experts=8,
                                              overrides=SMALL["nemotron_h"]))
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    q = MoE(cfg)
    q.load_state_dict(moe.state_dict())
    _to_quantized_moe(q, FORMAT_NVFP4)
    with torch.no_grad():
        for kind in ("up", "down"):
            w, s, s2 = nvfp4_quantize(getattr(moe, f"experts_{kind}").data)
            getattr(q, f"experts_{kind}").copy_(w)
            getattr(q, f"experts_{kind}_weight_scale").copy_(s)
            getattr(q, f"experts_{kind}_weight_scale_2").copy_(s2)
            getattr(moe, f"experts_{kind}").copy_(nvfp4_dequantize(w, s, s2, torch.float32))
    x = torch.randn(2, 5, cfg.hidden_size)
    torch.testing.assert_close(q(x), moe(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "block_fp8"])
def test_tiny_format_replay_equals_rewind_and_greedy(fmt, tiny_formats, gsm8k_dir):
    """Quantized weights and an FP8 KV cache (checkpoint scales where the format has them, 1.0 elsewhere):
    MTP drafting with rewind and with replay emit exactly the greedy tokens, and drafts are accepted."""
    from tokenizers import Tokenizer

    ckpt = tiny_formats[fmt]
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    rows = [json.loads(x) for x in (gsm8k_dir / "test.jsonl").read_text().splitlines()[:2]]
    prompts = [tok.encode(f"Question: {r['question']}\nAnswer:").ids for r in rows]
    outs = {}
    for name, kw in {"greedy": dict(draft_len=0), "rewind": dict(draft_len=3),
                     "replay": dict(draft_len=3, ssm_replay=True)}.items():
        options = EngineOptions(kv_cache_quant="fp8", max_batch_size=2, max_seq_len=256, **kw)
        engine = Engine.from_pretrained(ckpt, options)
        outs[name] = engine.generate(prompts, 12, stop_token_ids=[])
    assert outs["rewind"].tokens == outs["replay"].tokens == outs["greedy"].tokens
    assert outs["rewind"].stats.acceptance_rate > 0.2


@pytest.mark.slow
@pytest.mark.parametrize("fmt, entry", [("nvfp4", "tiny_nemotron_h_mtp_fp8"),
                                        ("block_fp8", "tiny_qwen3_next_mtp_fp8")])
def test_run_py_on_each_tiny_format(fmt, entry, tiny_formats, gsm8k_dir, tmp_path):
    """`python run.py model=<tiny entry> model.quant=<q> model.checkpoint=<format dir> ssm_replay=true
    verdict.require_reference=false` on the CPU (2 questions, 96 tokens: the references are slow; eval.limit=4
    at 256 tokens took 12 minutes for nvfp4 on a loaded 2-core machine, acceptance 0.51): the run completes
    with MTP and replay, its logits are finite, drafts are accepted, and results.json records
    which GEMMs ran."""
    from registry.compose import compose_config
    from runners.app import main as app

    quant = "nvfp4" if fmt == "nvfp4" else "fp8"
    cfg = compose_config([f"model={entry}", f"model.quant={quant}", f"model.checkpoint={tiny_formats[fmt]}",
                          "eval.limit=2", "eval.max_gen_toks=96", "ssm_replay=true",
                          "verdict.require_reference=false",
                          f"eval.data_dir={gsm8k_dir}", f"out_dir={tmp_path}"])
    results = app.run(cfg)
    report = results["config"]["fp8_gemms"]
    key = "nvfp4_moe" if fmt == "nvfp4" else "block_fp8_moe"
    assert report[key] == {"reference": 2 if fmt == "nvfp4" else 9}, report
    checks = {c["name"]: c for c in results["verdict"]["checks"]}
    assert checks["health.finite"]["status"] == "pass"
    assert checks["acceptance.rate"]["value"] > 0.2


# ------------------------------------------------------------------------------------------------ errors


def _edit(src: Path, dst: Path, fn) -> Path:
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    fn(t)
    save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_or_corrupt_scales_are_named(tiny_formats, tmp_path):
    nv, bl = tiny_formats["nvfp4"], tiny_formats["block_fp8"]
    e = "backbone.layers.2.mixer.experts.5.down_proj"
    gone = _edit(nv, tmp_path / "gone", lambda t: t.pop(f"{e}.weight_scale_2"))
    with pytest.raises(CheckpointError, match=rf"missing tensors .*{e}\.weight_scale_2"):
        plan_load(gone)
    m = "model.layers.3.self_attn.o_proj"

    def nan_scale(t):
        t[f"{m}.weight_scale_inv"] = torch.full_like(t[f"{m}.weight_scale_inv"], float("nan"))

    with pytest.raises(CheckpointError, match=rf"NaN or infinite values: .*{m}\.weight_scale_inv"):
        load_model(_edit(bl, tmp_path / "nan", nan_scale))

    def unpacked(t):  # an NVFP4 weight stored as bf16 values would be misread: refused by dtype / shape
        t[f"{e}.weight"] = t[f"{e}.weight"].to(torch.bfloat16)

    with pytest.raises(CheckpointError, match=rf"{e}\.weight is BF16 on disk but the model holds it in "
                                              r"torch.uint8"):
        plan_load(_edit(nv, tmp_path / "bf16", unpacked))

    def half_kv(t):
        t.pop(next(n for n in t if n.endswith("v_proj.v_scale")))

    with pytest.raises(CheckpointError, match="stores k_proj.k_scale but not v_proj.v_scale"):
        plan_load(_edit(tiny_formats["fp8"], tmp_path / "kv", half_kv))
    scale = f"{e}.weight_scale"  # NVFP4's [N, K / 16] block scales

    def wrong_shape(t):
        t[scale] = t[scale][:, :1].contiguous()

    with pytest.raises(CheckpointError, match=rf"{scale} has shape"):
        plan_load(_edit(nv, tmp_path / "shape", wrong_shape))


# ------------------------------------------------------------------------------------------------ GPU

# the fewest layers holding every layer kind of the release (Super V3's pattern has its first attention layer
# at index 7; Qwen3-Next repeats three GDN layers and one attention), every released width and expert count:
# a third of the quarter depth's disk writes, which dominated the GPU stage's longest chain (the three ran
# 99-128 s each at quarter depth, docs/gpu/robust_3). tests/gpu/formats_run.sh runs run.py at quarter depth.
LAYERS = {"nemotron_h": 8, "qwen3_next": 4}


@pytest.mark.gpu
@pytest.mark.gpu_memory(40)  # 13-33 GiB at the peak
@pytest.mark.xdist_group("disk")  # 8-14 GB each on a 64 GB disk: one at a time under pytest-xdist
@pytest.mark.parametrize("family, fmt", RELEASES)
def test_release_format_loads_and_generates_gpu(family, fmt, tmp_path):
    """A synthetic checkpoint in the release's exact format (released widths and expert counts, every layer
    kind; written to tmp, removed at the end) loads on the GPU with the release's modules and the
    Triton GEMMs, and generates with MTP, rewind and replay. Only the prefill's token is compared between
    them: after the first verify the two state updates round differently in bf16 (different kernels), and a
    near-tie of a random model can then flip a token (seen on Super NVFP4: equal for 12 of 16 tokens).
    Replay == rewind token for token is checked where it is exact: float32 on the tiny models
    (tests/test_replay_engine.py) and forced acceptance (benchmarks/bench_e2e.py)."""
    try:
        write_synthetic_checkpoint(tmp_path, family, num_layers=LAYERS[family], fmt=fmt, device="cuda",
                                   shard_bytes=5 * 10**9)
        kinds = {FORMAT_FP8: FP8Linear, FORMAT_NVFP4: NVFP4MoE, FORMAT_BLOCK_FP8: BlockFP8MoE}
        outs = {}
        runs = {"rewind": dict(draft_len=3), "replay": dict(draft_len=3, ssm_replay=True)}
        for name, kw in runs.items():
            options = EngineOptions(dtype=torch.bfloat16, kv_cache_quant="fp8", max_batch_size=2,
                                    max_seq_len=256, **kw)
            engine = Engine.from_pretrained(tmp_path, options, device="cuda")
            assert any(isinstance(m, kinds[fmt]) for m in engine.model.modules())
            report = engine.model.quant_report
            assert "reference" not in json.dumps(report), report
            outs[name] = engine.generate([[1, 5, 9, 13, 17], [1, 7, 7, 7]], 16, stop_token_ids=[])
            del engine
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    for name, out in outs.items():
        assert [len(t) for t in out.tokens] == [16, 16], name
        assert out.stats.drafted_tokens > 0, name  # MTP ran: draft and verify steps, not plain decoding
    assert [t[0] for t in outs["replay"].tokens] == [t[0] for t in outs["rewind"].tokens]  # same prefill


@pytest.mark.parametrize("fmt", ["bf16", FORMAT_FP8, FORMAT_NVFP4, FORMAT_BLOCK_FP8])
def test_stored_nbytes_is_what_quantize_weight_writes(fmt):
    """The size synth checks free disk against equals the bytes written (ragged block-FP8 edges included)."""
    from runners.tools.formats import quantize_weight, stored_nbytes

    w = torch.randn(200, 320, dtype=torch.bfloat16)
    tensors = {"m.weight": w} if fmt == "bf16" else quantize_weight(fmt, "m", w)
    assert stored_nbytes(fmt, tuple(w.shape)) == sum(t.numel() * t.element_size() for t in tensors.values())


def test_block_fp8_decode_scheme_is_the_formats_rule_and_reaches_the_gemm(monkeypatch):
    """The format's rule (WeightFormat.scheme): decode-sized products (<= decode_rows rows) take its
    decode_scheme, larger ones w8a8; BlockFP8Linear passes it to the GEMM (on the CPU its reference): with
    w8a16 its output is the activation times the dequantized weight, not the w8a8 product."""
    from kernels.quant.block_fp8 import block_fp8_linear_ref, block_fp8_quantize
    from runners.engine.formats import get_format

    fmt = get_format(FORMAT_BLOCK_FP8)
    # block FP8's decode scheme is w8a16 since the H100 measured it ahead (docs/gpu/quant_2); per-tensor FP8's
    # stays w8a8 (torch._scaled_mm led from 4 rows on)
    assert fmt.decode_scheme == "w8a16" and get_format(FORMAT_FP8).decode_scheme == "w8a8"
    layer = BlockFP8Linear(256, 128)
    q, s = block_fp8_quantize(torch.randn(128, 256))
    layer.weight.data, layer.weight_scale_inv = q, s.float()
    x = torch.randn(2, 3, 256)
    assert fmt.scheme(fmt.decode_rows) == "w8a16" and fmt.scheme(fmt.decode_rows + 1) == "w8a8"
    y = layer(x)
    w8a16 = block_fp8_linear_ref(x.reshape(6, 256), q, s.float(), scheme="w8a16").reshape(2, 3, 128)
    assert torch.equal(y, w8a16)
    assert not torch.equal(y, block_fp8_linear_ref(x.reshape(6, 256), q, s.float()).reshape(2, 3, 128))
    x_prefill = torch.randn(fmt.decode_rows + 1, 256)
    assert torch.equal(layer(x_prefill), block_fp8_linear_ref(x_prefill, q, s.float()))


def test_block_fp8_grouped_experts_take_the_decode_scheme_too(monkeypatch):
    """The grouped expert GEMM (above the per-pair bound: a batch-64 verify, ~5 rows per expert) runs the
    format's decode scheme for its rows per expert, w8a8 above decode_rows (the review found it always
    w8a8)."""
    from kernels.quant.block_fp8 import block_fp8_grouped_mm_ref, block_fp8_quantize
    from runners.engine.formats import get_format
    from runners.engine.models.block_fp8 import block_fp8_grouped_mm

    q, s = block_fp8_quantize(torch.randn(4, 64, 256))
    s = s.float()
    offs = torch.tensor([5, 10, 15, 20], dtype=torch.int32)
    x = torch.randn(20, 256)
    assert get_format(FORMAT_BLOCK_FP8).decode_scheme == "w8a16"
    assert torch.equal(block_fp8_grouped_mm(x, q, s, offs),
                       block_fp8_grouped_mm_ref(x, q, s, offs, scheme="w8a16"))
    many = torch.randn(40, 256)  # 10 rows per expert: above decode_rows
    offs2 = torch.tensor([10, 20, 30, 40], dtype=torch.int32)
    assert torch.equal(block_fp8_grouped_mm(many, q, s, offs2), block_fp8_grouped_mm_ref(many, q, s, offs2))

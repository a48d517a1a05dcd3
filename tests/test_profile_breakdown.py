"""benchmarks/profile_breakdown.py on small synthetic torch.profiler Chrome traces: replays found by
correlation (and by time when a trace has none), counts, busy, span, categories, signature grouping, the
eager prefill kept apart, and the input errors."""

from __future__ import annotations

import json

import pytest

from benchmarks.profile_breakdown import (
    CATEGORIES,
    EAGER_AFTER,
    EAGER_BEFORE,
    OTHER,
    UNATTRIBUTED,
    breakdown,
    categorize,
    format_report,
    load_trace,
    main,
    split_replays,
)
from registry.errors import UserError


def _runtime(name, ts, corr, dur=5.0, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}


def _dev(name, ts, dur, corr, cat="kernel"):
    args = {"stream": 7, "grid": [1, 1, 1], "block": [128, 1, 1]}
    if corr is not None:
        args["correlation"] = corr
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur, "args": args}


# graph A: a dense GEMM, a routed-expert GEMV, an inductor kernel, a memset; graph B: one SDPA kernel
GRAPH_A = [("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", 10.0), ("_pair_gemv_kernel", 20.0),
           ("triton_poi_fused_add_0", 2.0)]


def _trace(correlated=True):
    """Eager prefill (3 kernels + a memcpy), then two steps of graphs A, B; an eager token copy between."""
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0.0, "dur": 50.0,
           "args": {}}]
    ev += [_runtime("cudaLaunchKernel", 1.0, 1), _dev("_topk_route_kernel", 100.0, 4.0, 1),
           _runtime("cuLaunchKernelEx", 2.0, 2, cat="cuda_driver"),
           _dev("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", 110.0, 30.0, 2),
           _runtime("cudaLaunchKernel", 3.0, 3), _dev("mystery_kernel", 150.0, 6.0, 3),
           _runtime("cudaMemcpyAsync", 4.0, 4),
           _dev("Memcpy HtoD (Pinned -> Device)", 160.0, 1.0, 4, "gpu_memcpy")]
    corr, t = 100, 1000.0
    for _ in range(2):
        launch = t - 500.0
        ev.append(_runtime("cudaGraphLaunch", launch, corr))
        ts = t
        for name, dur in GRAPH_A:
            ev.append(_dev(name, ts, dur, corr if correlated else None))
            ts += dur + 1.0  # 1 us gap between kernels
        ev.append(_dev("Memset (Device)", ts, 0.5, corr if correlated else None, "gpu_memset"))
        ev.append(_runtime("cudaGraphLaunch", launch + 10.0, corr + 1))
        ev.append(_dev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", ts + 5.0, 8.0,
                       corr + 1 if correlated else None))
        ev.append(_runtime("cudaMemcpyAsync", launch + 20.0, corr + 2))
        ev.append(_dev("Memcpy DtoH (Device -> Pinned)", ts + 20.0, 1.5, corr + 2, "gpu_memcpy"))
        corr, t = corr + 10, t + 1000.0
    return ev


def _write(tmp_path, doc, name="t.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def test_replays_counts_busy_span_and_grouping():
    rep = breakdown(_trace())
    assert rep["eager"][UNATTRIBUTED]["kernels"] == 0
    assert rep["replays"] == 4
    assert rep["sequence"] == ["G1", "G2", "G1", "G2"]
    assert (rep["step"]["pattern"], rep["step"]["repeats"], rep["step"]["partial"]) == (["G1", "G2"], 2, 0)
    g1, g2 = rep["groups"]
    assert (g1["replays"], g1["kernels"], g2["replays"], g2["kernels"]) == (2, 4, 2, 1)
    busy_a = sum(d for _, d in GRAPH_A) + 0.5
    assert g1["busy_us"] == pytest.approx(busy_a)
    assert g1["busy_us_each"] == pytest.approx([busy_a, busy_a])
    # kernels at t, t+11, t+32 (dur 2), memset at t+35 (dur 0.5): span 35.5
    assert g1["span_us"] == pytest.approx(35.5)
    assert g2["busy_us"] == pytest.approx(8.0) and g2["span_us"] == pytest.approx(8.0)
    assert g1["by_category_us"] == pytest.approx({"inductor fused": 2.0, "routed experts": 20.0,
                                                  "dense GEMM": 10.0, "copy / cast / memset": 0.5})
    assert g2["by_category_us"] == pytest.approx({"attention": 8.0})
    assert [t["name"] for t in g1["top"]][:2] == ["_pair_gemv_kernel", GRAPH_A[0][0]]
    assert g1["top"][0]["calls"] == 1 and g1["top"][0]["us"] == pytest.approx(20.0)  # per replay
    # one repetition: first kernel of G1 (t) to the end of G2's kernel (starts at the memset's start + 5)
    assert rep["step"]["span_us"] == pytest.approx(35.0 + 5.0 + 8.0)
    assert rep["step"]["busy_us"] == pytest.approx(busy_a + 8.0)
    assert rep["step"]["by_category_us"] == pytest.approx({**g1["by_category_us"], "attention": 8.0})
    text = format_report(rep)
    assert "pattern" in text and "conv" not in text  # a category empty everywhere is left out, "other" is not
    assert "\nother " in text


def test_eager_prefill_kept_apart():
    rep = breakdown(_trace())
    pre, post = rep["eager"][EAGER_BEFORE], rep["eager"][EAGER_AFTER]
    assert pre["kernels"] == 4 and pre["busy_us"] == pytest.approx(41.0)
    assert pre["span_us"] == pytest.approx(161.0 - 100.0)
    assert pre["by_category_us"] == pytest.approx({"router": 4.0, "SSM / GDN": 30.0,
                                                   "copy / cast / memset": 1.0, OTHER: 6.0})
    assert post["kernels"] == 2 and post["busy_us"] == pytest.approx(3.0)
    assert post["by_category_us"] == pytest.approx({"copy / cast / memset": 3.0})
    replayed = sum(g["kernels"] * g["replays"] for g in rep["groups"])
    assert replayed + pre["kernels"] + post["kernels"] == 4 + 2 + 10  # every device event counted once


def test_uncorrelated_kernels_are_unattributed_not_guessed():
    rep = breakdown(_trace(correlated=False))
    assert rep["replays"] == 4 and len(rep["groups"]) == 1  # one signature: the empty one
    assert rep["groups"][0]["kernels"] == 0 and rep["groups"][0]["busy_us"] == 0
    lost = rep["eager"][UNATTRIBUTED]
    assert lost["kernels"] == 2 * 5
    assert lost["busy_us"] == pytest.approx(2 * (sum(d for _, d in GRAPH_A) + 0.5 + 8.0))
    assert rep["eager"][EAGER_BEFORE]["kernels"] == 4 and rep["eager"][EAGER_AFTER]["kernels"] == 2
    assert "trace lacks correlations" in format_report(rep)


def test_different_graphs_do_not_merge():
    ev = _trace()
    # the second step's graph A loses its inductor kernel: another signature
    ev = [e for e in ev if not (e["name"] == "triton_poi_fused_add_0" and e["ts"] > 1500)]
    rep = breakdown(ev)
    assert rep["sequence"] == ["G1", "G2", "G3", "G2"]
    assert [g["kernels"] for g in rep["groups"]] == [4, 1, 3]
    assert (rep["step"]["pattern"], rep["step"]["repeats"], rep["step"]["partial"]) == (rep["sequence"], 1, 0)


def test_a_partial_last_step_keeps_the_pattern():
    # without the second step's graph B launch, its kernel and its token copy (correlations 111, 112)
    ev = [e for e in _trace() if e.get("args", {}).get("correlation") not in (111, 112)]
    rep = breakdown(ev)
    assert rep["sequence"] == ["G1", "G2", "G1"]
    assert (rep["step"]["pattern"], rep["step"]["repeats"], rep["step"]["partial"]) == (["G1", "G2"], 1, 1)
    assert "partial repetition" in format_report(rep)


def test_no_graph_launch_is_all_prefill():
    ev = [e for e in _trace() if e.get("args", {}).get("correlation", 0) < 100]
    rep = breakdown(ev)
    assert rep["replays"] == 0 and rep["groups"] == [] and rep["sequence"] == []
    assert rep["eager"][EAGER_BEFORE]["kernels"] == 4 and rep["eager"][EAGER_AFTER]["kernels"] == 0
    assert "0 CUDA-graph replays" in format_report(rep)


def test_split_keeps_time_order_and_mutates_nothing():
    ev = _trace()
    before = json.dumps(ev)
    replays, pre, post, lost = split_replays(list(reversed(ev)))
    assert json.dumps(ev) == before
    assert [len(ks) for ks in replays] == [4, 1, 4, 1] and lost == []
    for ks in replays + [pre, post]:
        assert [k["ts"] for k in ks] == sorted(k["ts"] for k in ks)


@pytest.mark.parametrize("name,want", [
    ("_pair_gemv_kernel", "routed experts"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_"
     "17GroupProblemShapeIN4cute5tupleIJiiiEEEEE", "routed experts"),
    ("_combine_kernel", "routed experts"),
    ("_topk_route_kernel", "router"),
    ("at::native::radixSortKVInPlace<-2, -1, 64, 32, long, long, unsigned int>", "router"),
    ("_gdn_replay_verify_kernel", "SSM / GDN"),
    ("chunk_fwd_kernel_o", "SSM / GDN"),
    ("recompute_w_u_fwd_kernel", "SSM / GDN"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention"),
    ("void at::native::(anonymous namespace)::conv_depthwise2d_forward_kernel_generic<float, int>", "conv"),
    ("nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT", "dense GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "dense GEMM"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_tn_align1>", "dense GEMM"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "inductor fused"),
    # an inductor kernel named after the ops it fuses is not attention
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_add_arange_where_10", "inductor fused"),
    ("Memset (Device)", "copy / cast / memset"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIterator&)",
     "copy / cast / memset"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>",
     "ATen elementwise / reduce"),
    ("_pair_nvfp4_kernel", "routed experts"),
    ("_rewind_commit_kernel", "SSM / GDN"),
    ("_ssd_chunk_scan_kernel", "SSM / GDN"),
    ("void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float>", "ATen elementwise / reduce"),
    ("_quant_group_kernel", "activation quantize"),
    ("_nvfp4_mm_kernel", "dense GEMM"),
    ("_splitk_sum_kernel", "dense GEMM"),
    ("mystery_kernel", OTHER),
])
def test_categories_first_match_wins(name, want):
    assert categorize(name) == want


def test_category_rules_are_unique_and_other_is_last():
    names = [c for c, _ in CATEGORIES]
    assert len(set(names)) == len(names) and OTHER not in names
    assert breakdown(_trace())["categories"][-1][0] == OTHER


def test_cli_prints_and_writes_json(tmp_path, capsys):
    trace = _write(tmp_path, {"schemaVersion": 1, "traceEvents": _trace()})
    out = tmp_path / "b.json"
    assert main([str(trace), "--json", str(out), "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "G1" in text and "prefill" in text and "routed experts" in text
    doc = json.loads(out.read_text())
    assert doc["trace"] == str(trace) and [g["name"] for g in doc["groups"]] == ["G1", "G2"]
    assert all(len(g["top"]) <= 2 for g in doc["groups"])


@pytest.mark.parametrize("content,words", [
    (None, "cannot read"),
    ("{not json", "not valid JSON"),
    ('{"traceEvents": 3}', "not a Chrome trace"),
    ("[1, 2]", "not a Chrome trace"),
    (json.dumps({"traceEvents": [{"cat": "kernel", "name": "k", "dur": 1}]}), "lacks a string 'name' or"),
    (json.dumps({"traceEvents": [{"cat": "kernel", "name": "k", "ts": "0", "dur": 1}]}), "event 0 (cat"),
    (json.dumps({"traceEvents": [{"cat": "cuda_runtime", "ts": 0, "dur": 1}]}), "lacks a string 'name'"),
    (json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1}]}),
     "no device kernel events"),
])
def test_bad_input_is_a_user_error(tmp_path, capsys, content, words):
    p = tmp_path / "trace.json"
    if content is not None:
        p.write_text(content)
    with pytest.raises(UserError) as e:
        load_trace(p)
    assert words in e.value.problem and "export_chrome_trace" in e.value.fix
    assert main([str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "  fix: " in err


def test_an_unwritable_json_path_is_refused_before_the_report(tmp_path, capsys):
    """--json into a missing folder: error / fix and status 2, and no report printed above the error."""
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 2,
                                                  "args": {"correlation": 1}}]}))
    assert main([str(trace), "--json", str(tmp_path / "no" / "out.json")]) == 2
    captured = capsys.readouterr()
    assert "cannot write it" in captured.err and captured.out == ""

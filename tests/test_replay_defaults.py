"""The engine's replay-kernel defaults (kernels/replay_defaults.py, kernels/replay_defaults.json): the
committed table loads and is exactly what the sweep's writer gives from the sweep JSON its provenance names;
lookups pick the batch bucket and fall back to the documented default; the writer's rule on a small hand-made
sweep; and the launchers, called as the engine calls them (no `variant=`), run the table's configuration."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from benchmarks import sweep_replay  # noqa: E402
from benchmarks.replay_configs import GDN_CONFIGS, M2_CONFIGS  # noqa: E402
from kernels import replay_defaults  # noqa: E402
from kernels.gdn import replay as gdn_replay  # noqa: E402
from kernels.mamba2 import replay as m2_replay  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the launchers take CPU tensors only in the interpreter


def _write(path, rows) -> str:
    path.write_text(json.dumps({"schema": replay_defaults.SCHEMA, "provenance": {}, "rows": rows}))
    return str(path)


def _row(config, **kwargs):
    return {"config": config, "kwargs": kwargs, "evidence": {}}


def test_committed_table_is_the_writer_applied_to_its_source():
    table = replay_defaults.load()
    prov = table["provenance"]
    source = os.path.join(ROOT, prov["sweep_json"])
    assert os.path.exists(source), prov
    assert prov["date"] and prov["device"]
    with open(source) as f:
        res = json.load(f)
    again = sweep_replay.defaults_table(res, source=prov["sweep_json"], date=prov["date"])
    assert again == table
    assert table["rows"]
    for key, row in table["rows"].items():
        op = key.split("/")[0]
        gdn = op == "gdn"
        configs = GDN_CONFIGS if gdn else M2_CONFIGS
        variants = gdn_replay.VARIANTS if gdn else m2_replay.ALL_VARIANTS
        assert row["kwargs"] == configs[row["config"]] and row["kwargs"]["variant"] in variants, key


def test_lookup_buckets_and_fallback(tmp_path):
    shape = replay_defaults.mamba2_shape_class(4, 16, 32)
    path = _write(tmp_path / "t.json", {
        replay_defaults.key("mamba2_per_step", "bfloat16", shape, 8):
            _row("mma_c16", variant="mma", chunk_n=16),
        replay_defaults.key("mamba2_per_step", "bfloat16", shape, 64): _row("mma", variant="mma"),
        replay_defaults.key("mamba2_checkpointing", "bfloat16", shape, 8): _row("x", variant="nope"),
    })
    look = lambda op, dtype, batch, shape=shape: replay_defaults.lookup(
        op, dtype, shape, batch, fallback="fma", variants=m2_replay.VARIANTS, path=path)
    assert look("mamba2_per_step", torch.bfloat16, 1) == {"variant": "mma", "chunk_n": 16}
    assert look("mamba2_per_step", torch.bfloat16, 8) == {"variant": "mma", "chunk_n": 16}
    assert look("mamba2_per_step", torch.bfloat16, 9) == {"variant": "mma"}
    assert look("mamba2_per_step", torch.bfloat16, 1000) == {"variant": "mma"}  # above all: the largest
    assert look("mamba2_per_step", torch.float32, 8) == {"variant": "fma"}  # no row for the dtype
    # a float16 state without rows takes bfloat16's (ROW_SIBLING), buckets included; none: the fallback
    assert look("mamba2_per_step", torch.float16, 8) == {"variant": "mma", "chunk_n": 16}
    assert look("mamba2_per_step", torch.float16, 9) == {"variant": "mma"}
    assert look("mamba2_per_step", torch.float16, 8, shape="h4_p16_n64") == {"variant": "fma"}
    assert look("mamba2_per_step", torch.bfloat16, 8, shape="h4_p16_n64") == {"variant": "fma"}  # other shape
    assert look("mamba2_checkpointing", torch.bfloat16, 8) == {"variant": "fma"}  # a variant the module lacks
    assert replay_defaults.lookup("gdn", torch.float32, "hv1_v16_k16", 2, fallback="fma", variants=("fma",),
                                  path=str(tmp_path / "absent.json")) == {"variant": "fma"}
    # explicit arguments win; a given variant bypasses the table
    explicit = dict(variant=None, block_p=None, num_warps=2, chunk_n=None, num_stages=None, split=None)
    got = replay_defaults.resolve(explicit, "mamba2_per_step", torch.bfloat16, shape, 4, fallback="fma",
                                  variants=m2_replay.VARIANTS, path=path)
    assert got == {**explicit, "variant": "mma", "chunk_n": 16}
    mine = {**explicit, "variant": "fma"}
    assert replay_defaults.resolve(mine, "mamba2_per_step", torch.bfloat16, shape, 4, fallback="fma",
                                   variants=m2_replay.VARIANTS, path=path) == mine
    with pytest.raises(ValueError, match="operation"):
        look("mamba2", torch.bfloat16, 1)
    # float16 rows of its own win over the sibling's; float32 has no sibling
    own = _write(tmp_path / "own.json", {
        replay_defaults.key("gdn", "bfloat16", "hv1_v16_k16", 8): _row("mma", variant="mma"),
        replay_defaults.key("gdn", "float16", "hv1_v16_k16", 8): _row("fma_bv8", variant="fma", block_v=8)})
    look_gdn = lambda dtype: replay_defaults.lookup("gdn", dtype, "hv1_v16_k16", 2, fallback="fma",
                                                    variants=("fma", "mma"), path=own)
    assert look_gdn(torch.float16) == {"variant": "fma", "block_v": 8}
    assert look_gdn(torch.bfloat16) == {"variant": "mma"}
    assert look_gdn(torch.float32) == {"variant": "fma"}
    # a dtype without a sibling never reads a row keyed by the sibling's absence ("None")
    odd = _write(tmp_path / "odd.json", {"gdn/None/hv1_v16_k16/b8": _row("mma", variant="mma")})
    assert replay_defaults.lookup("gdn", torch.float64, "hv1_v16_k16", 2, fallback="fma",
                                  variants=("fma", "mma"), path=odd) == {"variant": "fma"}


def test_broken_table_is_refused(tmp_path):
    for i, doc in enumerate(({"rows": {}}, {"schema": replay_defaults.SCHEMA, "rows": {"a/b/c/b1": {}}})):
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match="rewrite"):
            replay_defaults.load(str(path))


def _grid(op, dt, shape, batch, config, times):
    return [{"op": op, "state_dtype": dt, "shape": shape, "T": T, "batch": batch, "config": config, "us": us}
            for T, us in zip((2, 4, 8), times)]


def test_writer_rule_on_a_hand_made_sweep():
    ok = lambda us: {"us": us, "ok": True}
    res = {
        "date": "2026-01-02T03:04:05Z", "device": "test", "torch": "t", "triton": "tr",
        "shapes": {"mamba2": {"ws1": [4, 16, 32, 1], "ws4": [1, 16, 32, 1]}, "gdn": {"ws1": [1, 2, 16, 8]}},
        "headline": {"batch": 64, "T": 4, "shape": "ws1"},
        "headline_rows": {
            "m2_write/bfloat16": {"fma": ok(10.0), "mma": ok(9.0), "mma_c16": {"us": 1.0, "ok": False}},
            "m2_ckpt/bfloat16": {"fma": ok(10.0), "mma": ok(8.0), "mma_c16": ok(7.0)},
            "m2_flush/bfloat16": {"fma": ok(20.0), "mma": ok(9.0), "mma_c16": ok(30.0)},
            "gdn/float32": {"fma": ok(5.0), "mma": {"error": "boom"}},
        },
        "grid": (
            # per step, batch 8: mma_c16 is fastest but failed the check; the median over T ignores fma's
            # outlier
            _grid("m2_write", "bfloat16", "ws1", 8, "fma", (10.0, 11.0, 500.0))
            + _grid("m2_write", "bfloat16", "ws1", 8, "mma", (12.0, 12.0, 12.0))
            + _grid("m2_write", "bfloat16", "ws1", 8, "mma_c16", (1.0, 1.0, 1.0))
            # checkpointing, batch 64: summed over no-flush and flush (mma_c16 wins ckpt, loses the sum)
            + _grid("m2_ckpt", "bfloat16", "ws1", 64, "fma", (10.0, 10.0, 10.0))
            + _grid("m2_ckpt", "bfloat16", "ws1", 64, "mma_c16", (5.0, 5.0, 5.0))
            + _grid("m2_flush", "bfloat16", "ws1", 64, "fma", (10.0, 10.0, 10.0))
            + _grid("m2_flush", "bfloat16", "ws1", 64, "mma_c16", (30.0, 30.0, 30.0))
            # checkpointing, ws4 batch 1: mma timed for one operator only -> not a candidate
            + _grid("m2_ckpt", "bfloat16", "ws4", 1, "fma", (10.0, 10.0, 10.0))
            + _grid("m2_ckpt", "bfloat16", "ws4", 1, "mma", (1.0, 1.0, 1.0))
            + _grid("m2_flush", "bfloat16", "ws4", 1, "fma", (10.0, 10.0, 10.0))
            + [{"op": "gdn", "state_dtype": "float32", "shape": "ws1", "T": 2, "batch": 1, "error": "oom"}]
        ),
    }
    table = sweep_replay.defaults_table(res, source="x.json")
    assert table["schema"] == replay_defaults.SCHEMA
    assert table["provenance"]["sweep_json"] == "x.json" and table["provenance"]["date"] == res["date"]
    rows = {k: v["config"] for k, v in table["rows"].items()}
    assert rows == {
        "mamba2_per_step/bfloat16/h4_p16_n32/b8": "fma",  # medians 11 vs 12
        "mamba2_per_step/bfloat16/h4_p16_n32/b64": "mma",  # the headline rows alone: 9 < 10 (mma_c16 not ok)
        "mamba2_checkpointing/bfloat16/h4_p16_n32/b64": "fma",  # 10 + 10 < 5 + 30
        "mamba2_checkpointing/bfloat16/h1_p16_n32/b1": "fma",
        "gdn/float32/hv2_v8_k16/b64": "fma",  # headline only; mma errored
    }
    assert table["rows"]["mamba2_checkpointing/bfloat16/h4_p16_n32/b64"]["evidence"]["cost_us"] == {
        "fma": 20.0, "mma_c16": 35.0}
    assert table["rows"]["mamba2_per_step/bfloat16/h4_p16_n32/b64"]["kwargs"] == M2_CONFIGS["mma"]


def test_writer_headline_falls_back_when_the_grid_timed_only_some_operators():
    """kperf_4's sweep ran out of time in the flush grid (m2_flush timed at T = 2 only at most batches): a
    point is costed over the T at which every operator was timed, and the headline point, where those lack
    the headline T, by the headline rows (the bf16 checkpointing row was lost before, then its one b64 row
    served batch 1 and 8, where the grid had fma ahead)."""
    ok = lambda us: {"us": us, "ok": True}
    res = {
        "shapes": {"mamba2": {"ws1": [4, 16, 32, 1]}, "gdn": {}},
        "headline": {"batch": 64, "T": 4, "shape": "ws1"},
        "headline_rows": {"m2_ckpt/bfloat16": {"fma": ok(10.0), "mma": ok(4.0)},
                          "m2_flush/bfloat16": {"fma": ok(10.0), "mma": ok(9.0)}},
        "grid": (_grid("m2_ckpt", "bfloat16", "ws1", 64, "fma", (1.0, 1.0, 1.0))
                 + _grid("m2_ckpt", "bfloat16", "ws1", 64, "mma", (2.0, 2.0, 2.0))
                 # batch 8: no flush rows and not the headline -> no row
                 + _grid("m2_ckpt", "bfloat16", "ws1", 8, "fma", (1.0, 1.0, 1.0))
                 # batch 1: flush timed at T = 2 only (kperf_4's cut): costed over T = 2, where both were
                 + _grid("m2_ckpt", "bfloat16", "ws1", 1, "fma", (5.0, 1.0, 1.0))
                 + _grid("m2_ckpt", "bfloat16", "ws1", 1, "mma", (1.0, 9.0, 9.0))
                 + _grid("m2_flush", "bfloat16", "ws1", 1, "fma", (5.0,))
                 + _grid("m2_flush", "bfloat16", "ws1", 1, "mma", (1.0,))
                 # the headline point with both operators at T = 2 only: not the headline T -> headline rows
                 + _grid("m2_flush", "bfloat16", "ws1", 64, "mma", (0.5,))
                 + _grid("m2_flush", "bfloat16", "ws1", 64, "fma", (0.5,))),
    }
    rows = sweep_replay.defaults_table(res)["rows"]
    assert list(rows) == ["mamba2_checkpointing/bfloat16/h4_p16_n32/b1",
                          "mamba2_checkpointing/bfloat16/h4_p16_n32/b64"]
    b1 = rows["mamba2_checkpointing/bfloat16/h4_p16_n32/b1"]
    assert b1["config"] == "mma" and b1["evidence"]["T"] == [2] and b1["evidence"]["cost_us"] == {
        "fma": 10.0, "mma": 2.0}
    row = rows["mamba2_checkpointing/bfloat16/h4_p16_n32/b64"]
    assert row["config"] == "mma" and row["evidence"]["cost_us"] == {"fma": 20.0, "mma": 13.0}
    assert row["evidence"]["T"] == [4]


def test_writer_point_whose_operators_share_no_timed_t_gets_no_row():
    """A grid point where the launch's two operators were timed at disjoint T (m2_ckpt at T = 2, m2_flush at
    T = 4 and 8) has no T to cost it over: no row (the launcher falls back), while a point sharing T = 2 gets
    one; the headline point with the same gap takes its headline rows."""
    ok = lambda us: {"us": us, "ok": True}
    def g(op, b, cfg, times):
        return [r for r in _grid(op, "bfloat16", "ws1", b, cfg, times) if r["us"] is not None]

    grid = []
    for b in (1, 64):  # disjoint T at batch 1 and at the headline batch 64
        grid += g("m2_ckpt", b, "fma", (1.0, None, None)) + g("m2_flush", b, "fma", (None, 1.0, 1.0))
    grid += g("m2_ckpt", 8, "fma", (1.0, None, None)) + g("m2_flush", 8, "fma", (2.0, 1.0, 1.0))
    res = {"shapes": {"mamba2": {"ws1": [4, 16, 32, 1]}, "gdn": {}},
           "headline": {"batch": 64, "T": 4, "shape": "ws1"},
           "headline_rows": {"m2_ckpt/bfloat16": {"fma": ok(3.0)}, "m2_flush/bfloat16": {"fma": ok(4.0)}},
           "grid": grid}
    rows = sweep_replay.defaults_table(res)["rows"]
    key = "mamba2_checkpointing/bfloat16/h4_p16_n32/b"
    assert sorted(rows) == [key + "64", key + "8"]
    assert rows[key + "8"]["evidence"]["T"] == [2] and rows[key + "8"]["evidence"]["cost_us"] == {"fma": 3.0}
    b64 = rows[key + "64"]["evidence"]
    assert b64["T"] == [4] and b64["cost_us"] == {"fma": 7.0}


def test_from_json_writes_the_table(tmp_path):
    src = tmp_path / "sweep.json"
    src.write_text(json.dumps({"shapes": {"mamba2": {"ws1": [4, 16, 32, 1]}, "gdn": {}},
                               "headline": {"batch": 2, "T": 2, "shape": "ws1"},
                               "headline_rows": {"m2_write/float32": {"fma": {"us": 1.0, "ok": True}}},
                               "grid": []}))
    out = tmp_path / "table.json"
    assert sweep_replay.main(["--from-json", str(src), "--source-date", "2026-12-01",
                              "--write-defaults", str(out)]) == 0
    table = json.loads(out.read_text())
    assert table["provenance"]["date"] == "2026-12-01"
    assert list(table["rows"]) == ["mamba2_per_step/float32/h4_p16_n32/b2"]
    assert replay_defaults.load(str(out)) == table


class _Spy:
    """Stands in for a @triton.jit kernel: records the constexpr keywords of each launch, runs nothing."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append((self.name, kw))


def _mamba2_inputs(Bsz=2, T=2, H=2, P=16, N=32, G=1, state_dtype=torch.float32, checkpointing=False):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    A = -torch.exp(torch.rand(H, generator=g))
    L = 16 if checkpointing else T
    hist = m2_replay.ReplayHistory.allocate(Bsz, L, H, P, G, N, dtype=torch.float32, device="cpu",
                                            checkpointing=checkpointing)
    hist.x.copy_(r(*hist.x.shape))
    hist.B.copy_(r(*hist.B.shape) / N**0.5)
    hist.dt.copy_(torch.rand(*hist.dt.shape, generator=g) * 0.9 + 0.1)
    hist.dA_cumsum.copy_(torch.cumsum(A[:, None] * hist.dt, dim=-1))
    state = r(Bsz, H, P, N).to(state_dtype)
    args = (r(Bsz, T, H, P), r(Bsz, T, H) * 0.5 - 1, A, r(Bsz, T, G, N) / N**0.5, r(Bsz, T, G, N) / N**0.5,
            r(H), torch.rand(H, generator=g) - 0.5, torch.arange(Bsz, dtype=torch.int32))
    meta = (torch.full((Bsz,), 1, dtype=torch.int32), torch.zeros(Bsz, dtype=torch.int32))
    hist = m2_replay.ReplayHistory(*(t.to(DEV) for t in (hist.x, hist.B, hist.dt, hist.dA_cumsum)))
    return state.to(DEV), tuple(t.to(DEV) for t in args), hist, tuple(t.to(DEV) for t in meta)


def test_mamba2_launcher_without_variant_runs_the_tables_config(tmp_path, monkeypatch):
    shape = replay_defaults.mamba2_shape_class(2, 16, 32)
    monkeypatch.setattr(replay_defaults, "TABLE_PATH", _write(tmp_path / "m2.json", {
        replay_defaults.key("mamba2_per_step", "float32", shape, 8):
            _row("mma_st3", **M2_CONFIGS["mma_st3"]),
        replay_defaults.key("mamba2_checkpointing", "float32", shape, 8):
            _row("mma_c16", **M2_CONFIGS["mma_c16"]),
    }))
    log = []
    monkeypatch.setattr(m2_replay, "_replay_verify_kernel", _Spy(log, "fma"))
    monkeypatch.setattr(m2_replay, "_replay_verify_mma_kernel", _Spy(log, "mma"))
    for ckpt, dtype, batch in ((False, torch.float32, 2), (True, torch.float32, 2),
                               (False, torch.bfloat16, 2), (False, torch.float32, 9)):
        state, args, hist, meta = _mamba2_inputs(Bsz=batch, state_dtype=dtype, checkpointing=ckpt)
        m2_replay.replay_verify(state, *args, hist, *meta)  # as the engine calls it: no tuning arguments
    state, args, hist, meta = _mamba2_inputs()
    m2_replay.replay_verify(state, *args, hist, *meta, variant="fma")  # explicit: the table is not read
    # per step, checkpointing, bf16 (no row: fallback), batch 9 (above every bucket: the largest), explicit
    assert [n for n, _ in log] == ["mma", "mma", "fma", "mma", "fma"]
    stages = m2_replay.VARIANTS["mma"]["checkpointing"][3]
    assert log[0][1]["NUM_STAGES"] == 3 and log[0][1]["CHUNK_N"] == 32
    assert log[1][1]["CHUNK_N"] == 16 and log[1][1]["NUM_STAGES"] == stages and log[1][1]["CHECKPOINT"]


def test_table_choice_computes_what_the_reference_does(tmp_path, monkeypatch):
    """A table row picking "mma" (fp32 state: the interpreter's fp32 dots are exact enough) gives the
    reference's outputs and state through the launcher's default path."""
    shape = replay_defaults.mamba2_shape_class(2, 16, 32)
    monkeypatch.setattr(replay_defaults, "TABLE_PATH", _write(tmp_path / "m2run.json", {
        replay_defaults.key("mamba2_per_step", "float32", shape, 8):
            _row("mma_c16", **M2_CONFIGS["mma_c16"])}))
    seen = []
    real = replay_defaults.resolve
    monkeypatch.setattr(replay_defaults, "resolve", lambda *a, **k: seen.append(r := real(*a, **k)) or r)
    outs = []
    for fn in (m2_replay.replay_verify, m2_replay.replay_verify_ref):
        state, args, hist, meta = _mamba2_inputs()
        outs.append((fn(state, *args, hist, *meta), state))
    assert seen[0]["variant"] == "mma" and seen[0]["chunk_n"] == 16
    tol = 1e-4 if DEV == "cpu" else 1e-3  # GPU: split-bf16 products, the GPU tests' fp32 tolerance
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=tol, rtol=tol)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=tol, rtol=tol)


def test_gdn_launcher_without_variant_runs_the_tables_config(tmp_path, monkeypatch):
    B, T, H, HV, K, V = 2, 2, 1, 2, 16, 16
    monkeypatch.setattr(replay_defaults, "TABLE_PATH", _write(tmp_path / "gdn.json", {
        replay_defaults.key("gdn", "float32", replay_defaults.gdn_shape_class(HV, V, K), 64):
            _row("mma_bv32w2", **GDN_CONFIGS["mma_bv32w2"])}))
    log = []
    monkeypatch.setattr(gdn_replay, "_gdn_replay_verify_kernel", _Spy(log, "fma"))
    monkeypatch.setattr(gdn_replay, "_gdn_replay_verify_mma_kernel", _Spy(log, "mma"))
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        hist = gdn_replay.ReplayHistory.allocate(B, T, H, HV, K, V, device=DEV)
        meta = (torch.arange(B, dtype=torch.int32), torch.ones(B, dtype=torch.int32),
                torch.zeros(B, dtype=torch.int32))
        ins = (r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), -torch.rand(B, T, HV, generator=g),
               torch.rand(B, T, HV, generator=g), r(B, HV, V, K).to(dtype))
        gdn_replay.replay_verify(*(t.to(DEV) for t in ins), hist, *(t.to(DEV) for t in meta))
    assert [n for n, _ in log] == ["mma", "fma"]
    assert log[0][1]["CHUNK_K"] == 16 and log[0][1]["num_warps"] == 2 and log[0][1]["BV"] == 16  # V = 16 caps


def test_the_backend_of_each_operation_is_the_faster_in_the_same_sweep():
    """The committed table's backends come from its sweep: each Mamba2 replay operation (checkpointing: the
    no-flush + flush operators; per-step: the write operator) runs FlashInfer's checkpointing_ssu where its
    headline times sum below our best configuration's, at float32 and bfloat16 (float16 takes bfloat16's);
    GDN, which FlashInfer has no kernel for, and shapes the sweep did not time have no row (ours run). The
    sweep's headline rows name the engine's kernel beside each operator's configurations."""
    table = replay_defaults.load()
    shape = replay_defaults.mamba2_shape_class(128, 64, 128)
    ops = {"mamba2_checkpointing": ("m2_ckpt", "m2_flush"), "mamba2_per_step": ("m2_write",)}
    chosen = {}
    for operation in ops:
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16),
                            ("bfloat16", torch.float16)):
            row = table["backends"].get(f"{operation}/{name}/{shape}")
            want = None
            if row is not None:
                ev = row["evidence"]
                want = "flashinfer" if ev["flashinfer_us"] < ev["triton_us"] else "triton"
                assert row["backend"] == want
            assert replay_defaults.default_backend(operation, dtype, shape) == want
            chosen[operation, name] = want or "triton"
    assert not any(key.startswith("gdn/") for key in table["backends"])
    assert replay_defaults.default_backend("mamba2_checkpointing", torch.float32, "h4_p16_n32") is None
    with open(os.path.join(ROOT, table["provenance"]["sweep_json"])) as f:
        res = json.load(f)
    sweep_replay.mark_headline_defaults(res, table)
    for (operation, dt), backend in chosen.items():
        for op in ops[operation]:
            rows = res["headline_rows"][f"{op}/{dt}"]
            if backend == "flashinfer":
                assert rows["default"] == {"backend": "flashinfer", "config": "checkpointing_ssu",
                                           "us": rows["flashinfer"]["us"]}
            else:
                assert rows["default"]["backend"] == "triton"
                assert rows["default"]["us"] == rows[rows["default"]["config"]]["us"]

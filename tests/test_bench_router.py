"""benchmarks/bench_router.py on the CPU: its arguments, its release router shapes and the message a machine
without CUDA gets (the timings themselves run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_router as bench


@pytest.mark.parametrize("argv, says", [([], "--out"), (["--out", "o.json", "--tokens", "0"], "1 to"),
                                        (["--out", "o.json", "--tokens", "9"], "ROUTER_FUSED_MAX_TOKENS"),
                                        (["--out", "o.json", "--models", "llama"], "invalid choice")])
def test_refuses_bad_arguments(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_router_shapes_are_the_releases():
    """MODELS comes from registry.releases: Super V3 routes top-22 of 512 over D = 4096 by sigmoid with
    scaling 5, Qwen3-Next top-10 of 512 over D = 2048 by softmax (the releases' config.json)."""
    assert bench.MODELS["super_v3"] == (4096, 512, 22, False, 5.0)
    assert bench.MODELS["qwen3_next"] == (2048, 512, 10, True, 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_needs_cuda(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "o.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "o.json").exists()


def test_summary_takes_the_fastest_row_that_matched_on_every_model():
    """summary: per token count the row with the least time summed over the models, among rows timed and
    matching on all of them (a faster row that routed differently on one model, or failed on one, is
    skipped); its speedup is against the three launches' sum."""
    def r(model, n, name, us, match=True):
        out = {"model": model, "tokens": n, "name": name, "us": us}
        if ":" in name:
            out["match"] = match
        return out

    rows = [r("a", 1, "three_launches", 10.0), r("b", 1, "three_launches", 8.0),
            r("a", 1, "linear", 1.0), r("b", 1, "linear", 1.0),
            r("a", 1, "fused:x", 4.0), r("b", 1, "fused:x", 5.0),
            r("a", 1, "fused:y", 1.0), r("b", 1, "fused:y", 2.0, match=False),
            r("a", 1, "logits:z", 2.0), {"model": "b", "tokens": 1, "name": "logits:z", "error": "E"},
            r("a", 2, "three_launches", 3.0), r("b", 2, "three_launches", 3.0),
            r("a", 2, "fused:x", 4.0), r("b", 2, "fused:x", 5.0)]
    s = bench.summary(rows)
    assert s[1]["best"] == "fused:x" and s[1]["us"] == 9.0 and s[1]["speedup"] == 2.0
    assert s[1]["per_model"] == {"a": [4.0, 10.0], "b": [5.0, 8.0]}
    assert s[2]["best"] == "three_launches" and s[2]["speedup"] == 1.0

"""Loading, validation and row lookup of registry/baselines/*.yaml (registry.baselines)."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from registry.baselines import (
    BaselineError,
    Protocol,
    find_acceptance_reference,
    find_accuracy_reference,
    load_acceptance_baselines,
    load_accuracy_baselines,
)

PROTOCOL = {"num_fewshot": 5, "max_gen_toks": 256}
PROTOCOL_YAML = "{num_fewshot: 5, max_gen_toks: 256}"


def _acceptance_file(row: str) -> str:
    return f"schema_version: 1\nprotocol: {PROTOCOL_YAML}\nmodels:\n  e:\n    rows:\n      - {row}\n"


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_shipped_gsm8k_file_has_the_published_numbers():
    models = load_accuracy_baselines()
    super_v3 = {(r.quant, r.kv_cache_quant, r.spec_dec): r.accuracy for r in models["super_v3"]}
    assert super_v3[("none", "none", "none")] == 83.74
    assert super_v3[("fp8", "fp8", "none")] == 82.25
    assert super_v3[("nvfp4", "fp8", "none")] == 80.85
    qwen = {(r.quant, r.spec_dec): r.accuracy for r in models["qwen3_next"]}
    assert qwen[("none", "none")] == 92.72
    assert qwen[("nvfp4", "none")] == 90.86
    # Greedy MTP emits the non-speculative tokens: every mtp row equals its spec_dec=none twin.
    for rows in models.values():
        by_key = {r.match_key: r for r in rows}
        for (dtype, quant, kv, spec), row in by_key.items():
            if spec == "mtp" and (dtype, quant, kv, "none") in by_key:
                assert row.accuracy == by_key[(dtype, quant, kv, "none")].accuracy
    # Tiny entries: float32 rows measured by the project (docs/baselines/; the fp8 rows on the first questions
    # of the test split), bfloat16 rows still placeholders.
    for key in ("tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp"):
        for r in models[key]:
            if r.dtype == "float32":
                assert r.measured and 0 <= r.accuracy <= 100 and r.sigma is not None
                assert r.num_samples == 1319 if r.quant == "none" else 100 <= r.num_samples <= 1319
            else:
                assert not r.measured and r.accuracy is None
    tiny = find_accuracy_reference("tiny_nemotron_h_mtp", "float32", "none", "none", "mtp")
    assert (tiny.accuracy, tiny.sigma) == (1.895, 13.6)


def test_shipped_acceptance_file():
    entries = load_acceptance_baselines()
    ref = find_acceptance_reference("super_v3", "NVFP4", 3)
    assert ref.acceptance_rate_floor == 0.45
    assert ref.acceptance_length_reference == 3.47
    assert ref.acceptance_length_floor == pytest.approx(3.47 * 0.95)
    for key in ("tiny_nemotron_h_mtp", "tiny_qwen3_next_mtp"):
        assert sorted(row.quant for row in entries[key]) == ["fp8", "none"]
        for row in entries[key]:
            assert row.measured and row.draft_len == 3 and 0 < row.acceptance_rate_floor < 1
    tiny = find_acceptance_reference("tiny_nemotron_h_mtp", "none", 3)
    assert tiny.acceptance_rate_floor == 0.42 and tiny.acceptance_length_floor == pytest.approx(2.587 * 0.8)


def test_lookup_normalises_aliases_and_case():
    ref = find_accuracy_reference("super_v3", "BF16", "nvfp4", "FP8", "MTP")
    assert (ref.accuracy, ref.num_samples, ref.spec_dec, ref.metric) == (80.85, 1319, "mtp", "mean")
    assert find_accuracy_reference("super_v3", "bfloat16", None, None, None).accuracy == 83.74


def test_unmatched_row_lists_rows_and_fix():
    with pytest.raises(BaselineError) as err:
        find_accuracy_reference("super_v3", "bfloat16", "nvfp4", "none", "mtp")
    msg = str(err.value)
    assert "kv_cache_quant=none" in msg and "spec_dec=mtp" in msg
    assert "quant=nvfp4 kv_cache_quant=fp8 spec_dec=mtp ssm_state_dtype=float32: 80.85" in msg  # the rows
    assert "verdict.require_reference=false" in err.value.fix


def test_unmeasured_fp8_qwen3_next_has_no_row():
    """No FP8 Qwen3-Next number exists (published or ours): its runs are refused up front, not judged."""
    with pytest.raises(BaselineError) as err:
        find_accuracy_reference("qwen3_next", "bfloat16", "fp8", "fp8", "mtp")
    assert "verdict.require_reference=false" in err.value.fix
    with pytest.raises(BaselineError, match="quant=fp8"):
        find_acceptance_reference("qwen3_next", "fp8", 3)


def test_unknown_model_and_entry():
    with pytest.raises(BaselineError, match="known keys: .*super_v3"):
        find_accuracy_reference("no_such_model", "bfloat16", "none", "none", "none")
    with pytest.raises(BaselineError, match="known keys"):
        find_acceptance_reference("no_such_entry", "none", 3)
    with pytest.raises(BaselineError, match="draft_len=5"):
        find_acceptance_reference("super_v3", "nvfp4", 5)


def test_bad_value_names_allowed_values():
    with pytest.raises(BaselineError, match=r"quant 'int4' is not one of \['none', 'fp8', 'nvfp4'\]"):
        find_accuracy_reference("super_v3", "bfloat16", "int4", "none", "none")


BASE_ROW = {
    "dtype": "bfloat16",
    "quant": "none",
    "kv_cache_quant": "none",
    "spec_dec": "none",
    "accuracy": 50.0,
    "num_samples": 100,
}


def _gsm8k_file(tmp_path, *rows, version=1):
    data = {"schema_version": version, "protocol": PROTOCOL, "models": {"m": {"rows": list(rows)}}}
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _drop(row, key):
    return {k: v for k, v in row.items() if k != key}


@pytest.mark.parametrize(
    ("row", "pattern"),
    [
        (BASE_ROW | {"accuracy": 150}, r"rows\[0\]\.accuracy = 150 is outside \[0.0, 100.0\]"),
        (BASE_ROW | {"num_samples": 0}, r"num_samples must be a positive integer"),
        (_drop(BASE_ROW, "num_samples"), r"missing key\(s\) \['num_samples'\]"),
        (BASE_ROW | {"dtype": "int8"}, r"models\.m\.rows\[0\]\.dtype 'int8' is not one of"),
        (BASE_ROW | {"spec_dec": "eagle"}, r"spec_dec 'eagle'"),
        (_drop(BASE_ROW, "accuracy") | {"acc": 50}, r"unknown key\(s\) \['acc'\]"),
        (_drop(BASE_ROW, "num_samples") | {"measured": False}, r"measured: false but carries"),
        (BASE_ROW | {"alpha": 1.5}, r"alpha = 1.5 is outside \(0.0, 1.0\)"),
        (BASE_ROW | {"accuracy": "high"}, r"accuracy must be a number"),
    ],
)
def test_gsm8k_validation_errors(tmp_path, row, pattern):
    path = _gsm8k_file(tmp_path, row)
    with pytest.raises(BaselineError, match=pattern) as err:
        load_accuracy_baselines(path)
    assert str(path) in err.value.problem


def test_gsm8k_duplicate_rows_and_schema_version(tmp_path):
    with pytest.raises(BaselineError, match=r"rows\[1\] repeats .* rows\[0\]"):
        load_accuracy_baselines(_gsm8k_file(tmp_path, BASE_ROW, BASE_ROW | {"dtype": "bf16", "accuracy": 1}))
    with pytest.raises(BaselineError, match="schema_version is 0"):
        load_accuracy_baselines(_gsm8k_file(tmp_path, BASE_ROW, version=0))
    with pytest.raises(BaselineError, match="does not exist"):
        load_accuracy_baselines(tmp_path / "missing.yaml")


@pytest.mark.parametrize("edit, pattern", [
    (lambda d: d.pop("protocol"), r"g\.yaml: missing key 'protocol'"),
    (lambda d: d["protocol"].pop("max_gen_toks"), r"protocol: missing key\(s\) \['max_gen_toks'\]"),
    (lambda d: d["protocol"].update(num_fewshot=-1), r"protocol\.num_fewshot must be an integer >= 0, got -"),
    (lambda d: d["protocol"].update(max_gen_toks="256"), r"protocol\.max_gen_toks must be an integer >= 1"),
    (lambda d: d["protocol"].update(shots=5), r"protocol: unknown key\(s\) \['shots'\]"),
    (lambda d: d["models"]["m"].update(protocol={"num_fewshot": 8}), r"models\.m\.protocol: missing key"),
])
def test_a_baselines_file_states_its_protocol(tmp_path, edit, pattern):
    """Every baselines file says how its references were measured (few-shot count, generated-token limit),
    checked like the rows; a model block may state its own, which its rows then carry."""
    data = {"schema_version": 1, "protocol": dict(PROTOCOL), "models": {"m": {"rows": [BASE_ROW]}}}
    edit(data)
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(BaselineError, match=pattern):
        load_accuracy_baselines(path)
    data = {"schema_version": 1, "protocol": dict(PROTOCOL),
            "models": {"m": {"rows": [dict(BASE_ROW)]},
                       "n": {"protocol": {"num_fewshot": 8, "max_gen_toks": 512}, "rows": [dict(BASE_ROW)]}}}
    path.write_text(yaml.safe_dump(data))
    models = load_accuracy_baselines(path)
    assert models["m"][0].protocol == Protocol(5, 256) and models["n"][0].protocol == Protocol(8, 512)
    text = _acceptance_file("{quant: none, draft_len: 3, acceptance_rate_floor: 0.5}")
    block_protocol = "  e:\n    protocol: {num_fewshot: 0, max_gen_toks: 64}\n"
    acc = _write(tmp_path, "a.yaml", text.replace("  e:\n", block_protocol))
    assert load_acceptance_baselines(acc)["e"][0].protocol == Protocol(0, 64)


def test_the_shipped_files_state_the_tasks_protocols():
    """gsm8k.yaml and acceptance.yaml: lm-eval's 5-shot gsm8k with 256 tokens (TensorRT-LLM's references,
    the project's tiny rows); gsm8k_cot.yaml: the task's 8 exemplars -- the defaults of configs/eval/."""
    from registry.baselines import BASELINES_DIR
    from registry.schema import REPO_ROOT
    from registry.yamlfile import load
    for name, eval_config in (("gsm8k", "gsm8k"), ("acceptance", "gsm8k"), ("gsm8k_cot", "gsm8k_cot")):
        stated = load((BASELINES_DIR / f"{name}.yaml").read_text(), name)["protocol"]
        config = load((REPO_ROOT / "configs" / "eval" / f"{eval_config}.yaml").read_text(), name)
        assert stated == {k: config[k] for k in ("num_fewshot", "max_gen_toks")}, name


def test_gsm8k_row_overrides_are_read(tmp_path):
    path = _gsm8k_file(tmp_path, BASE_ROW | {"sigma": 40, "beta": 0.1})
    ref = find_accuracy_reference("m", "bf16", "none", "none", "none", path=path)
    assert (ref.sigma, ref.alpha, ref.beta) == (40.0, None, 0.1)


@pytest.mark.parametrize(
    ("row", "pattern"),
    [
        (
            "{quant: none, draft_len: 3, acceptance_rate_floor: 1.2}",
            r"acceptance_rate_floor = 1.2 is outside",
        ),
        ("{quant: none, draft_len: 0, acceptance_rate_floor: 0.5}", r"draft_len must be an integer >= 1"),
        ("{quant: none, draft_len: 3}", r"neither acceptance_rate_floor nor acceptance_length"),
        (
            "{quant: none, draft_len: 3, acceptance_length: {reference: 5.0, floor: 4}}",
            r"reference = 5.0 is outside \[1.0, 4.0\]",
        ),
        (
            "{quant: none, draft_len: 3, acceptance_length: {reference: 3.0}}",
            r"exactly one of floor / rel_tol",
        ),
        (
            "{quant: none, draft_len: 3, acceptance_length: {reference: 3, floor: 2, rel_tolerance: 0.1}}",
            r"exactly one of floor / rel_tol",
        ),
        ("{quant: none, draft_len: 3, measured: false, acceptance_rate_floor: 0.4}", r"measured: false but"),
    ],
)
def test_acceptance_validation_errors(tmp_path, row, pattern):
    path = _write(tmp_path, "a.yaml", _acceptance_file(row))
    with pytest.raises(BaselineError, match=pattern):
        load_acceptance_baselines(path)


def test_acceptance_absolute_floor(tmp_path):
    row = "{quant: fp8, draft_len: 2, acceptance_length: {reference: 2.5, floor: 2.2}}"
    path = _write(tmp_path, "a.yaml", _acceptance_file(row))
    ref = find_acceptance_reference("e", "FP8", 2, path=path)
    assert (ref.acceptance_rate_floor, ref.acceptance_length_floor) == (None, 2.2)


def test_acceptance_rows_are_described_with_readable_numbers():
    """The rows listed when no acceptance row matches (draft_len=99) read 2.0696, not 2.0696000000000003 (the
    floor is computed from the reference)."""
    import re

    from registry.baselines import load_acceptance_baselines

    lines = [row.describe() for rows in load_acceptance_baselines().values() for row in rows]
    assert any("floor 2.0696" in line for line in lines), lines
    for line in lines:
        assert not re.search(r"\d\.\d{5,}", line), line

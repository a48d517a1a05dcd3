"""Tests of runners/tools/train.py: data format against lm-eval, packing, MTP target alignment, loss decrease,
determinism, and the written checkpoint (names, dtypes, reload in our engine and in transformers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn

from runners.engine.loader import load_model
from runners.tools.tiny import write_random_checkpoint
from runners.tools.train import (
    LOG_FILE,
    RECIPE_FILE,
    PackedGSM8K,
    TrainConfig,
    compute_losses,
    document_tokens,
    format_example,
    format_prompt,
    lr_at,
    read_gsm8k,
    train,
    verify_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHIPPED_NH = REPO_ROOT / "registry" / "checkpoints" / "tiny_nemotron_h_mtp"
# A small NemotronH with every block kind of the shipped one (mamba2, attention, moe, mlp) and its "*E" MTP.
SMALL_NH = dict(
    hidden_size=48,
    hybrid_override_pattern="M*E-",
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    mamba_num_heads=4,
    mamba_head_dim=12,
    ssm_state_size=8,
    n_groups=2,
    intermediate_size=64,
    n_routed_experts=4,
    moe_intermediate_size=32,
    moe_latent_size=24,
    moe_shared_expert_intermediate_size=32,
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(SHIPPED_NH / "tokenizer.json"))


@pytest.fixture(scope="module")
def train_rows(gsm8k_dir) -> list[dict]:
    return read_gsm8k(gsm8k_dir / "train.jsonl")


def test_documents_match_lm_eval_fewshot_context(gsm8k_dir, train_rows, tokenizer):
    """lm-eval's own 5-shot gsm8k context is our formatted shots + the prompt, in text and in tokens."""
    from evals.evaluate import load_task
    from evals.tasks.gsm8k import FEWSHOT_SEED

    task, _, _ = load_task(gsm8k_dir)
    task.set_config(key="num_fewshot", value=5)
    task.set_fewshot_seed(seed=FEWSHOT_SEED)
    by_question = {r["question"]: r for r in train_rows}
    for doc in list(task.test_docs())[:3]:
        context = task.fewshot_context(doc, num_fewshot=5)
        blocks = context.split("\n\n")
        assert len(blocks) == 6 and blocks[-1] == format_prompt(doc["question"])
        shots = [by_question[b.split("\nAnswer: ")[0].removeprefix("Question: ")] for b in blocks[:5]]
        assert blocks[:5] == [format_example(r["question"], r["answer"]) for r in shots]
        assert "####" in blocks[0] and "<<" in "".join(blocks[:5])  # full answer field, annotations kept
        packed = [t for ids in document_tokens(tokenizer, shots) for t in ids]
        assert packed + tokenizer.encode(blocks[-1]).ids == tokenizer.encode(context).ids


def test_packing_windows_start_at_documents_and_are_seeded():
    docs = [[10 + i] * (3 + i % 5) for i in range(40)]
    data = PackedGSM8K(docs, seq_len=9, batch_size=4, seed=3)
    w0, again, w1 = data.epoch_windows(0), data.epoch_windows(0), data.epoch_windows(1)
    assert w0.shape[1] == 10 and torch.equal(w0, again) and not torch.equal(w0[: len(w1)], w1[: len(w0)])
    firsts = w0[:, 0].tolist()
    for row, first in zip(w0.tolist(), firsts):  # every window opens a whole document
        assert row[: len(docs[first - 10])] == docs[first - 10][: len(row)]
    # consecutive windows cover the epoch: about num_tokens / seq_len windows, no document skipped entirely
    assert abs(len(w0) - data.num_tokens / 9) <= len(docs) / 2
    batch = next(data.batches())
    assert batch.shape == (4, 10) and torch.equal(batch, w0[:4])


class _EchoMTP(nn.Module):
    """Stands in for the MTP module: returns the token embeddings it is given (ignores the hidden)."""

    def forward(self, token_embeds, h_prev):
        assert token_embeds.shape == h_prev.shape
        return token_embeds


def test_mtp_loss_predicts_the_token_after_next():
    """Embeddings one-hot, LM head a cyclic shift s: a module echoing its token predicts s(token it is fed).
    On a sequence with x_{t+1} = s(x_t), the MTP loss is ~0 only if step k is fed x_{t+k} and scored against
    x_{t+k+1}; feeding x_t (an off-by-one pairing) or scoring x_{t+k} would cost ~10 nats."""
    V = 16
    cfg = load_model(SHIPPED_NH).config
    from dataclasses import replace

    small = replace(cfg, vocab_size=V, hidden_size=V, layer_types=("mlp",), intermediate_size=8)
    from runners.engine.models.hybrid import HybridLM

    model = HybridLM(small, with_mtp=True)
    model.mtp = _EchoMTP()
    with torch.no_grad():
        model.embeddings.weight.copy_(torch.eye(V) * 20)
        model.lm_head.weight.copy_(torch.eye(V).roll(1, dims=0))  # logits(e_tok) peak at tok + 1
    window = (torch.arange(24)[None] + torch.tensor([[0], [5]])) % V  # x_{t+1} = x_t + 1
    losses = compute_losses(model, window, mtp_depth=3)
    for k in (1, 2, 3):
        assert losses[f"mtp_{k}"].item() < 1e-3, losses
    # a window where x_{t+2} != x_{t+1} + 1 breaks the echo's prediction: the loss sees the right targets
    bad = window.clone()
    bad[:, 2::2] = (bad[:, 2::2] + 7) % V
    assert compute_losses(model, bad, mtp_depth=1)["mtp_1"].item() > 1.0


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3) and lr_at(100, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_bad_recipe_is_a_clear_error():
    with pytest.raises(ValueError, match="family"):
        TrainConfig(family="llama").validate()
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig(seq_len=2, mtp_depth=1).validate()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, train_rows):
    """The same small recipe trained twice (CPU): (init dir, out dir 1, out dir 2)."""
    root = tmp_path_factory.mktemp("train")
    init = write_random_checkpoint(root / "init", "nemotron_h", SMALL_NH, seed=1, tokenizer_dir=SHIPPED_NH)
    outs = []
    for name in ("a", "b"):
        cfg = TrainConfig(
            steps=12,
            seq_len=96,
            batch_size=4,
            warmup_steps=2,
            lr=1e-2,
            log_every=1,
            seed=5,
            init=str(init),
            mtp_depth=2,
            val_docs=12,
            val_every=6,
        )
        train(cfg, root / name, rows=train_rows[:60], check_transformers=(name == "a"))
        outs.append(root / name)
    return init, outs[0], outs[1]


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / LOG_FILE).read_text().splitlines()]


@pytest.mark.slow  # shares the two ~10 s training runs of the two_runs fixture
def test_training_reduces_both_losses(two_runs):
    _, out, _ = two_runs
    log = _log(out)
    assert [r["step"] for r in log] == list(range(1, 13))
    assert log[0]["main_loss"] == pytest.approx(math.log(2048), abs=0.3)  # random init: ~uniform over vocab
    assert log[-1]["main_loss"] < log[0]["main_loss"] - 1.0
    assert log[-1]["mtp_loss"] < log[0]["mtp_loss"] - 1.0
    assert {"mtp_1", "mtp_2"} <= set(log[-1])
    val = [r for r in log if "val_main_loss" in r]  # held-out rows: the last 12 of the 60
    assert [r["step"] for r in val] == [6, 12] and val[1]["val_main_loss"] < val[0]["val_main_loss"]
    recipe = json.loads((out / RECIPE_FILE).read_text())
    assert recipe["config"]["steps"] == 12 and recipe["summary"]["tokens"] == 12 * 4 * 96
    assert recipe["documents"] == 48 and recipe["val_windows"] >= 1


@pytest.mark.slow  # shares the two ~10 s training runs of the two_runs fixture
def test_same_seed_same_losses_and_weights(two_runs):
    _, a, b = two_runs
    assert not torch.are_deterministic_algorithms_enabled()  # train() restores the process setting
    strip = lambda log: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in log]
    assert strip(_log(a)) == strip(_log(b))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.slow  # shares the two ~10 s training runs of the two_runs fixture
def test_checkpoint_layout_and_reload(two_runs, tokenizer):
    init, out, _ = two_runs
    with (
        safe_open(str(init / "model.safetensors"), "pt") as f0,
        safe_open(str(out / "model.safetensors"), "pt") as f1,
    ):
        assert sorted(f0.keys()) == sorted(f1.keys())
        assert any(k.startswith("mtp.") for k in f1.keys())
        for k in f0.keys():
            assert f0.get_slice(k).get_dtype() == f1.get_slice(k).get_dtype(), k
        changed = [k for k in f0.keys() if not torch.equal(f0.get_tensor(k), f1.get_tensor(k))]
        assert "mtp.layers.0.eh_proj.weight" in changed and "backbone.embeddings.weight" in changed
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (init / name).read_bytes()
    recipe = json.loads((out / RECIPE_FILE).read_text())
    diffs = recipe["summary"]["verify"]
    assert diffs["engine_max_abs_diff"] < 1e-3 and diffs["mtp_max_abs_diff"] < 1e-3
    assert diffs["transformers_max_abs_diff"] is not None and diffs["transformers_max_abs_diff"] < 2e-2
    # and again on another probe, against a model that was not the one written (must fail)
    model = load_model(out, dtype=torch.float32, load_mtp=True)
    probe = torch.tensor([tokenizer.encode(format_prompt("What is 3 + 4?")).ids])
    again = verify_checkpoint(model, out, probe, check_transformers=False)
    assert again["engine_max_abs_diff"] == 0.0
    other = load_model(init, dtype=torch.float32, load_mtp=True)
    with pytest.raises(AssertionError, match="differs"):
        verify_checkpoint(other, out, probe, check_transformers=False)


SMALL_QN = dict(
    hidden_size=32,
    num_hidden_layers=2,
    full_attention_interval=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
    num_experts=4,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)


def _small_recipe(init: Path, **kw) -> TrainConfig:
    base = dict(
        steps=6, seq_len=64, batch_size=2, warmup_steps=1, lr=1e-2, log_every=1, init=str(init), val_docs=0
    )
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow
def test_qwen3_next_trains_and_reloads(tmp_path, train_rows):
    """The same entry point trains the Qwen3-Next family (gated delta rule + gated attention + MTP)."""
    pytest.importorskip("runners.engine.models.qwen3_next",
                        reason="Qwen3-Next engine integration not merged yet")
    init = write_random_checkpoint(
        tmp_path / "init", "qwen3_next", SMALL_QN, seed=1, tokenizer_dir=SHIPPED_NH
    )
    summary = train(_small_recipe(init, family="qwen3_next", steps=8), tmp_path / "out", rows=train_rows[:20])
    log = _log(tmp_path / "out")
    assert log[-1]["main_loss"] < log[0]["main_loss"] - 0.3 and log[-1]["mtp_loss"] < log[0]["mtp_loss"] - 0.3
    assert summary["verify"]["engine_max_abs_diff"] < 1e-3 and summary["verify"]["mtp_max_abs_diff"] < 1e-3
    assert summary["verify"]["transformers_max_abs_diff"] < 2e-2


@pytest.mark.gpu
def test_cuda_bf16_autocast_training(tmp_path, train_rows):
    """On the GPU: bf16 autocast steps reduce the loss, the checkpoint reloads, and a rerun gives the same
    losses to within bf16 reduction-order noise (deterministic algorithms, warn_only)."""
    init = write_random_checkpoint(
        tmp_path / "init", "nemotron_h", SMALL_NH, seed=1, tokenizer_dir=SHIPPED_NH
    )
    runs = []
    for name in ("a", "b"):
        train(_small_recipe(init, steps=20), tmp_path / name, rows=train_rows[:40], device="cuda")
        runs.append(_log(tmp_path / name))
    assert runs[0][-1]["main_loss"] < runs[0][0]["main_loss"] - 1.0
    for ra, rb in zip(*runs):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-3)


def test_time_budget_and_config_overrides(tmp_path, train_rows):
    """A resized random init (config_overrides) trains; the time budget fixes and records ``steps``."""
    cfg = _small_recipe(SHIPPED_NH, steps=50, warmup_steps=5, time_budget_s=1e-3, seq_len=32)
    cfg.config_overrides = SMALL_NH
    summary = train(cfg, tmp_path / "out", rows=train_rows[:20], verify=False)
    recipe = json.loads((tmp_path / "out" / RECIPE_FILE).read_text())
    assert summary["steps"] == recipe["config"]["steps"] == 6  # warmup (timed) + 1: the budget is spent
    assert cfg.steps == 50  # the caller's recipe is left alone
    assert [r["step"] for r in _log(tmp_path / "out")][-1] == 6
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["hidden_size"] == SMALL_NH["hidden_size"]
    )
    assert load_model(tmp_path / "out", load_mtp=True).mtp is not None

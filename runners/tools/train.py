"""Train the shipped tiny checkpoints on the GSM8K train split with our own engine's modules.

    python -m runners.tools.train --family nemotron_h --out DIR [--device cuda] [--steps N] [--data-dir D] ...

Scope: one entry point that turns a (random) HF checkpoint of either family into a small language model of
GSM8K-style text plus a trained MTP draft head, and writes it back in the same HF layout. The model is
:class:`runners.engine.models.hybrid.HybridLM` in training mode: its cache-free forward (chunked Mamba2 /
gated
delta rule scans in plain PyTorch) is differentiable as is; nothing here knows about caches or decoding.

Data: every train row is formatted as lm-eval's gsm8k few-shot example, ``"Question: {q}\\nAnswer: {a}"``
(the stock task's target is the whole answer field, with its ``<<...>>`` calculator annotations and
``#### N``), and examples are joined with ``"\\n\\n"`` exactly as lm-eval joins the 5 shots and the test
question. Documents are tokenized as they appear inside such a joined prompt (see :func:`document_tokens`)
and packed into windows of ``seq_len + 1`` tokens that each start at a document boundary, in a seeded
order per epoch; no BOS (the evaluation prompts carry none). The last ``val_docs`` rows of train.jsonl are
held out for a validation loss; the test split is never read (except by ``--sample``, for one prompt).

Loss (DeepSeek-V3 style MTP, paired the way :func:`runners.engine.step.mtp_forward` pairs at inference):
with
target hidden states h_t (after the final norm) the main loss is CE(lm_head(h_t), x_{t+1}); MTP step 1 feeds
``mtp(embed(x_{t+1}), h_t)`` and predicts x_{t+2}; step k > 1 (``mtp_depth``) feeds its own previous output
with the next token, as recursive drafting does. loss = main + mtp_weight * mean over steps of the MTP CE.
Gradients of the MTP loss reach the backbone (DeepSeek-V3 does the same).

Optimiser: AdamW (no decay on norms, biases, 1-D tensors), linear warmup then cosine to ``min_lr_ratio``,
grad-norm clipping; bf16 autocast on CUDA, float32 on the CPU. Deterministic: ``torch.manual_seed(seed)``,
a seeded data order, ``torch.use_deterministic_algorithms`` (on CUDA as far as the ops allow; see
docs/training.md). Logs ``train_log.jsonl`` and ``recipe.json`` in ``--out`` beside the checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from evals.tasks.gsm8k import gsm8k_dir
from registry.checkpoint import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
)
from registry.schema import EMBEDDED_CHECKPOINTS_DIR
from runners.engine.loader import load_model
from runners.engine.models.config import family_module
from runners.engine.models.hybrid import HybridLM
from runners.engine.models.mamba2 import Mamba2Mixer
from runners.tools.tiny import CHECKPOINT_NAMES, write_random_checkpoint

log = logging.getLogger("runners.tools.train")

FEWSHOT_DELIMITER = "\n\n"  # lm-eval's default fewshot_delimiter
TARGET_DELIMITER = " "  # lm-eval's default target_delimiter: "Answer:" + " " + answer
CPU_SCAN_CHUNK = 32  # Mamba2 scan chunk off CUDA (same math up to rounding; ~4x less intra-chunk work)
LOG_FILE, RECIPE_FILE = "train_log.jsonl", "recipe.json"
# Files of the init checkpoint copied unchanged into the output (weights are rewritten).
COPIED_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)


@dataclass
class TrainConfig:
    """One training recipe (everything that determines the weights, given the data and the init checkpoint).

    Sizes: ``seq_len`` tokens per packed window (inputs; the window holds seq_len + 1 tokens), ``batch_size``
    windows per optimiser step. ``lr`` is the peak AdamW learning rate; ``warmup_steps`` ramp linearly from 0,
    then a cosine decays to ``lr * min_lr_ratio`` at ``steps``. ``mtp_weight`` is lambda of the MTP loss,
    ``mtp_depth`` the number of recursive MTP steps trained (1 = DeepSeek-V3's single step).
    ``time_budget_s``: ``steps`` becomes a maximum; after the warmup steps (timed from the 4th step on) the
    run sets ``steps = min(steps, budget / seconds per step)`` and records it in recipe.json, so a rerun with
    that ``--steps`` and no budget reproduces the weights. ``config_overrides`` (transformers config fields,
    e.g. {"hidden_size": 256}) re-initialise a resized
    model through :func:`runners.tools.tiny.write_random_checkpoint` instead of reading ``init``.
    """

    family: str = "nemotron_h"
    steps: int = 2000
    seq_len: int = 512
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    mtp_depth: int = 1
    seed: int = 0
    log_every: int = 10
    val_docs: int = 256  # the last rows of train.jsonl, held out for a validation loss (0 = none)
    val_every: int = 100  # steps between validation losses (and at the end)
    time_budget_s: float | None = None  # wall-clock budget: fixes ``steps`` after timing the warmup
    init: str | None = None  # checkpoint dir; None = the shipped registry/checkpoints/tiny_<family>_mtp
    config_overrides: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ValueError naming the bad field and the allowed range."""
        if self.family not in CHECKPOINT_NAMES:
            raise ValueError(f"family={self.family!r}; use one of {sorted(CHECKPOINT_NAMES)}")
        for name in ("steps", "seq_len", "batch_size", "mtp_depth", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.seq_len < self.mtp_depth + 2:
            raise ValueError(f"seq_len={self.seq_len} must be >= mtp_depth + 2 = {self.mtp_depth + 2}")
        if self.val_docs < 0:
            raise ValueError(f"val_docs={self.val_docs} must be >= 0")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps}]")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.mtp_weight < 0:
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1 and mtp_weight >= 0")


# ------------------------------------------------------------------------------------------------ data


def format_example(question: str, answer: str) -> str:
    """One lm-eval gsm8k few-shot example: ``doc_to_text + target_delimiter + doc_to_target``."""
    return f"Question: {question}\nAnswer:{TARGET_DELIMITER}{answer}"


def format_prompt(question: str) -> str:
    """The test question as lm-eval puts it after the shots (``doc_to_text``): the model continues it."""
    return f"Question: {question}\nAnswer:"


def read_gsm8k(path: str | os.PathLike) -> list[dict]:
    """Rows {"question", "answer"} of a GSM8K jsonl file, in file order. Raises FileNotFoundError naming the
    path and how to point at the data, ValueError naming the line of a malformed row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"GSM8K file not found at {path}; pass --data-dir (a folder holding train.jsonl) or set GSM8K_DIR"
        )
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
                raise ValueError(f"{path}:{lineno}: a GSM8K row needs string fields 'question' and 'answer'")
            rows.append(row)
    return rows


def resolve_train_file(data_dir: str | os.PathLike | None) -> Path:
    """train.jsonl of the GSM8K folder: ``data_dir``, else evals.tasks.gsm8k.gsm8k_dir's lookup ($GSM8K_DIR,
    else ../shared/data/gsm8k by the checkout). Raises FileNotFoundError when no folder is known."""
    path, _ = gsm8k_dir(data_dir, setting="--data-dir")
    if path is None:
        raise FileNotFoundError("no GSM8K folder found; pass --data-dir (a folder holding train.jsonl) "
                                "or set GSM8K_DIR")
    return path / "train.jsonl"


def document_tokens(tokenizer, rows: Sequence[dict]) -> list[list[int]]:
    """Token ids of each row's example followed by the few-shot delimiter, as inside a joined prompt.

    The ids of ``format_example(row) + "\\n\\n"`` depend on what follows (the pre-tokenizer groups trailing
    whitespace differently at the end of a string), and in a prompt a "Question:" always follows. So each
    document is encoded with the next example's opening and that opening's ids are cut off again; the
    concatenation of documents then equals the encoding of the joined text (tests/test_train.py checks it
    against lm-eval's own 5-shot context). Raises RuntimeError if the cut is not a clean token boundary.
    """
    opening = "Question:"
    tail = tokenizer.encode(opening).ids
    texts = [format_example(r["question"], r["answer"]) + FEWSHOT_DELIMITER + opening for r in rows]
    docs = []
    for enc in tokenizer.encode_batch(texts):
        ids = enc.ids
        if ids[-len(tail) :] != tail:
            raise RuntimeError(
                "the tokenizer merges the few-shot delimiter with the next 'Question:'; packing would not "
                "match the evaluation prompts (retrain the tokenizer with runners.tools.tiny)"
            )
        docs.append(ids[: -len(tail)])
    return docs


class PackedGSM8K:
    """Deterministic stream of packed windows [batch_size, seq_len + 1] (int64) over tokenized documents.

    Epoch e orders the documents by ``torch.randperm`` under a generator seeded with (seed, e), concatenates
    them, and cuts windows of seq_len + 1 tokens that each start at a document start: the next window starts
    at the first document that begins at or after the previous window's end (so a document cut at a window's
    end starts again at the beginning of the next; nothing is padded). The last windows of an epoch borrow
    tokens from the epoch's first documents. ``windows_per_epoch`` is therefore about tokens / seq_len.
    """

    def __init__(self, docs: list[list[int]], seq_len: int, batch_size: int, seed: int):
        if not docs:
            raise ValueError("no GSM8K documents to train on")
        self.docs, self.seq_len, self.batch_size, self.seed = docs, seq_len, batch_size, seed
        self.num_tokens = sum(len(d) for d in docs)
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"the data has {self.num_tokens} tokens; seq_len + 1 = {seq_len + 1} is too long"
            )

    def epoch_windows(self, epoch: int) -> torch.Tensor:
        """All windows of one epoch: [num_windows, seq_len + 1] int64, in training order."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.docs), generator=g).tolist()
        stream = torch.tensor([t for i in order for t in self.docs[i]], dtype=torch.long)
        lengths = torch.tensor([len(self.docs[i]) for i in order], dtype=torch.long)
        starts = torch.cumsum(lengths, 0) - lengths
        stream = torch.cat([stream, stream[: self.seq_len + 1]])  # wrap the last window into the first docs
        windows, nxt = [], 0
        for s in starts.tolist():
            if s < nxt:
                continue
            windows.append(stream[s : s + self.seq_len + 1])
            nxt = s + self.seq_len
        return torch.stack(windows)

    def batches(self) -> Iterator[torch.Tensor]:
        """Endless iterator of [batch_size, seq_len + 1] batches; epochs follow one another seamlessly."""
        epoch, buf = 0, []
        while True:
            buf.extend(self.epoch_windows(epoch).unbind(0))
            epoch += 1
            while len(buf) >= self.batch_size:
                yield torch.stack(buf[: self.batch_size])
                buf = buf[self.batch_size :]


# ------------------------------------------------------------------------------------------------ loss


def compute_losses(model: HybridLM, window: torch.Tensor, mtp_depth: int = 1) -> dict[str, torch.Tensor]:
    """Main next-token loss and the MTP losses of one batch.

    Inputs x = window[:, :T], labels y = window[:, 1:] (y_t = x_{t+1}); h^0_t is the target's hidden state
    after the final norm. MTP step k (1-based) at position t feeds the previous step's hidden h^{k-1}_t and
    the embedding of x_{t+k} = y_{t+k-1} (step 1: exactly the engine's pairing of target hidden t with the
    token after t) and predicts x_{t+k+1} = y_{t+k}; positions t = 0 .. T - k - 1 have a target.

    Args:
        model: HybridLM (with ``model.mtp`` when MTP losses are wanted).
        window: [B, T + 1] int64 token ids.
        mtp_depth: MTP steps to train (0, or ``model.mtp`` None: main loss only).
    Returns:
        {"main": scalar, "mtp": scalar (mean over steps; 0 without MTP), "mtp_1".."mtp_k": per step}: float32
        mean cross-entropies in nats per token.
    """
    x, y = window[:, :-1], window[:, 1:]
    T, V = x.shape[1], model.config.vocab_size
    h = model(x)  # [B, T, D] after the final norm
    losses = {"main": F.cross_entropy(model.lm_logits(h).reshape(-1, V), y.reshape(-1))}
    steps = []
    if model.mtp is not None:
        for k in range(1, mtp_depth + 1):
            # positions 0 .. T - k: the last one has no target inside the window, but the next step needs it
            h = model.mtp(model.embeddings(y[:, k - 1 :]), h[:, : T - k + 1])  # [B, T - k + 1, D]
            logits = model.lm_logits(h[:, : T - k])
            steps.append(F.cross_entropy(logits.reshape(-1, V), y[:, k:].reshape(-1)))
            losses[f"mtp_{k}"] = steps[-1]
    losses["mtp"] = torch.stack(steps).mean() if steps else torch.zeros((), device=x.device)
    return losses


def validation_losses(model: HybridLM, windows: torch.Tensor, cfg: TrainConfig, device) -> dict[str, float]:
    """Mean main / MTP losses over held-out ``windows`` [n, seq_len + 1] (no grad; restores train mode)."""
    model.eval()
    sums, n = {"val_main_loss": 0.0, "val_mtp_loss": 0.0}, 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for batch in windows.split(cfg.batch_size):
            losses = compute_losses(model, batch.to(device), cfg.mtp_depth if cfg.mtp_weight > 0 else 0)
            sums["val_main_loss"] += losses["main"].item() * len(batch)
            sums["val_mtp_loss"] += losses["mtp"].item() * len(batch)
            n += len(batch)
    model.train()
    return {k: v / n for k, v in sums.items()}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimiser step ``step`` (0-based): linear warmup, then cosine to lr * min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: HybridLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (embeddings, projections, experts) only."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=1e-8, foreach=False)


# ------------------------------------------------------------------------------------------------ model io


def init_checkpoint(cfg: TrainConfig, workdir: Path) -> Path:
    """The checkpoint training starts from: ``cfg.init``, the shipped random tiny checkpoint of the family,
    or (with ``config_overrides``) a fresh random one of the resized config written under ``workdir``."""
    if cfg.config_overrides:
        shipped = EMBEDDED_CHECKPOINTS_DIR / CHECKPOINT_NAMES[cfg.family]
        tokenizer_dir = Path(cfg.init) if cfg.init else shipped
        return write_random_checkpoint(
            workdir / "init", cfg.family, cfg.config_overrides, seed=cfg.seed, tokenizer_dir=tokenizer_dir
        )
    path = Path(cfg.init) if cfg.init else EMBEDDED_CHECKPOINTS_DIR / CHECKPOINT_NAMES[cfg.family]
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"init checkpoint {path} has no config.json; pass --init CHECKPOINT_DIR")
    return path


def save_checkpoint(model: HybridLM, init_dir: Path, out_dir: Path) -> Path:
    """Write ``model`` as an HF checkpoint in out_dir with the init checkpoint's layout.

    config.json, generation_config.json and the tokenizer files are copied from init_dir; model.safetensors
    holds every tensor of init_dir's model.safetensors under the same name and dtype (bf16, the NemotronH
    router in float32: what runners.tools.tiny writes), filled from the model. Raises ValueError if the
    model's
    checkpoint names differ from the init file's (a model built from another config).
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in COPIED_FILES:
        if (init_dir / name).is_file() and (init_dir / name).resolve() != (out_dir / name).resolve():
            shutil.copyfile(init_dir / name, out_dir / name)
    targets = family_module(model.config.family).checkpoint_targets(model)
    dtypes = _disk_dtypes(init_dir)
    if set(dtypes) != set(targets):
        raise ValueError(
            f"model tensors do not match {init_dir / 'model.safetensors'}: missing "
            f"{sorted(set(dtypes) - set(targets))[:5]}, extra {sorted(set(targets) - set(dtypes))[:5]}"
        )
    tensors = {name: targets[name].detach().to("cpu", dtypes[name]).contiguous() for name in sorted(dtypes)}
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir


def _disk_dtypes(path: Path) -> dict[str, torch.dtype]:
    """``{tensor name: dtype}`` of ``path``/model.safetensors, without reading the data."""
    from safetensors import safe_open

    names = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        return {name: names[f.get_slice(name).get_dtype()] for name in f.keys()}


def round_to_checkpoint(model: HybridLM, path: Path) -> HybridLM:
    """Round every tensor of ``model`` in place to the dtype its checkpoint name has in
    ``path``/model.safetensors (and back to the model's dtype): the values a reload of that file holds."""
    targets = family_module(model.config.family).checkpoint_targets(model)
    with torch.no_grad():
        for name, dtype in _disk_dtypes(path).items():
            t = targets[name]
            t.copy_(t.to(dtype).to(t.dtype))
    return model


def verify_checkpoint(
    model: HybridLM, path: Path, ids: torch.Tensor, check_transformers: bool = True
) -> dict:
    """Reload ``path`` in our engine (float32, with MTP) and in transformers; compare their logits on
    ``ids`` [B, T] with the in-memory model rounded to the file's dtypes (a copy; ``model`` is unchanged).

    Returns {"engine_max_abs_diff", "mtp_max_abs_diff", "transformers_max_abs_diff" (None when transformers
    is not installed)}. Raises AssertionError when a difference exceeds 1e-3 (engine) / 2e-2 (transformers,
    whose kernels differ in float32 summation order).
    """
    import copy

    ref = round_to_checkpoint(copy.deepcopy(model).float().cpu(), path).eval()
    loaded = load_model(path, dtype=torch.float32, load_mtp=ref.mtp is not None).eval()
    ids = ids.cpu()
    with torch.no_grad():
        h_ref, h_new = ref(ids), loaded(ids)
        want = ref.lm_logits(h_ref)
        out = {"engine_max_abs_diff": (loaded.lm_logits(h_new) - want).abs().max().item()}
        if ref.mtp is not None:
            nxt = ids.roll(-1, dims=1)
            m_ref = ref.lm_logits(ref.mtp(ref.embeddings(nxt), h_ref))
            m_new = loaded.lm_logits(loaded.mtp(loaded.embeddings(nxt), h_new))
            out["mtp_max_abs_diff"] = (m_new - m_ref).abs().max().item()
        out["transformers_max_abs_diff"] = None
        if check_transformers:
            try:
                from transformers import AutoModelForCausalLM
            except ImportError:
                log.warning("transformers is not installed: the checkpoint was checked in our engine only")
            else:
                hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
                got = hf(ids).logits.float()
                out["transformers_max_abs_diff"] = (got - want).abs().max().item()
    assert out["engine_max_abs_diff"] < 1e-3, f"engine reload differs: {out}"
    assert out.get("mtp_max_abs_diff", 0.0) < 1e-3, f"engine reload of the MTP module differs: {out}"
    tf = out["transformers_max_abs_diff"]
    assert tf is None or tf < 2e-2, f"transformers reload differs: {out}"
    return out


# ------------------------------------------------------------------------------------------------ loop


@contextlib.contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels for the duration of a run; restores the process's previous settings after."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
    )
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        # warn_only: a few CUDA backward kernels (e.g. scaled_dot_product_attention's) have no deterministic
        # variant; they are reported once instead of aborting the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32 = saved[2], saved[3]


def train(
    cfg: TrainConfig,
    out_dir: str | os.PathLike,
    *,
    data_dir: str | os.PathLike | None = None,
    device: str = "cpu",
    rows: list[dict] | None = None,
    verify: bool = True,
    check_transformers: bool = True,
) -> dict:
    """Run one recipe and write the checkpoint, ``train_log.jsonl`` and ``recipe.json`` to out_dir.

    Args:
        cfg: the recipe (validated here).
        out_dir: created; existing checkpoint files there are overwritten.
        data_dir: folder with train.jsonl (default $GSM8K_DIR, else ../shared/data/gsm8k).
        device: "cpu" or "cuda" (bf16 autocast on CUDA, float32 on the CPU).
        rows: GSM8K rows to use instead of reading the file (tests).
        verify: reload the written checkpoint in our engine (and transformers) and compare logits.
    Returns:
        summary dict: final losses, tokens seen, seconds per step, verification diffs.
    Raises:
        ValueError / FileNotFoundError: bad recipe, missing data or init checkpoint.
    """
    import tempfile

    cfg.validate()
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA GPU; use --device cpu")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg)  # a time budget rewrites cfg.steps: leave the caller's recipe alone
    with _deterministic(dev), tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as files:
        init_dir = init_checkpoint(cfg, Path(tmp))
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(init_dir / TOKENIZER_FILE))
        if rows is None:
            rows = read_gsm8k(resolve_train_file(data_dir))
        docs = document_tokens(tokenizer, rows)
        if cfg.val_docs >= len(docs):
            raise ValueError(f"val_docs={cfg.val_docs} leaves no training data ({len(docs)} documents)")
        val_docs = docs[len(docs) - cfg.val_docs :] if cfg.val_docs else []
        docs = docs[: len(docs) - cfg.val_docs]
        data = PackedGSM8K(docs, cfg.seq_len, cfg.batch_size, cfg.seed)
        val = None
        if val_docs and sum(map(len, val_docs)) > cfg.seq_len:
            val = PackedGSM8K(val_docs, cfg.seq_len, cfg.batch_size, cfg.seed).epoch_windows(0)

        torch.manual_seed(cfg.seed)
        model = load_model(init_dir, dtype=torch.float32, load_mtp=cfg.mtp_weight > 0).to(dev).train()
        if dev.type != "cuda":  # as the engine does: the scan's intra-chunk term is quadratic in the chunk
            for module in model.modules():
                if isinstance(module, Mamba2Mixer):
                    module.chunk_size = min(module.chunk_size, CPU_SCAN_CHUNK)
        n_params = sum(p.numel() for p in model.parameters())
        for p in model.parameters():
            p.requires_grad_(p.is_floating_point())
        opt = make_optimizer(model, cfg)
        recipe = {
            "config": asdict(cfg),
            "device": str(dev),
            "torch": torch.__version__,
            "init": str(init_dir) if not cfg.config_overrides else "random (config_overrides)",
            "data_tokens": data.num_tokens,
            "val_windows": 0 if val is None else len(val),
            "documents": len(docs),
            "parameters": n_params,
            "command": " ".join(["python -m runners.tools.train", *sys.argv[1:]]),
        }
        (out / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        log.info(
            "%s: %d parameters, %d documents, %d tokens", cfg.family, n_params, len(docs), data.num_tokens
        )

        log_path = out / LOG_FILE
        log_f = files.enter_context(log_path.open("w"))
        batches = data.batches()
        t0 = time.perf_counter()
        tokens = 0
        acc = {"loss": 0.0, "main": 0.0, "mtp": 0.0, "n": 0}
        calib = min(cfg.warmup_steps, 30) if cfg.time_budget_s else 0
        t_calib = None
        step = 0
        while step < cfg.steps:
            if step == 3:
                t_calib = time.perf_counter()
            if calib > 3 and step == calib:
                per_step = (time.perf_counter() - t_calib) / (calib - 3)
                budget_steps = int((cfg.time_budget_s - (time.perf_counter() - t0)) / per_step) + calib
                cfg.steps = max(calib + 1, min(cfg.steps, budget_steps))
                log.info(
                    "time budget %.0f s at %.3f s/step: %d steps", cfg.time_budget_s, per_step, cfg.steps
                )
                recipe["config"] = asdict(cfg)
                (out / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            window = next(batches).to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                losses = compute_losses(model, window, cfg.mtp_depth if cfg.mtp_weight > 0 else 0)
            loss = losses["main"] + cfg.mtp_weight * losses["mtp"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            tokens += window.shape[0] * (window.shape[1] - 1)
            acc["loss"] += loss.item()
            acc["main"] += losses["main"].item()
            acc["mtp"] += losses["mtp"].item()
            acc["n"] += 1
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                n = acc.pop("n")
                record = {
                    "step": step + 1,
                    "lr": lr,
                    "loss": acc["loss"] / n,
                    "main_loss": acc["main"] / n,
                    "mtp_loss": acc["mtp"] / n,
                    **{k: v.item() for k, v in losses.items() if k.startswith("mtp_")},
                    "grad_norm": grad_norm.item(),
                    **(
                        validation_losses(model, val, cfg, dev)
                        if val is not None and ((step + 1) % cfg.val_every == 0 or step + 1 == cfg.steps)
                        else {}
                    ),
                    "tokens": tokens,
                    "elapsed_s": round(time.perf_counter() - t0, 3),
                }
                log_f.write(json.dumps(record) + "\n")
                log_f.flush()
                log.info(
                    "step %d/%d loss %.4f main %.4f mtp %.4f lr %.2e %.0f tok/s",
                    step + 1,
                    cfg.steps,
                    record["loss"],
                    record["main_loss"],
                    record["mtp_loss"],
                    lr,
                    tokens / max(record["elapsed_s"], 1e-9),
                )
                acc = {"loss": 0.0, "main": 0.0, "mtp": 0.0, "n": 0}
            step += 1
        elapsed = time.perf_counter() - t0
        model.eval()
        save_checkpoint(model, init_dir, out)
        summary = {
            "steps": cfg.steps,
            "tokens": tokens,
            "epochs": tokens / data.num_tokens,
            "seconds": round(elapsed, 2),
            "seconds_per_step": round(elapsed / cfg.steps, 4),
            "final": record,
            "model_bytes": (out / WEIGHTS_FILE).stat().st_size,
        }
        if verify:
            probe = torch.tensor([docs[0][:64]], dtype=torch.long)
            summary["verify"] = verify_checkpoint(model, out, probe, check_transformers)
        recipe["summary"] = summary
        (out / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        return summary


def sample_answer(path: str | os.PathLike, rows: list[dict], question: str, max_new_tokens: int = 160) -> str:
    """Greedy continuation by our engine of a 5-shot prompt (first 5 ``rows`` as shots) for ``question``,
    cut at the first "Question:" (lm-eval's stop string). A quick look at the answer format."""
    from tokenizers import Tokenizer

    from runners.engine.engine import Engine
    from runners.engine.options import EngineOptions

    tok = Tokenizer.from_file(str(Path(path) / TOKENIZER_FILE))
    shots = FEWSHOT_DELIMITER.join(format_example(r["question"], r["answer"]) for r in rows[:5])
    prompt = shots + FEWSHOT_DELIMITER + format_prompt(question)
    engine = Engine.from_pretrained(path, EngineOptions(max_batch_size=1, max_seq_len=4096))
    out = engine.generate([tok.encode(prompt).ids], max_new_tokens)
    return tok.decode(out.tokens[0]).split("Question:")[0]


def main(argv: list[str] | None = None) -> None:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m runners.tools.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(CHECKPOINT_NAMES), required=True)
    p.add_argument("--out", required=True, help="output checkpoint dir (+ train_log.jsonl, recipe.json)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--data-dir", default=None, help="folder with train.jsonl (default $GSM8K_DIR, ../shared)")
    p.add_argument("--init", default=None, help="init checkpoint (default registry/checkpoints/tiny_*_mtp)")
    p.add_argument(
        "--config-overrides", default="{}", help='JSON transformers fields, e.g. {"hidden_size":256}'
    )
    floats = ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "mtp_weight")
    ints = (
        "steps",
        "seq_len",
        "batch_size",
        "warmup_steps",
        "mtp_depth",
        "seed",
        "log_every",
        "val_docs",
        "val_every",
    )
    for name in ints:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in floats:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    p.add_argument(
        "--time-budget-s", type=float, default=None, help="fix --steps from the measured step time"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-verify", action="store_true", help="skip reloading the checkpoint for comparison")
    p.add_argument("--sample", action="store_true", help="print one greedy 5-shot answer at the end")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    if args.threads:
        torch.set_num_threads(args.threads)
    fields = {k: getattr(args, k) for k in ints + floats}
    cfg = TrainConfig(
        family=args.family,
        init=args.init,
        time_budget_s=args.time_budget_s,
        config_overrides=json.loads(args.config_overrides),
        **fields,
    )
    summary = train(cfg, args.out, data_dir=args.data_dir, device=args.device, verify=not args.no_verify)
    print(json.dumps(summary, indent=2))
    if args.sample:
        train_rows = read_gsm8k(resolve_train_file(args.data_dir))
        test_file = resolve_train_file(args.data_dir).with_name("test.jsonl")
        q = read_gsm8k(test_file)[0]["question"] if test_file.is_file() else train_rows[-1]["question"]
        print("sample answer:", sample_answer(args.out, train_rows, q))


if __name__ == "__main__":
    main()

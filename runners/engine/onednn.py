"""Float32 linear layers on the CPU through oneDNN, bit for bit what torch's ``F.linear`` computes.

torch runs a float32 ``F.linear`` on the CPU as one MKL sgemm. On the project's CPU machines (AMD EPYC,
AVX-512) oneDNN's matmul -- ``torch.ops.mkldnn._linear_pointwise``, the op inductor's CPU backend calls --
computes the same products about twice as fast at the tiny models' shapes (docs/performance.md). Both sum an
output's K products in order, one fused multiply-add after another; MKL cuts K into blocks (with this build:
up to 192 in one block, 256 as 128 + 128, 384 as 192 + 192, 512 as 192 + 192 + 128) and adds the blocks'
sums in order, so oneDNN run over the same K blocks, their partial sums added in the same order, gives the
same bits.

That is a property of the two libraries' builds and of the CPU, not a documented contract, so nothing here
assumes it: :func:`linear_plan` runs ``F.linear`` and oneDNN over candidate blockings on random inputs of a
weight's shape at several row counts and keeps the first blocking equal to ``F.linear`` bit for bit at all
of them; a shape where none is stays on ``F.linear``. MKL takes another path below :data:`MIN_ROWS` rows,
and oneDNN's call costs more than MKL's on small products (:data:`MIN_OUTPUTS`): those calls stay on
``F.linear`` too. :func:`use_onednn_linears` swaps a model's eligible ``nn.Linear`` modules for
:class:`OneDNNLinear` (the same parameters; the engine does it on the CPU in float32,
``EngineOptions.onednn_linear``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MIN_ROWS = 4  # fewer rows: MKL computes them another way (not the blocked sgemm oneDNN reproduces)
MIN_OUTPUTS = 16384  # rows x output features below which oneDNN's call costs more than MKL's
MKL_BLOCK = 192  # the K block of the sgemm the candidate blockings are modelled on (each is checked)
PROBE_ROWS = (MIN_ROWS, 5, 17, 64, 257)  # row counts each candidate blocking must match F.linear at
# oneDNN builds a kernel for each new row count (a few hundred microseconds, more than the product itself at
# a prompt's size, and a prefill meets a new count with every prompt): inputs are padded with zero rows to a
# multiple of this, so that a run builds few
ROW_BUCKET = 64


def onednn_available() -> bool:
    """Whether torch has oneDNN's linear op and oneDNN is enabled (``torch.backends.mkldnn``)."""
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def _candidate_blocks(K: int) -> list[tuple[int, ...]]:
    """Blockings of K to try, in order: one block; blocks of MKL_BLOCK and the rest; the same with the last
    two blocks made even (a short rest merged into its neighbour)."""
    full, rest = divmod(K, MKL_BLOCK)
    out = [(K,)]
    if full and rest:
        out.append((MKL_BLOCK,) * full + (rest,))
        if (MKL_BLOCK + rest) % 2 == 0:
            out.append((MKL_BLOCK,) * (full - 1) + ((MKL_BLOCK + rest) // 2,) * 2)
    elif full > 1:
        out.append((MKL_BLOCK,) * full)
    return list(dict.fromkeys(out))


def _blocked(x: torch.Tensor, weights: list[torch.Tensor], blocks: tuple[int, ...]) -> torch.Tensor:
    """x [..., K] times the blocks' weights [N, k_i] transposed, the partial sums added in block order."""
    out, start = None, 0
    for w, k in zip(weights, blocks):
        part = _onednn(x[..., start:start + k], w)
        out = part if out is None else out.add_(part)
        start += k
    return out


def _split(weight: torch.Tensor, blocks: tuple[int, ...]) -> list[torch.Tensor]:
    """The weight's column blocks, each contiguous (oneDNN reads a strided weight wrongly): views for one
    block, copies otherwise."""
    if len(blocks) == 1:
        return [weight]
    return list(w.contiguous() for w in weight.split(list(blocks), dim=1))


_PLANS: dict[tuple[int, int, int], tuple[int, ...] | None] = {}


def linear_plan(N: int, K: int) -> tuple[int, ...] | None:
    """The K blocking under which oneDNN equals ``F.linear`` bit for bit for a float32 weight [N, K] (no
    bias) at every row count of :data:`PROBE_ROWS`, from random inputs (fixed seed), with torch's intra-op
    thread count of now (a library may split the work by threads); None when no candidate does (or oneDNN is
    unavailable). Computed once per shape, thread count and process (a few milliseconds)."""
    key = (N, K, torch.get_num_threads())
    if key in _PLANS:
        return _PLANS[key]
    plan = None
    if onednn_available():
        g = torch.Generator().manual_seed(N * 65537 + K)
        with torch.inference_mode():
            w = torch.randn(N, K, generator=g) * K ** -0.5
            xs = [torch.randn(m, K, generator=g) for m in PROBE_ROWS]
            refs = [F.linear(x, w) for x in xs]
            for blocks in _candidate_blocks(K):
                parts = _split(w, blocks)
                try:
                    if all(torch.equal(_blocked(x, parts, blocks), ref) for x, ref in zip(xs, refs)):
                        plan = blocks
                        break
                except RuntimeError as e:  # an op this build of oneDNN refuses: stay on F.linear
                    log.debug("oneDNN linear [%d, %d] blocks %s: %s", N, K, blocks, e)
                    break
    _PLANS[key] = plan
    return plan


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` (float32, no bias, on the CPU) whose forward runs oneDNN over the K blocks of
    :func:`linear_plan` where that equals ``F.linear`` bit for bit: inference (no autograd, not inside
    torch.compile, the thread count the plan was checked with), float32 input of at least :data:`MIN_ROWS`
    rows and :data:`MIN_OUTPUTS` rows x output features (padded to a multiple of :data:`ROW_BUCKET` rows);
    ``F.linear`` otherwise.
    Made by :meth:`from_linear`, sharing the original module's parameter. A multi-block plan keeps
    contiguous copies of the weight's column blocks, remade when the weight changes in place (its version
    counter) or is replaced."""

    blocks: tuple[int, ...]

    @classmethod
    def from_linear(cls, linear: nn.Linear, blocks: tuple[int, ...]) -> OneDNNLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        if isinstance(linear.weight, nn.Parameter):
            new.weight = linear.weight
        else:  # a plain tensor attribute (a loader may leave one): kept as it is
            object.__setattr__(new, "weight", linear.weight)
        new.register_parameter("bias", None)
        new.blocks = blocks
        new.threads = torch.get_num_threads()  # what linear_plan checked the blocks with
        new._parts_key = None
        new._parts: list[torch.Tensor] = []
        return new

    def _weight_parts(self) -> list[torch.Tensor]:
        w = self.weight
        if len(self.blocks) == 1:
            return [w]
        key = (w.data_ptr(), w._version)
        if key != self._parts_key:
            self._parts, self._parts_key = _split(w.detach(), self.blocks), key
        return self._parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor's own code (and no guard on the row count)
            return F.linear(x, self.weight)
        rows = x.numel() // self.in_features if x.dim() else 0
        if (rows < MIN_ROWS or rows * self.out_features < MIN_OUTPUTS or x.dtype != torch.float32
                or x.device.type != "cpu" or torch.is_grad_enabled()
                or torch.get_num_threads() != self.threads):
            return F.linear(x, self.weight)
        pad = -rows % ROW_BUCKET
        if not pad:
            return _blocked(x, self._weight_parts(), self.blocks)
        flat = F.pad(x.reshape(rows, self.in_features), (0, 0, 0, pad))  # a row's result is its own
        return _blocked(flat, self._weight_parts(), self.blocks)[:rows].view(*x.shape[:-1], self.out_features)


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` (in place) that is float32, on the CPU, without a bias and
    whose shape has a :func:`linear_plan` for an :class:`OneDNNLinear` sharing its weight. A multi-block plan
    needs the weight's version counter (which inference tensors lack): such a weight keeps ``F.linear``.
    Returns the number swapped."""
    swaps = []
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if (type(module) is not nn.Linear or module.bias is not None or w.dtype != torch.float32
                or w.device.type != "cpu"):
            continue
        blocks = linear_plan(module.out_features, module.in_features)
        if blocks is None or (len(blocks) > 1 and w.is_inference()):
            continue
        swaps.append((name, OneDNNLinear.from_linear(module, blocks)))
    for name, new in swaps:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return len(swaps)

"""Token checks for runs whose arithmetic differs by rounding (16-bit activations): two greedy runs of one
model may part ways where the model's top two tokens are nearly tied, and nowhere else.

For each request whose tokens differ from the reference run's, the gap at the first differing position: how
far the lower of the two tokens there (a, b) stands below the top logit, max - min(logit[a], logit[b]), over
the spread (max - min) of those logits, from a float32 cache-free forward of the model over the common
prefix. Both tokens must be near the float32 model's top (which bounds |logit[a] - logit[b]| too). A correct
16-bit run parts from another only where that gap is within its rounding noise; a bookkeeping error (a state
or history from the wrong step or slot) parts at any gap. Measured on the CPU
(tests/test_flashinfer_replay.py, the tiny M*MEM model, bf16 activations, float32 state, 12 requests x 30
tokens): the ring-layout replay parted from rewind once, at a gap of 0.009; with its ring bookkeeping
broken, 9 requests parted, at gaps up to 0.63.
"""

from __future__ import annotations

import torch

# the largest gap (fraction of the logit spread) at which a 16-bit run may part from another: about 3x the
# CPU's measured 0.009, for the GPU's other summation orders
TIE = 0.03


def divergence_gaps(model, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]
                    ) -> list[tuple[int, int, float]]:
    """(request, first differing generated position, gap) for each request whose ``got`` tokens differ from
    ``want`` (see the module docstring). ``model``: a float32 HybridLM (an Engine's ``model``); runs on its
    device, one cache-free forward per differing request. A run that stops earlier (one list a prefix of the
    other) parts at its end, with gap 1.0."""
    out = []
    device = next(model.parameters()).device
    for i, (prompt, x, y) in enumerate(zip(prompts, got, want)):
        if x == y:
            continue
        j = next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
        if j is None:
            out.append((i, min(len(x), len(y)), 1.0))
            continue
        ids = torch.tensor([prompt + y[:j]], device=device)
        with torch.no_grad():
            row = model.lm_logits(model(ids)).float()[0, -1]
        spread = (row.max() - row.min()).clamp(min=1e-12)
        out.append((i, j, round(float((row.max() - torch.minimum(row[x[j]], row[y[j]])) / spread), 4)))
    return out


def assert_parts_only_at_near_ties(model, prompts, got, want, name: str, tie: float = TIE) -> None:
    """AssertionError naming the requests of ``got`` that part from ``want`` at a gap above ``tie``."""
    gaps = divergence_gaps(model, prompts, got, want)
    wide = [g for g in gaps if g[2] > tie]
    assert not wide, (f"{name}: parts from the reference where the float32 model's top tokens are not tied "
                      f"(request, position, gap of the logit spread; at most {tie}): {wide}; all: {gaps}")

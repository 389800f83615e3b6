"""Tests of chapter 11's FlashAttention update (solutions/11_gpu_kernels_exercises.ipynb); the
kernel exercises are tested in ``ch11.py``.

* ``11.online_softmax_update``: FlashAttention's update of (m, l, acc) for one new block of keys,
  a plain function (no kernel), folded over the keys block by block: after every block the
  running maximum, sum of exponentials and weighted values must be those of all the keys seen so
  far, on blocks of uneven sizes and on scores large enough that ``exp`` overflows float32
  without the running maximum. The inputs must be left unchanged.
"""

from __future__ import annotations

import math

import torch

from ultrascale_grading import exercise


# ---- 11.online_softmax_update ----------------------------------------------------------------

ONLINE_CASES = [  # (rows, keys split into blocks, head dim, score scale)
    (1, [1], 1, 1.0),
    (3, [4, 4, 2], 5, 1.0),
    (8, [7, 7, 7, 3], 16, 2.0),
    (5, [5, 13, 1, 20], 3, 30.0),  # scores up to ~100: exp overflows fp32 without the running max
    (4, [16, 16], 8, 1.0),
]


def _fold(update, scores, values, splits):
    """Run the learner's update block by block; yield the state after each block."""
    rows, d = scores.shape[0], values.shape[1]
    m = torch.full((rows,), float("-inf"), dtype=scores.dtype)
    l = torch.zeros(rows, dtype=scores.dtype)
    acc = torch.zeros(rows, d, dtype=scores.dtype)
    start = 0
    for size in splits:
        s_block, v_block = scores[:, start : start + size], values[start : start + size]
        before = [t.clone() for t in (m, l, acc, s_block, v_block)]
        out = update(m, l, acc, s_block, v_block)
        if not (isinstance(out, (tuple, list)) and len(out) == 3):
            raise AssertionError(f"online_softmax_update must return (m_new, l_new, acc_new), got {type(out).__name__}")
        for name, old, now in zip(("m", "l", "acc", "s_block", "v_block"), before, (m, l, acc, s_block, v_block)):
            if not torch.equal(old, now):
                raise AssertionError(
                    f"online_softmax_update changed its input {name} in place: return new tensors instead"
                )
        m, l, acc = (torch.as_tensor(t) for t in out)
        start += size
        yield start, m, l, acc


@exercise("11.online_softmax_update", points=1)
def test_online_softmax_update(online_softmax_update, quick: bool = True, seed: int = 0):
    """After every block, (m, l, acc) must equal the statistics of all the keys seen so far."""
    gen = torch.Generator().manual_seed(seed + 60)
    for rows, splits, d, scale in ONLINE_CASES:
        n_keys = sum(splits)
        scores = scale * torch.randn(rows, n_keys, generator=gen)
        values = torch.randn(n_keys, d, generator=gen)
        if n_keys > 4:
            scores[0, 2] = float("-inf")  # a masked key (as causal masking makes), never in the first block alone
        where = f"{rows} row{'s' if rows > 1 else ''}, blocks of {splits} keys, head dim {d}, scores of size ~{scale:g}"
        for seen, m, l, acc in _fold(online_softmax_update, scores, values, splits):
            s = scores[:, :seen]
            m_ref = s.max(dim=1).values
            p = torch.exp(s - m_ref[:, None])
            l_ref, acc_ref = p.sum(dim=1), p @ values[:seen]
            at = f"{where}, after the first {seen} keys"
            assert tuple(m.shape) == (rows,) and tuple(l.shape) == (rows,) and tuple(acc.shape) == (rows, d), (
                f"{at}: shapes m {tuple(m.shape)}, l {tuple(l.shape)}, acc {tuple(acc.shape)}; "
                f"expected ({rows},), ({rows},), ({rows}, {d})"
            )
            assert torch.equal(m, m_ref), f"{at}: m must be the running maximum of the scores seen so far"
            if not torch.isfinite(l).all() or not torch.isfinite(acc).all():
                raise AssertionError(
                    f"{at}: l or acc is inf/NaN. Exponentiate s - m_new, never s itself, and "
                    "scale the old l and acc by exp(m - m_new)."
                )
            if not torch.allclose(l, l_ref, rtol=1e-5, atol=1e-6):
                raise AssertionError(
                    f"{at}: l should be sum(exp(s - m)) over the keys seen so far; largest "
                    f"difference {(l - l_ref).abs().max().item():.3g}. Exponentiate s_block - m_new "
                    "and rescale the old l by exp(m - m_new)."
                )
            if not torch.allclose(acc, acc_ref, rtol=1e-5, atol=1e-5):
                raise AssertionError(
                    f"{at}: acc should be exp(s - m) @ v over the keys seen so far (not yet "
                    f"divided by l); largest difference {(acc - acc_ref).abs().max().item():.3g}"
                )
        out = acc / l[:, None]
        expected = torch.softmax(scores, dim=1) @ values
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5), f"{where}: acc / l differs from softmax(s) @ v"
        assert math.isfinite(out.abs().max().item())

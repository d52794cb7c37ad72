"""Tensor primitives that several merge methods share.

Flat, pure functions in the style of peft's ``utils/merge_utils.py``: no method
objects, no statistics, no I/O; just the math on one tensor's task vectors. A
method module imports what it needs from here, never from a sibling method.

Conventions: ``stacked`` is the engine's ``(N, *shape)`` float32 stack of task
vectors, one row per input. A trailing underscore means *in place*: the function
overwrites its input (the engine hands the stack to the method to be consumed, which
keeps peak memory near N + 2 tensors) and returns it or a tensor built from it.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Iterator, Literal, Sequence, cast

import torch

# --- sums -------------------------------------------------------------------------------------


def weighted_average(deltas: torch.Tensor | Sequence[torch.Tensor], weights: Sequence[float],
                     normalize: bool = True) -> torch.Tensor:
    """Σ wᵢ τᵢ, divided by Σ wᵢ when ``normalize`` (the average of the models).

    Args:
        deltas: the task vectors τᵢ (a list, or the rows of a stack). The first one is
            multiplied out of place; the others are only read.
        weights: one weight wᵢ per task vector.
        normalize: divide by Σ wᵢ (a true weighted mean, the model soup); False gives the plain
            weighted sum (task arithmetic).

    Returns:
        A new tensor of the task vectors' shape.
    """
    out = deltas[0] * weights[0]  # not zeros + first term: one pass less over the tensor
    for w, d in zip(weights[1:], deltas[1:]):
        out.add_(d, alpha=w)
    if normalize:
        out.div_(sum(weights))
    return out


def task_arithmetic(deltas: torch.Tensor | Sequence[torch.Tensor], weights: Sequence[float], scale: float) -> torch.Tensor:
    """λ Σ wᵢ τᵢ: task arithmetic (Ilharco et al., 2023).

    Args:
        deltas: the task vectors τᵢ (only read).
        weights: one weight wᵢ per task vector inside the sum.
        scale: λ, applied to the sum.

    Returns:
        A new tensor of the task vectors' shape.
    """
    return weighted_average(deltas, weights, normalize=False).mul_(scale)


# --- magnitude trimming -----------------------------------------------------------------------


def kth_largest_abs(x: torch.Tensor, k: int) -> float:
    """The k-th largest |x| over every entry of ``x``.

    Args:
        x: any tensor (only read).
        k: the rank, 1 = the largest magnitude; k above ``x.numel()`` is clamped to it.

    Returns:
        The magnitude as a float; +inf for k ≤ 0 (a threshold that keeps nothing).
    """
    if k <= 0:
        return float("inf")
    k = min(k, x.numel())
    if x.numel() >= _RADIX_MIN and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
        # the radix select masks the sign bit off, so a float32 tensor needs no |x| copy
        mags = x if x.dtype == torch.float32 and x.is_contiguous() else x.abs().float().contiguous()
        return _radix_kth_largest(mags.reshape(-1), k)
    flat = x.abs().flatten()
    return float(torch.kthvalue(flat, flat.numel() - k + 1).values)


_RADIX_MIN = 1 << 16  # below this a full kthvalue is as cheap as two histograms


def _radix_kth_largest(mags: torch.Tensor, k: int) -> float:
    """The k-th largest magnitude of float32 ``mags`` (signs ignored), exactly, by radix select (as :mod:`._select`).

    A non-negative float32's bit pattern orders like its value: a histogram of the high 16 bits
    pins the bin holding the k-th largest, a histogram of the low 16 bits inside it the value.
    Two counting passes instead of :func:`torch.kthvalue`'s partial sort of a copy (~2x less CPU
    time on a 4096×4096 tensor); the same value, ties and zeros included.
    """
    b, rank = walk_from_top(high_half_histogram(mags), k)
    low, _ = walk_from_top(low_half_histogram(mags, b), rank)
    return float(torch.tensor([(b << 16) | low], dtype=torch.int32).view(torch.float32)[0])


# A float32's high 16 bits, read as the int16 upper half of the same bytes (no shift, no int32 copy): on
# a little-endian machine element 2i + 1 of the int16 view. ~3x cheaper to histogram than ``bits >> 16``
# (the select's passes are most of TIES' time). The sign is dropped by a float ``abs`` (one vectorised
# pass, ~6 % cheaper than masking the int16 halves).
_LITTLE = sys.byteorder == "little"


def high_half_histogram(x: torch.Tensor) -> torch.Tensor:
    """Counts of the high 16 bits of |x| (sign dropped: 2¹⁵ bins), over every entry of float32 ``x``."""
    if x.device.type != "cpu":  # bincount reads its input's maximum back (a sync): counted in place instead
        return high_half_counts(x)
    if _LITTLE and x.dtype == torch.float32 and x.is_contiguous():
        return torch.bincount(x.reshape(-1).abs().view(torch.int16)[1::2], minlength=1 << 15)
    return torch.bincount(x.detach().abs().float().contiguous().view(torch.int32).flatten() >> 16,
                          minlength=1 << 15)


def high_half_counts(x: torch.Tensor) -> torch.Tensor:
    """:func:`high_half_histogram` counted with ``index_add_`` on ``x``'s device: no read-back (the device path)."""
    hist = torch.zeros(1 << 15, dtype=torch.int64, device=x.device)
    flat = x.detach().reshape(-1)
    for a in range(0, flat.numel(), SELECT_CHUNK):
        _count_into(hist, flat[a:a + SELECT_CHUNK].abs().float().contiguous().view(torch.int32) >> 16)
    return hist


def low_half_values(x: torch.Tensor, high: int) -> torch.Tensor:
    """The low 16 bits (int32, 0..2¹⁶-1) of the entries of float32 ``x`` whose |x| has ``high`` as its high
    16 bits: few (one bin of 2¹⁵), so a model-wide select buffers them and counts once."""
    if _LITTLE and x.dtype == torch.float32 and x.is_contiguous():
        mags = x.reshape(-1).abs()
        return mags.view(torch.int32)[mags.view(torch.int16)[1::2] == high] & 0xFFFF
    bits = x.detach().abs().float().contiguous().view(torch.int32).flatten()
    return bits[(bits >> 16) == high] & 0xFFFF


def low_half_histogram(x: torch.Tensor, high: int) -> torch.Tensor:
    """Counts of the low 16 bits (2¹⁶ bins) of the entries of :func:`low_half_values`."""
    return torch.bincount(low_half_values(x, high), minlength=1 << 16)


def walk_from_top(hist: torch.Tensor, k: int) -> tuple[int, int]:
    """Bin holding the k-th largest element of a histogram, and its rank from the top inside that bin
    (both radix selects use it: this one per tensor, :mod:`._select`'s over the whole model)."""
    from_top = torch.flip(hist, [0]).cumsum(0)
    pos = int(torch.searchsorted(from_top, torch.tensor(k, dtype=from_top.dtype, device=from_top.device)))
    before = int(from_top[pos - 1]) if pos > 0 else 0
    return hist.numel() - 1 - pos, k - before


def _count_into(hist: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``hist[keys] += weights`` (1 each without), exact integer counts, no read-back (``bincount`` reads its
    input's maximum back to size its output: a device sync)."""
    ones = weights if weights is not None else torch.ones((), dtype=hist.dtype, device=keys.device).expand(keys.shape)
    return hist.index_add_(0, keys, ones)


SELECT_CHUNK = 1 << 24
"""Entries the device's radix select keys at once (its int32 temporaries: ~13 bytes an entry)."""


def _walk_from_top_t(hist: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`walk_from_top` with the answer left on the histogram's device (0-d int64 tensors)."""
    from_top = torch.flip(hist, [0]).cumsum(0)
    pos = torch.searchsorted(from_top, k.reshape(1)).reshape(())
    before = torch.where(pos > 0, from_top[(pos - 1).clamp(min=0)], torch.zeros_like(k))
    return hist.numel() - 1 - pos, k - before


def kth_largest_abs_t(x: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`kth_largest_abs` (k ≥ 1) as a float32 0-d tensor on ``x``'s device, never read back: the same
    exact radix select, its histograms counted with ``index_add_`` (int32 keys, a chunk at a time) and walked
    on the device. An accelerator's TIES ranks its rows with it (no host round-trip per row).

    Example:
        >>> x = torch.tensor([0.5, -3.0, 2.0, 2.0, -0.1])
        >>> [float(kth_largest_abs_t(x, k)) for k in (1, 2, 3, 4)] == [kth_largest_abs(x, k) for k in (1, 2, 3, 4)]
        True
    """
    k = min(max(k, 1), x.numel())
    if DEVICE_SELECT == "topk":
        return _kth_largest_abs_topk(x, k)
    flat, dev = x.detach().reshape(-1), x.device

    def chunks() -> Iterator[torch.Tensor]:
        for a in range(0, flat.numel(), SELECT_CHUNK):  # |x|'s bits: the sign bit is 0
            yield flat[a:a + SELECT_CHUNK].abs().float().contiguous().view(torch.int32)

    high_hist = torch.zeros(1 << 15, dtype=torch.int32, device=dev)  # < 2³¹ entries: int32 counts are exact
    for bits in chunks():
        _count_into(high_hist, bits >> 16)
    b, rank = _walk_from_top_t(high_hist.long(), torch.tensor(k, dtype=torch.int64, device=dev))
    # the low halves of the entries in bin b, each counted 1 (the others 0: no one bin takes every entry)
    low_hist = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    for bits in chunks():
        _count_into(low_hist, bits & 0xFFFF, ((bits >> 16) == b).int())
    low, _ = _walk_from_top_t(low_hist.long(), rank)
    return ((b << 16) | low).to(torch.int32).view(torch.float32)


def _kth_largest_abs_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`kth_largest_abs_t` by the device's own selection: the k largest |x| (``torch.topk``, unsorted: a
    multi-block radix select on CUDA, per-block counts in shared memory) hold the k-th largest as their
    minimum, exactly; past the middle the smaller side is selected instead (fewer values gathered)."""
    mags = x.detach().reshape(-1).abs().float()
    n = mags.numel()
    if k <= n - k + 1:
        return torch.topk(mags, k, sorted=False).values.min()
    return torch.topk(mags, n - k + 1, largest=False, sorted=False).values.max()


DEVICE_SELECT = os.environ.get("HUBSOUP_DEVICE_SELECT", "topk")
"""How an accelerator selects a k-th largest magnitude (:func:`kth_largest_abs_t`): ``"topk"`` (the device's
own selection) or ``"histogram"`` (two radix passes counted with ``index_add_``: global atomics on a few hot
bins). Both are exact; the environment variable is a measurement aid (``benchmarks/bench_gpu.py``)."""


TieRule = Literal["keep_ties", "first_index", "mergekit_sort", "mergekit_topk"]
"""Which entries a top-k trim keeps when magnitudes tie at the k-th largest (:func:`topk_mask`, :func:`keep_topk_`):

* ``"keep_ties"``: every entry with |x| ≥ the k-th largest magnitude: k or more (the TIES paper's trim). The one
  rule a piece of a tensor can apply alone, given the whole tensor's (or model's) threshold.
* ``"first_index"``: exactly k; of the entries tying at the cut-off, the lowest flat indices (SFTM: an exact
  count, reruns identical).
* ``"mergekit_sort"``: exactly k; of the tied entries, those ``torch.argsort(|x|, descending=True)`` puts first:
  the sort mergekit's magnitude pruning calls, so ties fall as in its output.
* ``"mergekit_topk"``: exactly k; of the tied entries, those ``torch.topk(|x|, k)`` returns, in ``x``'s own dtype:
  the call mergekit's SCE makes on the variances, so ties fall as in its output.
"""


def topk_mask(x: torch.Tensor, k: int | None = None, *, ties: TieRule,
              threshold: "float | torch.Tensor | None" = None) -> torch.Tensor:
    """Boolean mask (``x``'s shape) of the ``k`` largest magnitudes of ``x``, ties at the cut-off by ``ties``.

    The one top-k trim: TIES' trim, mergekit's magnitude pruning, SFTM's trim and SCE's selection of the
    highest-variance entries are this with their tie rule.

    Args:
        x: any tensor (only read).
        k: how many to keep; ≤ 0 keeps none, ≥ ``x.numel()`` all.
        ties: the :data:`TieRule`.
        threshold: ``"keep_ties"`` only, instead of ``k``: the k-th largest magnitude already known (a model-wide
            or a whole tensor's, for a piece); keeps |x| ≥ threshold.

    Example:
        >>> x = torch.tensor([3.0, -1.0, 1.0, 0.5, 1.0])
        >>> [topk_mask(x, 2, ties=t).tolist() for t in ("keep_ties", "first_index")]
        [[True, True, True, False, True], [True, True, False, False, False]]
    """
    if threshold is not None or ties == "keep_ties":
        if ties != "keep_ties":
            raise ValueError(f"a threshold keeps every tie: ties='keep_ties', not {ties!r}")
        if threshold is None:
            if _k(k) <= 0 or _k(k) >= x.numel():
                return torch.full_like(x, _k(k) > 0, dtype=torch.bool)
            threshold = _kth_largest_abs_on(x, _k(k))
        return x.abs() >= threshold
    n, k = x.numel(), _k(k)
    if k >= n or k <= 0:
        return torch.full_like(x, k > 0, dtype=torch.bool)
    if ties == "first_index":
        t = _kth_largest_abs_on(x, k)  # on an accelerator a device scalar: one read-back below, not four
        mag = x.reshape(-1).abs()
        keep = mag > t
        need = k - int(keep.sum())
        if need > 0:
            keep[torch.nonzero(mag == t).flatten()[:need]] = True
        return keep.reshape(x.shape)
    if ties == "mergekit_sort":
        a = x.abs().flatten().float()
        top = torch.topk(a, k, sorted=False)
        mask = torch.zeros(n, dtype=torch.bool, device=x.device)
        if int((a >= top.values.min()).sum()) == k:  # no tie at the cut-off: the top k, whoever picks them
            mask[top.indices] = True
        else:  # equal magnitudes at the cut-off: keep those mergekit keeps, by calling the sort it calls
            mask[torch.argsort(a, descending=True)[:k]] = True
        return mask.reshape(x.shape)
    if ties == "mergekit_topk":
        mask = torch.zeros(n, dtype=torch.bool, device=x.device)
        mask[torch.topk(x.abs().flatten(), k).indices] = True
        return mask.reshape(x.shape)
    raise ValueError(f"unknown tie rule {ties!r} (one of keep_ties, first_index, mergekit_sort, mergekit_topk)")


def keep_topk_(x: torch.Tensor, k: int | None = None, *, ties: TieRule,
               threshold: "float | torch.Tensor | None" = None) -> torch.Tensor:
    """In place: :func:`topk_mask`'s entries of ``x`` kept, the rest 0. Returns ``x``.

    ``"keep_ties"`` on a float32 CPU tensor is one fused ``hardshrink`` (no mask); on an accelerator its k-th
    largest is selected on the device (:func:`kth_largest_abs_t`): no value read back.

    Example:
        >>> keep_topk_(torch.tensor([3.0, -1.0, 1.0, 0.5]), 2, ties="keep_ties").tolist()
        [3.0, -1.0, 1.0, 0.0]
    """
    if ties == "keep_ties" and threshold is None:
        if _k(k) >= x.numel():
            return x
        if _k(k) <= 0 and x.device.type != "cpu":
            return x.zero_()
        threshold = _kth_largest_abs_on(x, _k(k))
    if (ties == "keep_ties" and not isinstance(threshold, torch.Tensor) and x.dtype == torch.float32
            and x.device.type == "cpu"):
        # hardshrink zeroes |x| <= lambd in one fused pass (no |x| and mask temporaries, ~4x faster);
        # at lambd = the float32 just below t that is exactly |x| < t
        t = torch.tensor(threshold, dtype=torch.float32)
        below = torch.nextafter(t, torch.zeros((), dtype=torch.float32))
        return torch.hardshrink(x, float(below), out=x)
    if ties == "keep_ties":
        return x.masked_fill_(x.abs() < cast("float | torch.Tensor", threshold), 0.0)  # set above when not given
    if _k(k) <= 0:
        return x.zero_()
    if _k(k) >= x.numel():
        return x
    return x.masked_fill_(~topk_mask(x, k, ties=ties), 0.0)


def _k(k: int | None) -> int:
    if k is None:
        raise ValueError("a top-k trim needs k (or, keeping ties, a threshold)")
    return k


def _kth_largest_abs_on(x: torch.Tensor, k: int) -> "float | torch.Tensor":
    """The k-th largest |x|: a float on the CPU (+inf for k ≤ 0: keeps nothing), a 0-d tensor on an accelerator."""
    return kth_largest_abs(x, k) if x.device.type == "cpu" else kth_largest_abs_t(x, k)


def trim_(stacked: torch.Tensor, thresholds: Sequence[float]) -> torch.Tensor:
    """In place: row i keeps the entries with |x| ≥ thresholds[i], the rest become 0 (TIES' trim step:
    :func:`keep_topk_` with ``"keep_ties"`` and each row's threshold).

    Args:
        stacked: the ``(N, *shape)`` stack; overwritten.
        thresholds: one magnitude per row; a threshold ≤ 0 leaves its row untouched.

    Returns:
        ``stacked``.
    """
    for row, t in zip(stacked, thresholds):
        if t > 0:
            keep_topk_(row, ties="keep_ties", threshold=t)
    return stacked


# --- sign election and disjoint merge (TIES) --------------------------------------------------


def elect_sign(stacked: torch.Tensor, majority: float | None = None) -> torch.Tensor:
    """The sign of the summed mass per entry; entries summing to 0 take the majority sign.

    Args:
        stacked: the ``(N, *shape)`` stack (only read).
        majority: the majority sign, when known (a piece of a tensor: the whole tensor's).

    Returns:
        A new tensor of ±1 of the rows' shape; the majority sign is that of the sum of the
        elected signs (+1 on a tie).
    """
    sign = stacked.sum(dim=0).sign_()
    if majority is None:
        if sign.device.type != "cpu":  # on an accelerator the majority stays there (+1 on a tie, as below)
            total = sign.sum()
            return _fill_ties_(sign, torch.where(total >= 0, 1.0, -1.0).to(sign.dtype))
        majority = 1.0 if float(sign.sum()) >= 0 else -1.0
    return _fill_ties_(sign, majority)


def cache_step(rows: torch.Tensor) -> int:
    """Columns of the ``(N, k)`` ``rows`` that a fused sweep takes at once: on the CPU a block that stays in
    the cache while its passes run (every entry sees the same operations in the same order, so the result does
    not depend on it); on an accelerator the whole width, since there each pass is a kernel launch and a block
    would turn one launch into hundreds."""
    if rows.device.type != "cpu":
        return max(1, rows.shape[1])
    return max(1 << 14, (1 << 19) // max(rows.shape[0], 1))


def _fill_ties_(sign: torch.Tensor, majority: "float | torch.Tensor") -> torch.Tensor:
    """In place: the zeros of a tensor of signs (-1, 0, 1) take ``majority`` (±1): sign(sign + majority/2)
    keeps ±1 and turns 0 into the majority, in two cheap passes (not a mask fill)."""
    return sign.add_(0.5 * majority).sign_()


def disjoint_merge_(stacked: torch.Tensor, sign: torch.Tensor, mode: str = "mean") -> torch.Tensor:
    """Sum (or mean) over the rows of the non-zero entries that agree with ``sign``.

    Args:
        stacked: the ``(N, *shape)`` stack; overwritten.
        sign: the elected sign per entry (±1), e.g. from :func:`elect_sign`.
        mode: ``"mean"`` divides each entry by the number of agreeing rows (the TIES paper's
            disjoint mean), ``"sum"`` does not (the dis-sum variant).

    Returns:
        A tensor of the rows' shape; 0 where no row agrees.
    """
    n = stacked.shape[0]
    rows = stacked.reshape(n, -1)
    signs = sign.reshape(-1)
    out = torch.empty(signs.shape, dtype=rows.dtype, device=rows.device)
    # column blocks that stay in the CPU cache while their ~6 passes run (~2.5x faster than whole rows); every
    # entry sees the same operations in the same order, so the result does not depend on the block. (Blocks as
    # large as the engine's pieces measured no faster and +150-250 MB peak RSS on the 1B TIES merge.)
    step = cache_step(rows)
    for a in range(0, rows.shape[1], step):
        block, s = rows[:, a:a + step], signs[a:a + step]
        # times the elected sign, agreeing entries are > 0; clamping drops the rest (and zeros)
        block.mul_(s).clamp_(min=0)
        total = torch.sum(block, 0, out=out[a:a + step])
        if mode != "sum":  # the agreeing rows, counted as Σ sign (≥ 0 here): ~4x faster than count_nonzero
            total.div_(torch.sign(block).sum(0).clamp_(min=1.0))
        total.mul_(s)
    return out.view(sign.shape)


def ties_combine_(stacked: torch.Tensor, weights: Sequence[float] | None, mode: str = "mean",
                  majority: float | None = None,
                  observe: Callable[[float, bool], None] | None = None) -> torch.Tensor:
    """Elect signs on the (already trimmed) rows, then weight them and merge disjointly.

    Signs are elected on the unweighted rows, as peft's ``merge_utils.ties`` does
    (the TIES paper has no per-model weights).

    Args:
        stacked: the ``(N, *shape)`` stack, trimmed or sparsified; overwritten.
        weights: one weight per row, applied after the sign election (None: no weighting).
        mode: ``"mean"`` or ``"sum"``, as in :func:`disjoint_merge_`.
        majority: as in :func:`elect_sign`.
        observe: with a (provisional) ``majority``, called with the sum of the entries' own signs
            (what the majority sign is the sign of) and whether the result used ``majority``: some
            entry's rows sum to 0 and are not all 0. A tensor merged in pieces learns its majority
            sign this way in the merge sweep itself.

    Returns:
        The merged task vector, of the rows' shape.
    """
    if observe is None:
        sign = elect_sign(stacked, majority)
    else:  # elect_sign, counting what observe needs (the same operations: the same result)
        sign = stacked.sum(dim=0).sign_()
        # counts as sums of 0 and ±1 over a piece (< 2²⁴ entries: exact in float32): branch-free, where
        # masks or count_nonzero on scattered zeros cost ~10x more
        own, decided = float(sign.sum()), float(sign.abs().sum())  # decided: entries not summing to 0
        # entries with a non-zero row; a weight of 0 can zero a result, so counted before weighting
        touched = None if weights is None else float(stacked.abs().sum(0).sign_().sum())
        _fill_ties_(sign, cast(float, majority))  # observe comes with a provisional majority
    if weights is not None:
        for row, w in zip(stacked, weights):
            row.mul_(w)
    out = disjoint_merge_(stacked, sign, mode)
    if observe is not None:
        if touched is None:  # unweighted: a result is non-zero exactly where some row is (one agrees)
            touched = float(torch.sign(out).abs_().sum())
        # the entries with a non-zero row that do not count as decided summed to 0: a tie took the majority
        observe(own, touched > decided)
    return out

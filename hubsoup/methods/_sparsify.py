"""Sparsification and the generalized task-arithmetic combine, with mergekit's conventions.

The community's DARE / TIES / Model Breadcrumbs / DELLA merges are, in mergekit, one
pipeline (``generalized_task_arithmetic``): sparsify each task vector τᵢ on its own
tensor, weight it, optionally keep only the entries agreeing with the elected sign, sum,
optionally divide by the summed weights, scale by λ. This module holds that pipeline's
pieces as pure functions, written from the definitions below (no code is shared with
mergekit):

* :func:`magnitude_mask`: the top ``k = max(1, int(density · n))`` magnitudes (a positive
  density keeps at least one entry), exactly k entries however magnitudes tie (:func:`~._kernels.topk_mask`,
  tie rule ``"mergekit_sort"``).
* :func:`outliers_mask` (Model Breadcrumbs): drop the ``int(gamma · n)`` largest magnitudes
  and the smallest, keeping ``int(density · n)`` (fewer outliers dropped when both do not fit).
* :func:`counter_mask` (DARE, mergekit's convention): keep each entry with probability ``density``,
  drawn by :func:`counter_bits` — the same masks on every device.
* :func:`della_mask` (DELLA's MagPrune): keep probabilities rising linearly with the
  magnitude rank along dim 1 (the whole vector for 1-D tensors), from density − ε
  (smallest) to density + ε (largest).
* :func:`rescale_to_norm_`: rescale kept entries so the task vector keeps its L1 norm
  (mergekit's ``rescale``), instead of the DARE paper's 1/(1 − p).
* :func:`gta_combine_`: weights, optional sign consensus (signs elected on the *weighted*
  deltas, ties at 0 counted positive), sum, division by the summed (agreeing) weights when
  ``normalize``, λ.

Randomness comes from the caller's seed (the recipe hash and the tensor name): masks equal
mergekit's in distribution, not bit for bit.

**The same masks on every device.** torch's CPU and CUDA generators give different streams, and
drawing a mask on the CPU to merge on a GPU costs more than the merge. :func:`counter_bits` is a
counter-based generator instead, drawn in blocks of :data:`MASK_BLOCK` = 2¹⁶ entries: block b's key K_b is a
hash of (seed, b) — two rounds of the ``lowbias32`` integer mixer (C. Wellons' hash-prospector) keyed by the
seed's two halves — and entry j = b·2¹⁶ + t draws ``lowbias32(t ^ K_b)``, keeping its top 24 bits: one round
per entry, in int32 tensor ops (two's complement: products wrap modulo 2³² alike on every device; a right
shift is made logical by a mask). The draws of a piece depend only on the entries' indices, so a tensor
merged whole, in pieces, on the CPU or on a GPU gets one mask. On the CPU :func:`counter_keep_` applies the
same draws without a boolean mask. (Before 0.2 every entry took both keyed rounds, ~2x the work; before
that, DARE's mergekit convention drew each block from a CPU ``torch.Generator``: outputs of those versions
differ, in distribution the same.)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch

from hubsoup.linalg import block_sums
from hubsoup.methods._kernels import cache_step, topk_mask
from hubsoup.methods._params import param

if TYPE_CHECKING:
    from hubsoup.methods._base import TensorContext


def magnitude_mask(x: torch.Tensor, density: float) -> torch.Tensor | None:
    """Boolean mask of the top ``max(1, int(density · n))`` entries of |x| (None: keep all).

    Example:
        >>> magnitude_mask(torch.tensor([0.1, -3.0, 2.0, 0.5]), 0.5).tolist()
        [False, True, True, False]
        >>> magnitude_mask(torch.tensor([0.1, -3.0, 2.0]), 0.1).tolist()   # keeps at least one
        [False, True, False]
    """
    if density >= 1:
        return None
    return topk_mask(x, max(1, int(density * x.numel())) if density > 0 else 0, ties="mergekit_sort")


def outliers_mask(x: torch.Tensor, density: float, gamma: float) -> torch.Tensor | None:
    """Model Breadcrumbs' mask: drop the ``int(gamma·n)`` largest and the smallest |x|, keep ``int(density·n)``.

    In ascending order of magnitude, entries ``[n_bot, n_bot + k)`` are kept with
    ``k = int(density·n)`` and ``n_bot = max(0, n − k − int(gamma·n))``: when density + gamma > 1
    fewer outliers are dropped so that k entries remain. ``density >= 1`` keeps everything
    (gamma is then not applied). None: keep all.

    Example:
        >>> outliers_mask(torch.tensor([5.0, 1.0, -4.0, 2.0, 3.0]), 0.6, 0.2).tolist()
        [False, False, True, True, True]
    """
    if density >= 1:
        return None
    n = x.numel()
    k = int(density * n)
    n_top = int(gamma * n)
    n_bot = max(0, n - k - n_top)
    order = torch.sort(x.abs().flatten().float()).indices  # the sort mergekit calls: ties fall as in its output
    mask = torch.zeros(n, dtype=torch.bool, device=x.device)
    mask[order[n_bot:n_bot + k]] = True
    return mask.reshape(x.shape)


MASK_BLOCK = 1 << 16
"""Entries drawn from one key (:func:`counter_bits`; :func:`bernoulli_mask`: one generator); pieces of a tensor
whose masks are drawn start at a multiple of it."""

_M32 = 0xFFFFFFFF
COUNTER_CHUNK = 1 << 20
"""Entries hashed at once by :func:`counter_bits` (bounds its temporaries)."""
DEVICE_COUNTER_CHUNK = 1 << 24
"""The same on an accelerator (64 MiB temporaries): fewer, larger launches (each op is one)."""


def _int32(word: int) -> int:
    """A 32-bit word as the int32 with the same bits."""
    word &= _M32
    return word - (1 << 32) if word >= 1 << 31 else word


def _shift_xor_(x: torch.Tensor, tmp: torch.Tensor, k: int) -> None:
    """``x ^= x >> k`` on 32-bit words held as int32 (``tmp``: a buffer like ``x``), the shift logical."""
    torch.bitwise_right_shift(x, k, out=tmp).bitwise_and_((1 << (32 - k)) - 1)
    x ^= tmp


def _lowbias32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """In place on 32-bit words held as int32: C. Wellons' ``lowbias32`` mixer (a bijection of 32-bit words).
    int32 arithmetic: ~3.5x faster on the CPU than the same words in int64 (native 32-bit multiplies, half the
    bytes), and the same bits (``tests/methods/test_mergekit_methods.py`` holds it to a Python reference)."""
    _shift_xor_(x, tmp, 16)
    x.mul_(_int32(0x7FEB352D))  # wraps modulo 2³²: the low 32 bits of the product, exact
    _shift_xor_(x, tmp, 15)
    x.mul_(_int32(0x846CA68B))
    _shift_xor_(x, tmp, 16)
    return x


def lowbias32(x: int) -> int:
    """:func:`_lowbias32_` of one 32-bit word, in Python integers (the block keys; the tests' reference)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def block_key(seed: int, block: int) -> int:
    """K_b of :func:`counter_bits`: two keyed rounds of ``lowbias32`` over the block's index (modulo 2³²)."""
    return lowbias32(lowbias32((block & _M32) ^ (seed & _M32)) ^ ((seed >> 32) & _M32))


def _block_keys(seed: int, first: int, n: int, device: str | torch.device) -> torch.Tensor:
    """:func:`block_key` of blocks ``first`` … ``first + n − 1`` as int32 words, computed on ``device`` (no copy
    from the host on an accelerator)."""
    x = torch.arange(first, first + n, dtype=torch.int64, device=device).bitwise_and_(_M32)
    x = x.bitwise_xor_(seed & _M32).to(torch.int32)  # the int64 → int32 cast keeps the low 32 bits
    tmp = torch.empty_like(x)
    _lowbias32_(x, tmp)
    x ^= _int32((seed >> 32) & _M32)
    return _lowbias32_(x, tmp)


def counter_bits(seed: int, start: int, count: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """24 random bits (int32 in [0, 2²⁴)) for entries ``start`` … ``start + count − 1`` of the stream ``seed``:
    entry j = b·2¹⁶ + t draws the top 24 bits of ``lowbias32(t ^ K_b)``, K_b = :func:`block_key` (seed, b); the
    same values on any device, whatever the chunking.

    Example:
        >>> a = counter_bits(7, 0, 6)
        >>> torch.equal(a[2:], counter_bits(7, 2, 4)), bool((a >= 0).all() and (a < 2 ** 24).all())
        (True, True)
        >>> int(a[3]) == lowbias32(3 ^ block_key(7, 0)) >> 8
        True
    """
    if count <= 0:
        return torch.empty(0, dtype=torch.int32, device=device)
    first, last = start // MASK_BLOCK, (start + count - 1) // MASK_BLOCK
    keys = _block_keys(seed, first, last + 1 - first, device)
    j = torch.arange(start, start + count, dtype=torch.int64, device=device)
    tmp = j.bitwise_and(MASK_BLOCK - 1).to(torch.int32)  # t, each entry's place in its block
    x = keys[j.bitwise_right_shift_(MASK_BLOCK.bit_length() - 1).sub_(first)]  # each entry's block key
    del j
    x ^= tmp  # t ^ K_b
    _lowbias32_(x, tmp)
    return torch.bitwise_right_shift(x, 8, out=tmp).bitwise_and_((1 << 24) - 1)


def counter_mask(numel: int, density: float, seed: int, offset: int = 0,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """Keep each of ``numel`` entries (those from ``offset`` of the flattened tensor) with probability
    ``density``: a flat boolean mask on ``device``, the same on every device (see the module doc).

    Entry j is kept when its 24 bits are below ``round(density · 2²⁴)``: an integer comparison, exact.

    Example:
        >>> m = counter_mask(100_000, 0.3, seed=1)
        >>> round(float(m.float().mean()), 2), torch.equal(m[4096:], counter_mask(100_000 - 4096, 0.3, 1, 4096))
        (0.3, True)
    """
    threshold = int(round(density * (1 << 24)))
    out = torch.empty(numel, dtype=torch.bool, device=device)
    chunk = COUNTER_CHUNK if torch.device(device).type == "cpu" else DEVICE_COUNTER_CHUNK
    for a in range(0, numel, chunk):
        k = min(chunk, numel - a)
        torch.lt(counter_bits(seed, offset + a, k, device), threshold, out=out[a:a + k])
    return out


_IOTA: list[torch.Tensor] = []


def counter_keep_(x: torch.Tensor, density: float, seed: int, offset: int = 0) -> torch.Tensor:
    """In place, on the CPU: the entries of the contiguous ``x`` (entries ``offset`` … of the flattened tensor) that
    :func:`counter_mask` drops set to +0.0, the others left as they are (``masked_fill_`` with the mask's
    complement, bit for bit; ``tests/methods/test_device_kernels.py`` holds them equal). ~3x cheaper: one block at a time
    (its int32 temporaries stay in a core's L2 cache while the hash's ~15 passes run), the entries' t a cached
    0, 1, 2, …, and the decision a word of all ones or all zeros (the sign of bits − T, T = round(density·2²⁴))
    ANDed into the float's bits: no boolean tensor (``masked_fill_`` with one takes ~1.8 ns an entry).

    Example:
        >>> x = torch.ones(100_000)
        >>> torch.equal(counter_keep_(x, 0.3, seed=1, offset=64).bool(), counter_mask(100_000, 0.3, 1, 64))
        True
    """
    threshold = int(round(density * (1 << 24)))
    if threshold >= 1 << 24:
        return x
    if x.dtype != torch.float32 or not x.is_contiguous():
        return x.masked_fill_(~counter_mask(x.numel(), density, seed, offset).view(x.shape), 0)
    words = x.view(-1).view(torch.int32)
    if not _IOTA:
        _IOTA.append(torch.arange(MASK_BLOCK, dtype=torch.int32))
    iota = _IOTA[0]
    n = words.numel()
    h = torch.empty(min(n, MASK_BLOCK), dtype=torch.int32)
    tmp = torch.empty_like(h)
    a = 0
    while a < n:
        j = offset + a
        t = j % MASK_BLOCK
        k = min(MASK_BLOCK - t, n - a)  # to the end of this block
        hk, tk = h[:k], tmp[:k]
        torch.bitwise_xor(iota[t:t + k], _int32(block_key(seed, j // MASK_BLOCK)), out=hk)
        _lowbias32_(hk, tk)
        torch.bitwise_right_shift(hk, 8, out=tk).bitwise_and_((1 << 24) - 1).sub_(threshold)
        words[a:a + k].bitwise_and_(tk.bitwise_right_shift_(31))  # bits < T: all ones (kept), else 0
        a += k
    return x


def bernoulli_mask(numel: int, density: float, generator_for: Callable[[int], torch.Generator],
                   offset: int = 0) -> torch.Tensor:
    """Keep each of ``numel`` entries with probability ``density``: a flat CPU mask.

    Block j of the flattened tensor (:data:`MASK_BLOCK` entries from ``j · MASK_BLOCK``) is drawn from
    ``generator_for(j)``, so the entries from ``offset`` (a multiple of the block) get what the whole
    tensor's mask has there: a tensor merged in pieces draws the same mask, piece by piece, in any order.

    Example:
        >>> gen = lambda j: torch.Generator().manual_seed(j)
        >>> whole = bernoulli_mask(3 * MASK_BLOCK, 0.3, gen)
        >>> torch.equal(whole[MASK_BLOCK:], bernoulli_mask(2 * MASK_BLOCK, 0.3, gen, offset=MASK_BLOCK))
        True
    """
    out = torch.empty(numel, dtype=torch.bool)
    for a in range(0, numel, MASK_BLOCK):
        k = min(MASK_BLOCK, numel - a)
        torch.lt(torch.rand(k, generator=generator_for((offset + a) // MASK_BLOCK)), density, out=out[a:a + k])
    return out


def della_probabilities(x: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """DELLA's keep probabilities: density − ε + 2ε · rank/(n − 1), ranks of |x| along dim 1.

    A 1-D tensor is one row; rows of one entry get density − ε. Returned in x's shape.

    Example:
        >>> [round(p, 6) for p in della_probabilities(torch.tensor([0.3, -1.0, 0.1]), 0.5, 0.2).tolist()]
        [0.5, 0.7, 0.3]
    """
    m = x.abs().float()
    if m.dim() < 2:
        m = m.unsqueeze(0)
    n = m.shape[1]
    ranks = torch.argsort(torch.argsort(m, dim=1, stable=True), dim=1).to(torch.float32)
    norm = ranks / (n - 1) if n > 1 else torch.zeros_like(ranks)
    return ((density - epsilon) + norm * (2 * epsilon)).reshape(x.shape)


def della_mask(x: torch.Tensor, density: float, epsilon: float, generator: torch.Generator) -> torch.Tensor:
    """A DELLA (MagPrune) mask: entry j kept with :func:`della_probabilities`'s probability."""
    probs = della_probabilities(x, density, epsilon).to(generator.device)
    return torch.bernoulli(probs, generator=generator).to(device=x.device, dtype=torch.bool)


def apply_mask_(row: torch.Tensor, mask: torch.Tensor | None, rescale: bool, eps: float = 1e-7) -> torch.Tensor:
    """In place: zero ``row`` outside ``mask``; with ``rescale``, restore its L1 norm (see :func:`rescale_to_norm_`)."""
    if mask is None:
        return row
    before = l1_norm(row) if rescale else 0.0
    row.masked_fill_(~mask, 0.0)
    return rescale_to_norm_(row, before, eps) if rescale else row


def l1_norm(x: torch.Tensor) -> float:
    """‖x‖₁ in float64, the exactly rounded sum of block sums: the same whole or summed over pieces
    (:func:`hubsoup.linalg.block_sums`)."""
    return math.fsum(block_sums(x, absolute=True))


def rescale_to_norm_(row: torch.Tensor, before: float, eps: float = 1e-7, after: float | None = None) -> torch.Tensor:
    """In place: multiply ``row`` by ``before / ‖row‖₁`` (left alone when either norm is below ``eps``).

    mergekit's ``rescale``: the sparsified task vector keeps the L1 norm it had, whatever
    the kept fraction turned out to be. ``after``: ‖row‖₁ when ``row`` is a piece of the vector (both
    norms then the whole vector's).
    """
    after = l1_norm(row) if after is None else after
    if before < eps or after < eps:
        return row
    return row.mul_(before / after)


def gta_combine_(stacked: torch.Tensor, weights: Sequence[float], *, consensus: bool, normalize: bool,
                 scale: float = 1.0) -> torch.Tensor:
    """mergekit's generalized task arithmetic on already sparsified rows.

    ``d = wᵢ·τᵢ``; with ``consensus`` keep the entries whose sign equals the elected sign
    ``sign(Σᵢ dᵢ)`` (+ where the sum is 0; zeros never agree), ``merged = Σ kept d``,
    divided (``normalize``) by Σ of the agreeing entries' weights (0 → 1); without consensus
    ``merged = Σ d``, divided by Σ wᵢ (|Σw| < 1e-8 → 1). Then λ·merged.

    Args:
        stacked: the ``(N, *shape)`` stack, sparsified; overwritten.
        weights: one weight per row.

    Example:
        >>> s = torch.tensor([[1.0, -2.0], [3.0, 1.0]])
        >>> [round(v, 6) for v in gta_combine_(s, [1.0, 0.5], consensus=True, normalize=True).tolist()]
        [1.666667, -2.0]
    """
    w = torch.tensor(list(weights), dtype=stacked.dtype, device=stacked.device).reshape(-1, *[1] * (stacked.dim() - 1))
    stacked.mul_(w)
    if consensus:
        n = stacked.shape[0]
        rows, wcol = stacked.reshape(n, -1), w.reshape(n, 1)
        merged = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
        # float passes over column blocks that stay in cache, no boolean masks (~3x faster); every entry sees
        # the same operations: Σ of the agreeing dᵢ is sign · Σ |dᵢ| over them, exactly (negation is exact)
        step = cache_step(rows)
        for a in range(0, rows.shape[1], step):
            block, out = rows[:, a:a + step], merged[a:a + step]
            elected = block.sum(0).sign_().add_(0.5).sign_()  # the sum's sign, + where it is 0
            block.mul_(elected).clamp_(min=0)  # agreeing entries (> 0 here) kept, the rest 0
            if normalize:
                divisor = torch.sign(block).mul_(wcol).sum(0)  # Σ of the agreeing entries' weights
                divisor.add_(1.0 - divisor.abs().sign())  # 0 → 1
            torch.sum(block, 0, out=out).mul_(elected)
            if normalize:
                out.div_(divisor)
        merged = merged.view(stacked.shape[1:])
    else:
        merged = stacked.sum(dim=0)
        if normalize:
            total = float(sum(weights))
            merged.div_(1.0 if abs(total) < 1e-8 else total)
    return merged.mul_(scale) if scale != 1 else merged


COMPUTE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ComputeDtype = Literal["float32", "float16", "bfloat16", "inputs"]


def compute_dtype_param(when: str = "") -> Any:
    """The ``compute_dtype`` parameter of a method mergekit computes in its config's dtype (recorded only when set,
    so adding it changed no earlier recipe's hash)."""
    return param("float32", f"{when}the dtype every step is computed in, as mergekit computes in its config's dtype "
                            "(inputs: the stored dtype); hubsoup's own merges compute in float32",
                 source="mergekit", recorded_when_set=True)


def compute_dtype(name: str, ctx: TensorContext) -> torch.dtype:
    """The dtype mergekit computes a tensor in: the config's ``dtype``, or with ``inputs`` the stored one."""
    if name == "inputs":
        return ctx.dtype if ctx.dtype in (torch.float16, torch.bfloat16) else torch.float32
    return COMPUTE_DTYPES[name]


def random_work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype mergekit's random sparsifiers (DARE's ``bernoulli``, DELLA's ``della_magprune``) mask and rescale
    a ``dtype`` task vector in on the CPU: float32 for float16 (torch has no float16 ``bernoulli`` there), else
    ``dtype`` itself; the result is cast back to ``dtype``."""
    return torch.float32 if dtype == torch.float16 else dtype


def gta_in_dtype(base: torch.Tensor, deltas: torch.Tensor, dtype: torch.dtype,
                 mask_of: Callable[[int, torch.Tensor], torch.Tensor | None], weights: Sequence[float], *,
                 consensus: bool, normalize: bool, scale: float, rescale: bool,
                 sparsify_dtype: torch.dtype | None = None) -> torch.Tensor:
    """mergekit's generalized task arithmetic computed in ``dtype`` (its config's ``dtype``), step for step.

    mergekit casts every input to ``dtype`` and computes in it, so each step rounds: τᵢ = xᵢ − x₀,
    the mask and the L1 rescale, wᵢ·τᵢ (the weights themselves rounded to ``dtype``), the sign election
    on the weighted sum, the masked sum, the division by the agreeing weights (their sum in ``dtype``),
    λ, and x₀ + merged. This is the same sequence of tensor operations in the same dtype (written from
    those definitions), so it rounds as mergekit does; :func:`gta_combine_` is the float32 form.
    ``mask_of(i, τᵢ)`` gives input i's mask (None: all). ``sparsify_dtype``: the dtype the mask and the
    rescale are computed in, the result cast back to ``dtype`` (:func:`random_work_dtype` for DARE and
    DELLA; default ``dtype``).
    Returns the merged task vector in float32 (exactly the low-precision result minus ``base``).
    """
    base_h = base.to(dtype)
    work = sparsify_dtype or dtype
    stack = torch.empty((len(deltas), *base.shape), dtype=dtype, device=base.device)
    for i, d in enumerate(deltas):  # xᵢ as stored (θ₀ + τᵢ in float32 is exact for same-dtype checkpoints)
        tau = (base + d).to(dtype) - base_h
        mask = mask_of(i, tau)
        if mask is not None:
            tau_w = tau.to(work)
            masked = tau_w * mask.to(work)
            if rescale:
                before, after = tau_w.abs().sum(), masked.abs().sum()
                if not (before < 1e-7 or after < 1e-7):
                    masked = masked * (before / after)
            tau = masked.to(dtype)
        stack[i] = tau
    w = torch.tensor(list(weights), dtype=dtype, device=base.device).reshape(-1, *[1] * base.dim())
    stack.mul_(w)
    if consensus:
        sign = stack.sign()
        majority = (stack.sum(dim=0) >= 0).to(dtype) * 2 - 1
        agree = sign == majority
        merged = (stack * agree).sum(dim=0)
        divisor = (w * agree).sum(dim=0)
        divisor[divisor == 0] = 1
    else:
        merged = stack.sum(dim=0)
        divisor = w.sum(dim=0)
        divisor[divisor.abs() < 1e-8] = 1
    if normalize:
        merged /= divisor
    if scale != 1:
        merged *= scale
    return (base_h + merged).to(torch.float32).sub_(base)


def per_input(scalar: float, values: Sequence[float] | None, n: int) -> list[float]:
    """One value per input: ``values`` (a per-input tuple such as ``densities``) when given, else ``scalar``."""
    return list(values) if values is not None else [scalar] * n

"""SFTM: the exact properties of shared/methods/sftm.md §6, on plain tensors and tiny models."""

import os

import pytest
import torch
from method_helpers import state

import hubsoup
from hubsoup.cli import main as cli_main
from hubsoup.methods.sftm import gram as sftm_gram
from hubsoup.methods.sftm import (
    Features,
    keep_count,
    lora_features,
    singular_features,
    solve_gram,
    superpose,
    trim_topk_,
)
from hubsoup.testing import merge_tensors

D = torch.float64


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def gram(feats):
    U = torch.cat([f.U for f in feats], 1)
    V = torch.cat([f.V for f in feats], 1)
    return (U.T @ U) * (V.T @ V), U, V, torch.cat([f.s for f in feats])


def sftm_matrices(mats, *, rank_tol=None, ridge=0.0, rcond=1e-10):
    """SFTM of already-trimmed task matrices (T, m, n) → merged M (m, n), unscaled."""
    feats = [singular_features(M, rank_tol) for M in mats]
    M, _ = superpose(feats, ridge=ridge, rcond=rcond, out_dtype=mats[0].dtype)
    return M


def run(deltas, name="model.layers.0.mlp.down_proj.weight", base=None, **params):
    return merge_tensors("sftm", deltas, base, name=name, **params)


# --- the linear system ------------------------------------------------------------------

def test_one_task_returns_it():
    M1 = rand(7, 5)
    torch.testing.assert_close(sftm_matrices([M1]), M1, rtol=0, atol=1e-12)


def test_copies_of_one_task_give_it_not_the_sum():
    M1 = rand(6, 4, seed=1)
    feats = [singular_features(M1) for _ in range(3)]
    M, info = superpose(feats)
    assert info["solver"] == "pinv" and info["dropped"] == 8  # G singular: the min-norm path
    torch.testing.assert_close(M, M1, rtol=0, atol=1e-10)


def _orthogonal_row_spaces(T=3, m=5, n=12, k=3, seed=2):
    Q, _ = torch.linalg.qr(rand(n, T * k, seed=seed))
    bases = [Q[:, i * k:(i + 1) * k] for i in range(T)]  # V_i^T V_j = 0 for i != j
    mats = [rand(m, k, seed=seed + 10 + i) @ B.T for i, B in enumerate(bases)]
    return mats, bases


def test_orthogonal_row_spaces_keep_each_tasks_input_output_map():
    mats, bases = _orthogonal_row_spaces()
    feats = [singular_features(M) for M in mats]
    G, *_ = gram(feats)
    torch.testing.assert_close(G, torch.eye(G.shape[0], dtype=D), rtol=0, atol=1e-12)
    M = sftm_matrices(mats)
    torch.testing.assert_close(M, sum(mats), rtol=0, atol=1e-12)
    for Mi, B in zip(mats, bases):
        x = B @ rand(B.shape[1], 4, seed=99)  # inputs in rowspace(M_i)
        torch.testing.assert_close(M @ x, Mi @ x, rtol=0, atol=1e-11)


def test_orthogonal_column_spaces_sum_but_do_not_keep_the_map():
    mats, _ = _orthogonal_row_spaces()
    mats = [M.T for M in mats]  # now the column spaces are orthogonal, the row spaces overlap
    M = sftm_matrices(mats)
    torch.testing.assert_close(M, sum(mats), rtol=0, atol=1e-12)
    M1 = mats[0]
    x = singular_features(M1).V @ torch.ones(3, dtype=D)
    assert float((M @ x - M1 @ x).norm()) > 1e-3


def test_generic_constraints_hold():
    mats = [rand(4, 6, seed=s) for s in range(3)]  # T·min(m,n) = 12 <= m·n = 24
    feats = [singular_features(M) for M in mats]
    M, info = superpose(feats)
    assert info["solver"] == "cholesky"
    for f in feats:
        resid = (f.U.T @ M @ f.V).diagonal() - f.s
        assert float(resid.abs().max()) < 1e-10


def test_is_minimum_norm_solution_of_the_constraints():
    mats = [rand(5, 6, seed=s) for s in (3, 4)]
    feats = [singular_features(M) for M in mats]
    M = sftm_matrices(mats)
    C = torch.stack([torch.outer(u, v).flatten() for f in feats for u, v in zip(f.U.T, f.V.T)])
    s = torch.cat([f.s for f in feats])
    ref = (torch.linalg.pinv(C) @ s).reshape(5, 6)
    torch.testing.assert_close(M, ref, rtol=0, atol=1e-10)


def test_papers_nonsymmetric_form_gives_the_same_matrix():
    mats = [rand(6, 5, seed=s) for s in (5, 6)]
    feats = [singular_features(M) for M in mats]
    G, U, V, s = gram(feats)
    alpha = torch.linalg.solve(G * s[None, :], s)  # (Σ ∘ U ∘ V) α = σ, Σ[a, b] = σ_b
    M_paper = U @ torch.diag(alpha * s) @ V.T
    torch.testing.assert_close(sftm_matrices(mats), M_paper, rtol=0, atol=1e-10)


def test_equivariances():
    mats = [rand(5, 7, seed=s) for s in (7, 8, 9)]
    M = sftm_matrices(mats)
    torch.testing.assert_close(sftm_matrices([A.T for A in mats]), M.T, rtol=0, atol=1e-10)
    torch.testing.assert_close(sftm_matrices([2.5 * A for A in mats]), 2.5 * M, rtol=0, atol=1e-10)
    torch.testing.assert_close(sftm_matrices(mats[::-1]), M, rtol=0, atol=1e-10)
    feats = [singular_features(A) for A in mats]
    flip = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0], dtype=D)
    flipped = [Features(f.U * flip, f.s, f.V * flip) for f in feats]
    torch.testing.assert_close(superpose(flipped)[0], M, rtol=0, atol=1e-10)


def test_lora_factorized_path_equals_dense_path():
    m, n, r = 12, 9, 3
    loras = [(rand(m, r, seed=20 + i), rand(r, n, seed=30 + i), 2.0) for i in range(3)]
    fact = superpose([lora_features(B, A, s) for B, A, s in loras])[0]
    dense = sftm_matrices([s * B @ A for B, A, s in loras])
    torch.testing.assert_close(fact, dense, rtol=0, atol=1e-10)
    assert lora_features(*loras[0]).s.numel() == r  # ρ triplets, never min(m, n)


def test_gram_from_the_blocks_between_tasks_is_the_full_product():
    feats = [singular_features(rand(9, 6, seed=50 + i)) for i in range(3)]
    feats.append(lora_features(rand(9, 2, seed=60), rand(2, 6, seed=61), 1.5))
    feats.append(Features(torch.zeros(9, 0, dtype=D), torch.zeros(0, dtype=D), torch.zeros(6, 0, dtype=D)))  # no triplets
    want, *_ = gram(feats)
    got = sftm_gram(feats)
    assert got.dtype == torch.float64 and got.shape == want.shape == (3 * 6 + 2,) * 2
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_solver_paths():
    A = rand(6, 6, seed=40)
    G = A @ A.T + torch.eye(6, dtype=D)
    b = rand(6, seed=41)
    x, info = solve_gram(G, b)
    assert info["solver"] == "cholesky"
    torch.testing.assert_close(G @ x, b)
    S = torch.ones(4, 4, dtype=D)  # rank 1
    x, info = solve_gram(S, torch.ones(4, dtype=D))
    assert info["solver"] == "pinv"
    torch.testing.assert_close(x, torch.full((4,), 0.25, dtype=D))
    x, info = solve_gram(S, torch.ones(4, dtype=D), ridge=1.0)  # ridge makes it definite
    assert info["solver"] == "cholesky"
    torch.testing.assert_close(x, torch.full((4,), 0.2, dtype=D))


def test_zero_task_matrix_contributes_nothing():
    M1 = rand(4, 4, seed=50)
    torch.testing.assert_close(sftm_matrices([M1, torch.zeros(4, 4, dtype=D)]), M1, rtol=0, atol=1e-12)
    assert torch.equal(sftm_matrices([torch.zeros(3, 2, dtype=D)]), torch.zeros(3, 2, dtype=D))


# --- trimming and the per-tensor rules ----------------------------------------------------

def test_trim_keeps_exactly_ceil_eta_numel_with_deterministic_ties():
    x = torch.tensor([3.0, -1.0, 1.0, 1.0, -1.0, 0.5, 2.0, 1.0, 0.0, 0.0])
    y = trim_topk_(x.clone(), 0.45)  # ⌈4.5⌉ = 5: 3, 2, and the first three of the five ±1s
    assert int((y != 0).sum()) == keep_count(0.45, 10) == 5
    assert y.tolist() == [3.0, -1.0, 1.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    assert keep_count(0.2, 10) == 2  # float noise in 0.2·10 does not round up
    big = rand(40, 30, seed=51).float()
    for eta in (0.1, 0.25, 0.5, 1.0):
        assert int((trim_topk_(big.clone(), eta) != 0).sum()) == keep_count(eta, 1200)


def test_non_matrix_rules():
    taus = [rand(8, seed=60 + i) for i in range(3)]
    bias = run(taus, name="model.layers.0.mlp.down_proj.bias", eta=1.0, gamma=0.7)
    torch.testing.assert_close(bias, 0.7 * sum(taus))
    for gamma in (0.3, 1.1):  # norm layers: mean of the τ_i, no γ
        norm = run(taus, name="model.layers.0.input_layernorm.weight", eta=1.0, gamma=gamma)
        torch.testing.assert_close(norm, sum(taus) / 3)
    emb = [rand(10, 4, seed=70 + i) for i in range(2)]
    out = run(emb, name="model.embed_tokens.weight", eta=0.5, gamma=0.5)
    trimmed = [trim_topk_(e.clone(), 0.5) for e in emb]
    torch.testing.assert_close(out, 0.5 * sum(trimmed))
    head = run(emb, name="lm_head.weight", eta=1.0, gamma=1.0)
    torch.testing.assert_close(head, sum(emb))
    head_sftm = run(emb, name="lm_head.weight", eta=1.0, gamma=1.0, lm_head="sftm")
    torch.testing.assert_close(head_sftm, sftm_matrices(emb))


def test_linear_weight_is_trimmed_then_superposed_then_scaled():
    taus = [rand(6, 5, seed=80 + i) for i in range(2)]
    out = run(taus, eta=0.5, gamma=0.6)
    ref = 0.6 * sftm_matrices([trim_topk_(t.clone(), 0.5) for t in taus])
    torch.testing.assert_close(out, ref)


def test_conv_kernels_are_reshaped_to_matrices():
    taus = [rand(4, 3, 2, 2, seed=90 + i) for i in range(2)]
    out = run(taus, name="vision_model.embeddings.patch_embedding.weight", eta=1.0, gamma=1.0)
    ref = sftm_matrices([t.reshape(4, -1) for t in taus]).reshape(4, 3, 2, 2)
    torch.testing.assert_close(out, ref)


# --- whole models --------------------------------------------------------------------------

def test_sftm_of_one_model_returns_it(llama, tmp_path):
    base, fts = llama
    res = hubsoup.merge(fts[:1], method="sftm", base=base, out=str(tmp_path / "o"), quiet=True, eta=1.0, gamma=1.0)
    merged, ft = state(res.path), state(fts[0])
    assert set(merged) == set(ft)
    for k in ft:
        torch.testing.assert_close(merged[k], ft[k], rtol=0, atol=2e-6, msg=k)


def test_sftm_three_llamas_matches_the_math(llama, tmp_path):
    base, fts = llama
    res = hubsoup.merge(fts, method="sftm", base=base, out=str(tmp_path / "o"), quiet=True, eta=0.3, gamma=0.6)
    merged, b = state(res.path), state(base)
    ft = [state(f) for f in fts]
    name = "model.layers.1.self_attn.k_proj.weight"
    taus = [trim_topk_((f[name].float() - b[name].float()), 0.3) for f in ft]
    ref = b[name].float() + 0.6 * sftm_matrices(taus)
    torch.testing.assert_close(merged[name].float(), ref, rtol=0, atol=1e-5)
    norm = "model.norm.weight"
    ref = b[norm].float() + sum(trim_topk_(f[norm].float() - b[norm].float(), 0.3) for f in ft) / 3
    torch.testing.assert_close(merged[norm].float(), ref, rtol=0, atol=1e-6)
    card = open(os.path.join(res.path, "README.md")).read()
    assert "sftm" in card and "eta" in card


def test_cli_runs_sftm(llama, tmp_path, capsys):
    base, fts = llama
    out = tmp_path / "cli"
    rc = cli_main(["merge", *fts[:2], "--base", base, "--method", "sftm", "-p", "eta=0.5", "-p", "gamma=0.8",
                   "--out", str(out), "-q"])
    assert rc == 0 and (out / "model.safetensors").is_file()
    rc = cli_main(["merge", *fts[:2], "--base", base, "--method", "sftm", "-p", "eta=1.5", "--out", str(tmp_path / "x")])
    assert rc == 2 and "eta" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_sftm_on_lora_inputs_uses_factors_and_matches_dense(model_dir, tmp_path, monkeypatch):
    from tests.sources.test_lora import densify, make_adapter

    from hubsoup.sources.lora import LoraDelta

    base = model_dir("llama")
    a1 = make_adapter(tmp_path / "a1", "llama", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    a2 = make_adapter(tmp_path / "a2", "llama", seed=2, r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    dense = [densify("llama", base, a, tmp_path / f"dense{i}") for i, a in enumerate((a1, a2))]
    ref = hubsoup.merge(dense, method="sftm", base=base, out=str(tmp_path / "ref"), quiet=True, eta=1.0, gamma=0.6)

    def boom(self, *a, **k):
        raise AssertionError("dense task vector materialised")

    with monkeypatch.context() as mp:
        mp.setattr(LoraDelta, "delta_into", boom)
        res = hubsoup.merge([a1, a2], method="sftm", base=base, out=str(tmp_path / "lora"), quiet=True, gamma=0.6)
    got, want = state(res.path), state(ref.path)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-5, msg=k)
    trimmed = hubsoup.merge([a1, a2], method="sftm", base=base, out=str(tmp_path / "trim"), quiet=True,
                            gamma=0.6, eta=0.3, lora_trim=True)  # the dense path, B·A trimmed by η
    dense_trimmed = hubsoup.merge(dense, method="sftm", base=base, out=str(tmp_path / "dt"), quiet=True,
                                  gamma=0.6, eta=0.3)
    got, want = state(trimmed.path), state(dense_trimmed.path)
    for k in want:  # trimmed rank-ρ products have tiny trailing singular values: float32 noise is amplified
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=5e-4, msg=k)


def test_default_gamma_is_measured_apart_for_lora_adapters(model_dir, tmp_path):
    """γ left at its default: 0.3 when every input is a LoRA adapter, 0.6 otherwise (issue 35: on validation,
    scored task by task, 8 adapters harmed a task from 0.4 on and 4 gained most at 0.2-0.3;
    benchmarks/results/val_sweep.md)."""
    from tests.sources.test_lora import densify, make_adapter

    from hubsoup.methods.sftm import FULL_GAMMA, LORA_GAMMA

    assert (LORA_GAMMA, FULL_GAMMA) == (0.3, 0.6)
    base = model_dir("llama")
    a1 = make_adapter(tmp_path / "a1", "llama", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    a2 = make_adapter(tmp_path / "a2", "llama", seed=2, r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"])
    dense = [densify("llama", base, a, tmp_path / f"dense{i}") for i, a in enumerate((a1, a2))]

    def merged(inputs, out, **p):
        return state(hubsoup.merge(inputs, method="sftm", base=base, out=str(tmp_path / out), quiet=True, **p).path)

    for inputs, kind, gamma in (([a1, a2], "lora", LORA_GAMMA), (dense, "full", FULL_GAMMA)):
        got, want = merged(inputs, f"{kind}-default"), merged(inputs, f"{kind}-given", gamma=gamma)
        assert all(torch.equal(got[k], want[k]) for k in want), kind
    # one full fine-tune among adapters: not every input is an adapter, the full default
    got, want = merged([a1, dense[1]], "mixed-default"), merged([a1, dense[1]], "mixed-given", gamma=FULL_GAMMA)
    assert all(torch.equal(got[k], want[k]) for k in want)
    res = hubsoup.merge([a1, a2], method="sftm", base=base, out=str(tmp_path / "card"), quiet=True)
    assert f"**γ = {LORA_GAMMA:g}** when every input is a LoRA adapter" in res.card


@pytest.mark.parametrize("shape,n,eta", [((192, 64), 3, 0.2), ((64, 160), 4, 0.3), ((96, 96), 2, 1.0)])
def test_float32_svds_of_the_device_path_are_within_tolerance_of_float64(shape, n, eta):
    """An accelerator's SFTM takes one batched float32 SVD per tensor (the Gram system still in float64);
    the merged matrix stays within FLOAT32_SVD_TOL (relative Frobenius) of the CPU's float64 SVDs."""
    from hubsoup.methods.sftm import FLOAT32_SVD_TOL, singular_features_batched

    g = torch.Generator().manual_seed(sum(shape) + n)
    mats = torch.randn(n, *shape, generator=g) * 0.02  # float32 task vectors, as the engine gives them
    mats[1] += 0.5 * mats[0]  # correlated tasks: an off-diagonal Gram, a real solve
    for row in mats:
        trim_topk_(row, eta)
    want, _ = superpose([singular_features(M) for M in mats], out_dtype=torch.float32)
    got, _ = superpose(singular_features_batched(mats), out_dtype=torch.float32)
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err <= FLOAT32_SVD_TOL, err
    # and against the exact float64 merge of the same matrices (the float64 path's own error, for scale)
    exact = sftm_matrices(mats.double())
    assert float((got.double() - exact).norm() / exact.norm()) <= FLOAT32_SVD_TOL


@pytest.mark.parametrize("shape,n,eta", [((192, 64), 3, 0.2), ((64, 160), 4, 0.3), ((96, 96), 2, 1.0)])
def test_gram_eigen_triplets_give_the_float64_svds_merge(shape, n, eta):
    """The device's other way to the triplets (float64 eigen-decompositions of the smaller Gram matrix): the
    merged matrix is the float64 SVDs' to float32 rounding, far inside FLOAT32_SVD_TOL, and keeps as many."""
    from hubsoup.methods.sftm import singular_features_gram

    g = torch.Generator().manual_seed(sum(shape) + n)
    mats = torch.randn(n, *shape, generator=g) * 0.02
    mats[1] += 0.5 * mats[0]
    for row in mats:
        trim_topk_(row, eta)
    ref = [singular_features(M) for M in mats]
    feats = singular_features_gram(mats)
    assert [f.s.numel() for f in feats] == [f.s.numel() for f in ref]
    want, _ = superpose(ref, out_dtype=torch.float32)
    got, _ = superpose(feats, out_dtype=torch.float32)
    assert float((got.double() - want.double()).norm() / want.double().norm()) <= 1e-6


# --- the CPU's exact fast path (superpose_eigh): the float64 SVDs' merge, step for step ------------------

def _cpu_reference(mats, eta=None, **kw):
    """The merge as the float64 SVDs give it (HUBSOUP_SFTM_CPU=svd, before 0.2)."""
    ref = mats.clone()
    if eta is not None:
        for row in ref:
            trim_topk_(row, eta)
    return superpose([singular_features(M, kw.get("rank_tol")) for M in ref], ridge=kw.get("ridge", 0.0),
                     out_dtype=mats.dtype)


def _structured_cases(n=96):
    g = torch.Generator().manual_seed(7)
    rn = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    S = rn(n, n)
    L = rn(n, 4) @ rn(4, n) * 10
    return {
        "square": torch.stack([rn(n, n) for _ in range(3)]),
        "tall": torch.stack([rn(2 * n + 5, n) for _ in range(3)]),
        "wide": torch.stack([rn(n, 2 * n + 5) for _ in range(3)]),
        "correlated": torch.stack([0.7 * S + 0.3 * rn(n, n) for _ in range(3)]),  # an off-diagonal G: float64 blocks
        "shared low rank": torch.stack([L + 0.2 * rn(n, n) for _ in range(3)]),  # κ(G) in the hundreds
        "near duplicates": torch.stack([S + 1e-4 * rn(n, n) for _ in range(3)]),
        "exact duplicates": torch.stack([S.clone() for _ in range(3)]),  # singular G: the min-norm solution
        "one task": S.clone().unsqueeze(0),
        "a zero task": torch.stack([S, torch.zeros(n, n), rn(n, n)]),
        "rank deficient": torch.stack([rn(n, 5) @ rn(5, n) for _ in range(3)]),  # triplets dropped by the rank cut
        "four tasks": torch.stack([rn(n, n - 7) for _ in range(4)]),
    }


@pytest.mark.parametrize("case", list(_structured_cases()))
@pytest.mark.parametrize("cg", [False, True])
def test_cpu_eigh_path_is_the_float64_svds_merge(case, cg, monkeypatch):
    """Every structural case, solved directly and (cg) by conjugate gradients where they converge: within 1e-6
    (relative, largest entry and Frobenius) of the float64 SVDs' merge, with as many triplets kept."""
    from hubsoup.methods import sftm

    if cg:  # small systems take conjugate gradients too (the default leaves them to Cholesky)
        monkeypatch.setattr(sftm, "CG_MIN_RANK", 1)
    mats = _structured_cases()[case]
    eta = None if case == "rank deficient" else 0.3
    want, winfo = _cpu_reference(mats, eta)
    got, info = sftm.superpose_eigh(mats.clone(), eta=eta, threads=2)
    assert info["rank"] == winfo["rank"], (info, winfo)
    scale = float(want.abs().max())
    if scale == 0.0:
        assert not got.any()
        return
    if winfo["cond"] > sftm.CG_KAPPA:  # G near singular: both merges carry float32 rounding times κ(G)
        trimmed = mats.clone()
        for row in trimmed if eta is not None else ():
            trim_topk_(row, eta)
        exact = sftm_matrices(trimmed.double()).float()  # float64 throughout: the merge without that noise
        assert float((got - exact).abs().max()) <= 2 * float((want - exact).abs().max()) + 1e-7 * scale
        return
    assert float((got - want).abs().max()) <= 1e-6 * scale, (case, info)
    assert float((got.double() - want.double()).norm()) <= 1e-6 * float(want.double().norm())


def test_cpu_eigh_path_takes_each_solver_where_it_should(monkeypatch):
    """Nearly orthogonal tasks: float32 blocks and conjugate gradients; correlated ones: float64 blocks; κ(G) in
    the hundreds: the direct solve (Cholesky), as before."""
    from hubsoup.methods import sftm

    monkeypatch.setattr(sftm, "CG_MIN_RANK", 1)
    cases = _structured_cases()
    _, info = sftm.superpose_eigh(cases["square"].clone(), eta=0.3)
    assert (info["solver"], info["gram"]) == ("cg", "float32") and info["cond"] <= sftm.F32_GRAM_KAPPA
    _, info = sftm.superpose_eigh(cases["correlated"].clone(), eta=0.3)
    assert (info["solver"], info["gram"]) == ("cg", "float64") and info["cond"] > sftm.F32_GRAM_KAPPA
    monkeypatch.setattr(sftm, "CG_KAPPA", 10.0)
    _, info = sftm.superpose_eigh(cases["shared low rank"].clone(), eta=0.3)
    assert info["solver"] == "cholesky" and info["gram"] == "float64"


def test_cpu_eigh_path_does_not_depend_on_the_thread_count():
    """Each step runs on one LAPACK thread whatever the number of threads side by side: the same bytes."""
    from hubsoup.methods.sftm import superpose_eigh

    mats = _structured_cases()["tall"]
    one, _ = superpose_eigh(mats.clone(), eta=0.3, threads=1)
    for threads in (2, 3):
        got, _ = superpose_eigh(mats.clone(), eta=0.3, threads=threads)
        assert torch.equal(got, one)


def test_cpu_eigh_path_in_float64_keeps_the_exact_properties():
    """float64 task matrices (this file's unit tests) stay float64 throughout: the constraints hold to 1e-10."""
    from hubsoup.methods.sftm import superpose_eigh

    mats = torch.stack([rand(6, 9, seed=s) for s in range(3)])
    M, info = superpose_eigh(mats.clone())
    assert M.dtype == D
    for A in mats:
        f = singular_features(A)
        assert float(((f.U.T @ M @ f.V).diagonal() - f.s).abs().max()) < 1e-10
    torch.testing.assert_close(M, sftm_matrices(mats), rtol=0, atol=1e-10)
    low = torch.stack([rand(8, 2, seed=s) @ rand(2, 7, seed=s + 10) for s in range(3)])  # float64's rank cut
    M, info = superpose_eigh(low.clone())
    assert info["rank"] == 6
    torch.testing.assert_close(M, sftm_matrices(low), rtol=0, atol=1e-10)


def test_the_merge_takes_the_eigh_path_on_the_cpu_and_the_svd_path_when_asked(monkeypatch):
    """merge() on the CPU: the eigh path by default, the float64 SVDs with HUBSOUP_SFTM_CPU=svd; within 1e-6."""
    from hubsoup.methods import sftm

    mats = _structured_cases()["wide"]
    calls = []
    real = sftm.superpose_eigh
    monkeypatch.setattr(sftm, "superpose_eigh", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = run(mats, eta=0.3, gamma=1.0)
    assert calls
    monkeypatch.setattr(sftm, "CPU_PATH", "svd")
    slow = run(mats, eta=0.3, gamma=1.0)
    assert len(calls) == 1
    assert float((fast - slow).abs().max()) <= 1e-6 * float(slow.abs().max())

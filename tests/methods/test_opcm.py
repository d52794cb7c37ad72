"""OPCM and continual merging: shared/methods/continual.md §6 properties, the state, the CLI, bad input."""

import json
import math
import os
import shutil

import pytest
import torch
from method_helpers import state
from safetensors.torch import load_file

import hubsoup
from hubsoup import continual
from hubsoup.cli import main as cli_main
from hubsoup.workflows.continual import STATE_DIR
from hubsoup.errors import ContinualStateError, HubsoupError, NonFiniteTensorError, ParameterError
from hubsoup.methods import get_method
from hubsoup.methods.opcm import opcm_lambda, opcm_update, project, split_rank
from hubsoup.public import json_digest
from hubsoup.testing import make_base, make_finetune

D = torch.float64


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def P(**kw):
    return get_method("opcm").parse(kw)


def masked_full(S, X, alpha, zero_diagonal):
    """The reference: full SVD coordinates, C = Uᵀ X V with the top block (and diagonal) zeroed."""
    U, s, Vh = torch.linalg.svd(S, full_matrices=True)
    k = split_rank(s, alpha)
    C = U.T @ X @ Vh.T
    C[:k, :k] = 0
    if zero_diagonal:
        p = min(S.shape)
        C[range(p), range(p)] = 0
    return U @ C @ Vh


# --- the projection -----------------------------------------------------------------------

def test_split_rank():
    s = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert split_rank(s, 0.5) == 1
    assert split_rank(s, 0.3) == 0
    assert split_rank(s, 0.95) == 3
    assert split_rank(torch.zeros(3), 0.5) == 0


@pytest.mark.parametrize("shape", [(7, 4), (4, 9)])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.8])
@pytest.mark.parametrize("zero_diagonal", [True, False])
def test_thin_projection_equals_masked_full_svd(shape, alpha, zero_diagonal):
    S, X = rand(*shape, seed=1), rand(*shape, seed=2)
    torch.testing.assert_close(project(S, X, alpha, zero_diagonal), masked_full(S, X, alpha, zero_diagonal),
                               rtol=0, atol=1e-12)


def test_zero_diagonal_makes_the_update_orthogonal_to_S():
    for seed in range(5):
        S, X = rand(8, 6, seed=seed), rand(8, 6, seed=seed + 100)
        inner = float((project(S, X, 0.5, True) * S).sum())
        assert abs(inner) < 1e-10 * float(X.norm() * S.norm())
        early = float((project(S, X, 0.5, False) * S).sum())  # the early published code: not orthogonal
        assert abs(early) > 1e-3 * float(X.norm() * S.norm())


def test_projection_invariances():
    S, X, Y = rand(6, 5, seed=3), rand(6, 5, seed=4), rand(6, 5, seed=5)
    torch.testing.assert_close(project(3.7 * S, X, 0.5), project(S, X, 0.5), rtol=0, atol=1e-12)
    torch.testing.assert_close(project(S, 2 * X - 0.5 * Y, 0.5), 2 * project(S, X, 0.5) - 0.5 * project(S, Y, 0.5),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(project(S.T, X.T, 0.5), project(S, X, 0.5).T, rtol=0, atol=1e-12)


def test_alpha_zero_without_diagonal_is_identity_and_zero_S_skips():
    S, X = rand(5, 5, seed=6), rand(5, 5, seed=7)
    torch.testing.assert_close(project(S, X, 0.0, False), X, rtol=0, atol=0)
    torch.testing.assert_close(project(torch.zeros(5, 5, dtype=D), X, 0.5, True), X, rtol=0, atol=0)


def test_rank_deficient_S_keeps_undefined_diagonal_directions():
    u, v = rand(6, 1, seed=8), rand(5, 1, seed=9)
    S = u @ v.T  # rank 1: only one singular direction is defined
    X = rand(6, 5, seed=10)
    out = project(S, X, 0.0, True)
    U, s, Vh = torch.linalg.svd(S, full_matrices=False)
    ref = X - (U[:, :1].T @ X @ Vh[:1].T) * (U[:, :1] @ Vh[:1])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_lambda_rules():
    assert opcm_lambda("adaptive", 5.0, [3.0]) == 1.0
    assert opcm_lambda("adaptive", 5.0, [3.0, 1.0]) == 5.0 / 2.0
    assert opcm_lambda("sqrt", 5.0, [3.0, 1.0, 2.0]) == math.sqrt(3)
    with pytest.raises(ParameterError):
        P(alpha=1.0)


def _opcm_model(models, **kw):
    """OPCM over dict-models (name -> τ) in order, straight from the formulas."""
    params = P(**kw)
    S = {}
    for tau in models:
        for k, v in tau.items():
            S[k] = opcm_update(S.get(k), v, k, params)
    norms = [math.sqrt(sum(float(v.norm()) ** 2 for v in tau.values())) for tau in models]
    s_norm = math.sqrt(sum(float(v.norm()) ** 2 for v in S.values()))
    lam = opcm_lambda(params.scaling, s_norm, norms)
    return {k: v / lam for k, v in S.items()}, lam


def test_same_model_twice_returns_it_when_all_matrices():
    tau = {f"layers.{i}.mlp.fc.weight": rand(6, 4, seed=20 + i) for i in range(3)}
    merged, lam = _opcm_model([tau, tau])
    assert abs(lam - 1.0) < 1e-12
    for k in tau:
        torch.testing.assert_close(merged[k], tau[k], rtol=0, atol=1e-12)
    tau["layers.0.mlp.fc.bias"] = rand(6, seed=30)  # non-matrix tensors are doubled before the rescale
    merged, _ = _opcm_model([tau, tau])
    assert not torch.allclose(merged["layers.0.mlp.fc.bias"], tau["layers.0.mlp.fc.bias"])


def test_norm_invariant_adaptive():
    models = [{"a.q_proj.weight": rand(5, 4, seed=40 + i), "a.q_proj.bias": rand(5, seed=50 + i)} for i in range(4)]
    merged, _ = _opcm_model(models)
    norm = math.sqrt(sum(float(v.norm()) ** 2 for v in merged.values()))
    mean = sum(math.sqrt(sum(float(v.norm()) ** 2 for v in m.values())) for m in models) / 4
    assert abs(norm - mean) < 1e-12 * mean


# --- the one-shot method on tiny models --------------------------------------------------------

def test_opcm_of_one_model_returns_it(llama, tmp_path):
    base, fts = llama
    res = hubsoup.merge(fts[:1], method="opcm", base=base, out=str(tmp_path / "o"), quiet=True)
    merged, ft = state(res.path), state(fts[0])
    for k in ft:
        torch.testing.assert_close(merged[k], ft[k], rtol=0, atol=1e-6, msg=k)


def test_opcm_norm_invariant_order_and_determinism(llama, tmp_path):
    base, fts = llama
    b = state(base)
    res = hubsoup.merge(fts, method="opcm", base=base, out=str(tmp_path / "abc"), quiet=True)
    m = state(res.path)
    dist = math.sqrt(sum(float((m[k].double() - b[k].double()).norm()) ** 2 for k in b))
    norms = [math.sqrt(sum(float((f[k].double() - b[k].double()).norm()) ** 2 for k in b)) for f in map(state, fts)]
    assert abs(dist - sum(norms) / 3) < 1e-4 * dist
    assert res.stats["opcm.task_norms"] == pytest.approx(norms, rel=1e-6)
    again = state(hubsoup.merge(fts, method="opcm", base=base, out=str(tmp_path / "abc2"), quiet=True).path)
    assert all(torch.equal(m[k], again[k]) for k in m)
    swapped = state(hubsoup.merge([fts[1], fts[0], fts[2]], method="opcm", base=base, out=str(tmp_path / "bac"),
                                  quiet=True).path)
    assert any(not torch.allclose(m[k], swapped[k]) for k in m if k.endswith("proj.weight"))
    sq = hubsoup.merge(fts, method="opcm", base=base, out=str(tmp_path / "sqrt"), quiet=True, scaling="sqrt")
    assert sq.stats == {} or sq.stats.get("opcm.lambda") is None
    s_sqrt = state(sq.path)
    k = "model.layers.0.post_attention_layernorm.weight"  # unprojected: Σ τ_i / √3
    ref = b[k] + sum(f[k] - b[k] for f in map(state, fts)) / math.sqrt(3)
    torch.testing.assert_close(s_sqrt[k], ref, rtol=0, atol=1e-6)


def test_the_merge_reads_S_from_the_statistics_pass_instead_of_repeating_its_svds(llama, tmp_path, monkeypatch):
    from hubsoup.methods import _kept as kept_mod
    from hubsoup.methods import opcm
    from hubsoup.methods.opcm import Opcm

    base, fts = llama
    real_svd, svds = opcm.singular_triplets, []  # a thin SVD of S (on the CPU from its Gram matrix)
    monkeypatch.setattr(opcm, "singular_triplets", lambda *a, **k: svds.append(1) or real_svd(*a, **k))
    stores, where = [], []
    real_init = kept_mod.KeptTensors.__init__

    def spy(self, scratch, label):
        real_init(self, scratch, label)
        stores.append(self)
        where.append(self.folder)

    monkeypatch.setattr(kept_mod.KeptTensors, "__init__", spy)
    res = hubsoup.merge(fts, method="opcm", base=base, out=str(tmp_path / "kept"), quiet=True)
    kept_svds = len(svds)
    assert kept_svds > 0 and len(stores) == 1
    assert os.path.basename(os.path.dirname(where[0])).startswith(".kept.partial")  # the output's scratch
    assert stores[0].folder is None and not os.path.exists(where[0])  # closed and gone with the merge
    assert "opcm.kept" not in res.stats

    svds.clear()
    monkeypatch.setattr(Opcm, "prepare", lambda self, params, ctx: {})  # nothing kept: S computed twice
    again = hubsoup.merge(fts, method="opcm", base=base, out=str(tmp_path / "twice"), quiet=True)
    assert len(svds) == 2 * kept_svds
    a, b = state(res.path), state(again.path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same merge, bit for bit

    # in a search, what a point keeps lives in the search's folder, never in a point's (one becomes the output)
    monkeypatch.undo()
    from hubsoup.workflows.search import search

    search(fts, "opcm", base=base, out=str(tmp_path / "s"), grid={"alpha": [0.3, 0.5]}, score_fn=lambda f: 0.0,
           quiet=True)
    assert set(os.listdir(tmp_path / "s")) - set(os.listdir(tmp_path / "kept")) == {"hubsoup_card.json",
                                                                                  "hubsoup_search.json"}
    assert not any(d.startswith((".hubsoup-", ".s.partial")) for _, dirs, _ in os.walk(tmp_path) for d in dirs)


# --- continual: init, add, export ------------------------------------------------------------

@pytest.fixture()
def private_llama(tmp_path, model_dir):
    """A base and three fine-tunes of our own (the test deletes some)."""
    base = str(tmp_path / "base")
    shutil.copytree(model_dir("llama"), base)
    fts = [make_finetune(base, str(tmp_path / f"ft{i}"), seed=10 + i) for i in range(3)]
    return base, fts


def test_add_equals_one_shot_and_never_reads_earlier_inputs(private_llama, tmp_path):
    base, (a, b, c) = private_llama
    one_shot = state(hubsoup.merge([a, b, c], method="opcm", base=base, out=str(tmp_path / "oneshot"), quiet=True).path)
    soup = str(tmp_path / "soup")
    res = continual.init([a, b], base=base, out=soup, quiet=True)
    assert res.stats["continual.count"] == 2
    S2 = load_file(os.path.join(soup, STATE_DIR, "S.safetensors"))
    two = state(hubsoup.merge([a, b], method="opcm", base=base, out=str(tmp_path / "two"), quiet=True).path)
    soup_state = {k: v for k, v in state(soup).items()}
    assert all(torch.equal(soup_state[k], two[k]) for k in two)
    shutil.rmtree(a)  # the earlier inputs are gone: add must not need them
    shutil.rmtree(b)
    res = continual.add(soup, [c], quiet=True)
    assert res.path == os.path.abspath(soup)
    merged = state(soup)
    assert set(merged) == set(one_shot)
    for k in one_shot:
        assert torch.equal(merged[k], one_shot[k]), k
    st = continual.load_state(soup)
    assert st.count == 3 and [m["path"] for m in st.models] == [os.path.abspath(p) for p in (a, b, c)]
    assert st.lam == pytest.approx(res.stats["opcm.lambda"])
    S3 = load_file(os.path.join(soup, STATE_DIR, "S.safetensors"))
    for k in S2:  # zero_diagonal: the added update is Frobenius-orthogonal to the previous S
        if k.endswith("proj.weight"):
            inner = float(((S3[k] - S2[k]).double() * S2[k].double()).sum())
            assert abs(inner) < 1e-5 * float((S3[k] - S2[k]).norm() * S2[k].norm()), k
    card = open(os.path.join(soup, "README.md")).read()
    order = [card.index(os.path.basename(p)) for p in (a, b, c)]
    assert order == sorted(order) and "in this order" in card
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p or ".old-" in p]


def test_init_one_then_add_one_equals_one_shot_and_export(private_llama, tmp_path):
    base, (a, b, _) = private_llama
    soup = str(tmp_path / "soup")
    continual.init([a], base=base, out=soup, quiet=True, shard_size="20KB")  # S in several files
    assert len([f for f in os.listdir(os.path.join(soup, STATE_DIR)) if f.startswith("S-")]) > 1
    assert all(torch.allclose(state(soup)[k], state(a)[k], atol=1e-6) for k in state(a))
    out2 = str(tmp_path / "soup2")
    continual.add(soup, b, out=out2, quiet=True)
    one_shot = state(hubsoup.merge([a, b], method="opcm", base=base, out=str(tmp_path / "o"), quiet=True).path)
    merged = state(out2)
    assert all(torch.equal(merged[k], one_shot[k]) for k in one_shot)
    assert continual.load_state(soup).count == 1  # the original soup is untouched
    exp = continual.export(out2, out=str(tmp_path / "exp"), quiet=True, dtype="bfloat16")
    ex = state(exp.path)
    assert not os.path.exists(os.path.join(exp.path, STATE_DIR))
    assert all(torch.equal(ex[k], merged[k].to(torch.bfloat16)) for k in merged if merged[k].is_floating_point())


def test_cli_continual(private_llama, tmp_path, capsys):
    base, (a, b, c) = private_llama
    soup = str(tmp_path / "soup")
    assert cli_main(["continual", "init", a, b, "--base", base, "--out", soup, "-p", "alpha=0.4", "-q"]) == 0
    assert cli_main(["continual", "add", soup, c, "-q"]) == 0
    assert cli_main(["continual", "show", soup]) == 0
    out = capsys.readouterr().out
    assert "3 model(s)" in out and "'alpha': 0.4" in out
    ref = hubsoup.merge([a, b, c], method="opcm", base=base, out=str(tmp_path / "ref"), quiet=True, alpha=0.4)
    got, want = state(soup), state(ref.path)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert cli_main(["continual", "export", soup, "--out", str(tmp_path / "exp"), "-q"]) == 0
    with pytest.raises(SystemExit):  # params are fixed by the state: add takes none
        cli_main(["continual", "add", soup, c, "-p", "alpha=0.1"])


# --- bad input ------------------------------------------------------------------------------

def _snapshot(folder):
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), folder)] = fh.read()
    return out


def test_state_from_a_different_base_is_refused(private_llama, tmp_path):
    base, (a, b, c) = private_llama
    soup = str(tmp_path / "soup")
    continual.init([a, b], base=base, out=soup, quiet=True)
    before = _snapshot(soup)
    other = make_base("llama", str(tmp_path / "other-base"), seed=1)
    c_other = make_finetune(other, str(tmp_path / "c-other"), seed=5)
    with pytest.raises(ContinualStateError, match="different base|differs from the base"):
        continual.add(soup, [c_other], base=other, quiet=True)
    assert _snapshot(soup) == before
    shutil.rmtree(base)  # the state's base is gone: a clear error, not a traceback
    with pytest.raises(ContinualStateError, match="cannot be opened"):
        continual.add(soup, [c], quiet=True)
    with pytest.raises(ContinualStateError, match="differs from the base"):
        continual.export(soup, out=str(tmp_path / "e"), base=other, quiet=True)
    assert not os.path.exists(tmp_path / "e")
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_corrupt_or_missing_state_is_refused(private_llama, tmp_path):
    base, (a, b, c) = private_llama
    soup = str(tmp_path / "soup")
    continual.init([a, b], base=base, out=soup, quiet=True)
    jfile = os.path.join(soup, STATE_DIR, "state.json")
    good = open(jfile).read()
    d = json.loads(good)
    d["lambda"] *= 2  # a plausible but wrong value
    open(jfile, "w").write(json.dumps(d))
    with pytest.raises(ContinualStateError, match="own checksum"):
        continual.add(soup, [c], quiet=True)
    d["lambda"] /= 2
    d["tensors"] = ["not", "a", "dict"]
    d["checksum"] = json_digest({k: v for k, v in d.items() if k != "checksum"})
    open(jfile, "w").write(json.dumps(d))
    with pytest.raises(ContinualStateError, match="malformed"):
        continual.add(soup, [c], quiet=True)
    open(jfile, "w").write(good[:100])  # truncated JSON
    with pytest.raises(ContinualStateError, match="not valid JSON"):
        continual.add(soup, [c], quiet=True)
    open(jfile, "w").write(good)
    sfile = os.path.join(soup, STATE_DIR, "S.safetensors")
    data = bytearray(open(sfile, "rb").read())
    data[-5] ^= 0xFF  # one flipped byte in S
    open(sfile, "wb").write(bytes(data))
    before = _snapshot(soup)
    with pytest.raises(ContinualStateError, match="checksum"):
        continual.add(soup, [c], quiet=True)
    assert _snapshot(soup) == before
    shutil.rmtree(os.path.join(soup, STATE_DIR))
    with pytest.raises(ContinualStateError, match="no continual state"):
        continual.add(soup, [c], quiet=True)
    assert cli_main(["continual", "add", soup, c]) == 2


def test_failed_add_leaves_the_soup_and_its_state_untouched(private_llama, tmp_path):
    base, (a, b, c) = private_llama
    soup = str(tmp_path / "soup")
    continual.init([a, b], base=base, out=soup, quiet=True)
    before = _snapshot(soup)
    bad = str(tmp_path / "bad")
    shutil.copytree(c, bad)
    sd = load_file(os.path.join(bad, "model.safetensors"))
    sd["model.norm.weight"][0] = float("nan")  # the last block: the state pass is far along when it fails
    from safetensors.torch import save_file
    save_file(sd, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NonFiniteTensorError):
        continual.add(soup, [bad], quiet=True)
    assert _snapshot(soup) == before
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p or ".old-" in p]
    with pytest.raises(HubsoupError, match="exists"):
        continual.init([a], base=base, out=soup, quiet=True)


# --- the Hub: the state travels with the soup -------------------------------------------------

def test_state_is_pushed_and_add_reads_it_from_the_hub(hub, private_llama, tmp_path, capsys):
    base, fts = private_llama
    api = hub.api("alice")
    for name, folder in zip(("base", "a", "b", "c"), (base, *fts)):
        api.create_repo(f"alice/{name}")
        api.upload_folder(repo_id=f"alice/{name}", folder_path=folder)
    hub.login("alice")
    soup = str(tmp_path / "soup")
    assert cli_main(["continual", "init", "alice/a", "alice/b", "--base", "alice/base", "--out", soup,
                     "--push", "alice/soup", "-q"]) == 0
    assert "pushed to alice/soup" in capsys.readouterr().out
    files = hub.files("alice/soup")
    assert {f"{STATE_DIR}/state.json", f"{STATE_DIR}/S.safetensors", "model.safetensors"} <= set(files)
    shutil.rmtree(soup)  # only the Hub copy is left
    res = continual.add("alice/soup", ["alice/c"], out=str(tmp_path / "soup3"), quiet=True)
    st = continual.load_state(res.path)
    assert [m["repo_id"] for m in st.models] == ["alice/a", "alice/b", "alice/c"]
    assert st.base["repo_id"] == "alice/base" and st.base["sha"] == hub.head("alice/base")
    ref = hubsoup.merge(["alice/a", "alice/b", "alice/c"], method="opcm", base="alice/base",
                        out=str(tmp_path / "ref"), quiet=True)
    got, want = state(res.path), state(ref.path)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ParameterError, match="not a local folder"):
        continual.add("alice/soup", ["alice/c"], quiet=True)  # a Hub soup is not replaced in place


def test_soup_of_local_models_is_pushed_without_paths_and_its_state_stays_valid(hub, private_llama, tmp_path):
    base, fts = private_llama
    hub.login("alice")
    soup = str(tmp_path / "soup")
    assert cli_main(["continual", "init", fts[0], fts[1], "--base", base, "--out", soup, "--push", "alice/lsoup",
                     "-q"]) == 0
    shutil.rmtree(soup)
    # the pushed state names the local models without their paths, and its checksum still holds
    st = continual.load_state("alice/lsoup")
    assert not any(str(tmp_path) in json.dumps(m) for m in st.models) and str(tmp_path) not in json.dumps(st.base)
    # a state from the Hub never chooses a folder of this machine as the base: --base is needed
    with pytest.raises(ContinualStateError, match="local base.*--base"):
        continual.add("alice/lsoup", [fts[2]], out=str(tmp_path / "s2"), quiet=True)
    res = continual.add("alice/lsoup", [fts[2]], base=base, out=str(tmp_path / "s2"), quiet=True)
    ref = hubsoup.merge(fts, method="opcm", base=base, out=str(tmp_path / "ref"), quiet=True)
    got, want = state(res.path), state(ref.path)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (32, 32)])
def test_float32_projection_from_the_gram_matrix_is_the_float64_svds(shape, monkeypatch):
    """A float32 S on the CPU (every merge's) takes its triplets from the float64 eigen-decomposition of its
    smaller Gram matrix: the projection with the float64 SVD's triplets (as before 0.2) to float32 rounding,
    low-rank S included (the same directions cut at max(m, n)·eps of float32)."""
    from hubsoup.methods import opcm

    def by_svd(S):
        return tuple(t.to(S.dtype) for t in torch.linalg.svd(S.double(), full_matrices=False))

    g = torch.Generator().manual_seed(sum(shape))
    for rank in (min(shape), 3):
        S = (torch.randn(shape[0], rank, generator=g) @ torch.randn(rank, shape[1], generator=g)).float()
        X = torch.randn(*shape, generator=g).float()
        U, s, Vh = opcm.singular_triplets(S)
        assert U.dtype == s.dtype == Vh.dtype == torch.float32
        for alpha, zero_diagonal in ((0.5, True), (0.3, False), (0.0, True)):
            got = project(S, X, alpha, zero_diagonal)
            with monkeypatch.context() as m:
                m.setattr(opcm, "singular_triplets", by_svd)
                want = project(S, X, alpha, zero_diagonal)
            assert float((got - want).abs().max()) <= 2e-6 * float(X.abs().max()), (rank, alpha)

"""LOT Merging: shared/methods/lot.md §6 properties on tensors, on tiny models with exemplars, bad input."""

import json
import os
import random

import pytest
import torch
from method_helpers import state

import hubsoup
from hubsoup.cli import main as cli_main
from hubsoup.errors import HubsoupError, MethodError, ParameterError
from hubsoup.errors import ExemplarError
from hubsoup.methods.lot import lot_linear, solve_right, weighted_mean
from hubsoup.testing import make_base, make_finetune

D = torch.float64
CHARS = "abcdefghijklmnopqrstuvwxyz .,!?0123456789"


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def gram(X):
    return X.T @ X


# --- the closed forms on tensors ------------------------------------------------------------

def test_one_task_full_rank_returns_it():
    d = rand(5, 4, seed=1)
    torch.testing.assert_close(lot_linear(d[None], [gram(rand(20, 4, seed=2))]), d, rtol=0, atol=1e-12)


def test_one_task_rank_deficient_projects_and_keeps_zero_drift():
    d, X = rand(5, 6, seed=3), rand(4, 6, seed=4)  # 4 rows < 6 inputs
    out = lot_linear(d[None], [gram(X)])
    torch.testing.assert_close(X @ out.T, X @ d.T, rtol=0, atol=1e-10)  # zero drift on the exemplars
    Pi = torch.linalg.pinv(gram(X)) @ gram(X)
    torch.testing.assert_close(out, d @ Pi, rtol=0, atol=1e-10)


def test_identical_features_give_the_mean_and_identical_tasks_give_the_task():
    G = gram(rand(30, 4, seed=5))
    ds = torch.stack([rand(3, 4, seed=s) for s in (6, 7, 8)])
    torch.testing.assert_close(lot_linear(ds, [G, G, G]), ds.mean(0), rtol=0, atol=1e-12)
    same = torch.stack([ds[0]] * 3)
    Gs = [gram(rand(10, 4, seed=s)) for s in (9, 10, 11)]
    torch.testing.assert_close(lot_linear(same, Gs), ds[0], rtol=0, atol=1e-12)


def test_orthogonal_feature_spaces_zero_drift():
    Q, _ = torch.linalg.qr(rand(9, 9, seed=12))
    Xs = [rand(6, 3, seed=13 + k) @ Q[:, 3 * k:3 * k + 3].T for k in range(3)]  # rows in orthogonal subspaces
    ds = torch.stack([rand(4, 9, seed=20 + k) for k in range(3)])
    out = lot_linear(ds, [gram(X) for X in Xs])
    proj = sum(ds[k] @ (Q[:, 3 * k:3 * k + 3] @ Q[:, 3 * k:3 * k + 3].T) for k in range(3))
    torch.testing.assert_close(out, proj, rtol=0, atol=1e-10)
    for X, d in zip(Xs, ds):
        torch.testing.assert_close(X @ out.T, X @ d.T, rtol=0, atol=1e-10)


def test_full_rank_equals_regmean_closed_form():
    W0 = rand(5, 6, seed=30)
    Ws = [W0 + 0.1 * rand(5, 6, seed=31 + k) for k in range(3)]
    Gs = [gram(rand(10, 6, seed=40 + k)) for k in range(3)]
    regmean = sum(W @ G for W, G in zip(Ws, Gs)) @ torch.linalg.inv(sum(Gs))
    lot = W0 + lot_linear(torch.stack([W - W0 for W in Ws]), Gs)
    torch.testing.assert_close(lot, regmean, rtol=0, atol=1e-10)


def test_rank_deficient_stationarity_and_min_norm():
    ds = torch.stack([rand(4, 8, seed=50 + k) for k in range(2)])
    Gs = [gram(rand(3, 8, seed=60 + k)) for k in range(2)]  # Σ rows = 6 < 8
    out = lot_linear(ds, Gs)
    stationarity = sum((out - d) @ G for d, G in zip(ds, Gs))
    assert float(stationarity.abs().max()) < 1e-10
    A = sum(Gs)
    I_minus_Pi = torch.eye(8, dtype=D) - torch.linalg.pinv(A) @ A
    assert float((out @ I_minus_Pi).abs().max()) < 1e-10


def test_fused_equals_split_and_invariances():
    Gs = [gram(rand(12, 5, seed=70 + k)) for k in range(3)]
    q, k_ = torch.stack([rand(3, 5, seed=80 + t) for t in range(3)]), torch.stack([rand(2, 5, seed=90 + t) for t in range(3)])
    fused = lot_linear(torch.cat([q, k_], dim=1), Gs)
    torch.testing.assert_close(fused, torch.cat([lot_linear(q, Gs), lot_linear(k_, Gs)]), rtol=0, atol=1e-12)
    base = lot_linear(q, Gs)
    torch.testing.assert_close(lot_linear(q[[2, 0, 1]], [Gs[2], Gs[0], Gs[1]]), base, rtol=0, atol=1e-12)
    torch.testing.assert_close(lot_linear(q, [4.0 * G for G in Gs]), base, rtol=0, atol=1e-12)  # all X by c
    scaled = lot_linear(q, [Gs[0] * 9.0, Gs[1], Gs[2]])  # only X_1 by 3: its weight by 9
    A = 9 * Gs[0] + Gs[1] + Gs[2]
    ref = (9 * q[0] @ Gs[0] + q[1] @ Gs[1] + q[2] @ Gs[2]) @ torch.linalg.inv(A)
    torch.testing.assert_close(scaled, ref, rtol=0, atol=1e-10)


def test_solvers_and_unreached():
    G = gram(rand(3, 6, seed=100))
    B = rand(2, 6, seed=101) @ G
    pinv = solve_right(B, G)
    ridge = solve_right(B, G, eps=1e-3, solver="ridge")
    assert float((ridge - pinv).norm()) < 0.05 * float(pinv.norm())  # close, slightly shrunk
    assert float(ridge.norm()) < float(pinv.norm())
    assert torch.equal(lot_linear(rand(2, 3, 4, seed=102), [None, None]), torch.zeros(3, 4, dtype=D))


def test_scale_and_add_rules():
    ds = torch.stack([rand(6, seed=110 + k) for k in range(3)])
    torch.testing.assert_close(weighted_mean(ds, torch.ones(3, 6, dtype=D) * 2.5), ds.mean(0))  # equal s_k
    s = torch.rand(3, 6, dtype=D, generator=torch.Generator().manual_seed(1)) + 0.1
    torch.testing.assert_close(weighted_mean(ds, s), (s * ds).sum(0) / s.sum(0))
    n = torch.tensor([10.0, 30.0, 60.0], dtype=D)
    torch.testing.assert_close(weighted_mean(ds, n), (0.1 * ds[0] + 0.3 * ds[1] + 0.6 * ds[2]))
    zero = weighted_mean(ds, torch.zeros(3, 6, dtype=D))
    assert torch.equal(zero, torch.zeros(6, dtype=D))


# --- tiny models with exemplars -----------------------------------------------------------

def add_char_tokenizer(folder):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)
    return folder


def write_exemplars(path, seed, n=64, lo=8, hi=40):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            text = CHARS if i == 0 else "".join(rng.choice(CHARS) for _ in range(rng.randint(lo, hi)))
            f.write(json.dumps({"text": text, "label": i % 2}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("lot")
    out = {}
    for arch in ("llama", "gpt2"):
        base = add_char_tokenizer(make_base(arch, str(root / f"{arch}-base")))
        fts = [make_finetune(base, str(root / f"{arch}-ft{i}"), seed=i) for i in (1, 2)]
        out[arch] = (base, fts)
    out["ex"] = [write_exemplars(root / f"ex{i}.jsonl", seed=i) for i in (1, 2)]
    out["root"] = root
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lot_with_one_task_returns_that_tasks_weights(zoo, tmp_path, arch):
    base, fts = zoo[arch]
    # GPT-2's linears read LayerNorm outputs, centred rows: their Gram has one tiny eigenvalue that the
    # default eps (1e-6·λ_max) treats as unexcited; with a smaller cut-off the features are full rank
    eps = 1e-12 if arch == "gpt2" else 1e-6
    # at λ = 1 (the default λ = 1.5 scales the merged task vector past it)
    res = hubsoup.merge(fts[:1], method="lot", base=base, out=str(tmp_path / "o"), quiet=True,
                        exemplars={"1": zoo["ex"][0]}, eps=eps, scale=1.0)
    merged, ft, b = state(res.path), state(fts[0]), state(base)
    seen = torch.tensor([i + 2 for i in range(len(CHARS))])  # the char tokens; [PAD] only pads, [UNK] never
    for k in ft:
        if arch == "llama" and k == "model.embed_tokens.weight":  # a lookup: unseen tokens keep θ_0
            torch.testing.assert_close(merged[k][seen], ft[k][seen], rtol=0, atol=1e-5)
            unseen = torch.ones(ft[k].shape[0], dtype=torch.bool)
            unseen[seen] = False
            assert torch.equal(merged[k][unseen], b[k][unseen])
            continue
        torch.testing.assert_close(merged[k], ft[k], rtol=0, atol=1e-4, msg=k)


def _expert_gram(folder, exemplars, module, tokenizer_folder):
    """An independent capture: transformers model + one forward hook, padding masked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = [json.loads(line)["text"] for line in open(exemplars)]
    enc = tok(texts, padding=True, return_tensors="pt")
    rows = []
    h = model.get_submodule(module).register_forward_hook(lambda m, i, o: rows.append(i[0][enc["attention_mask"].bool()]))
    with torch.no_grad():
        model(**enc)
    h.remove()
    X = rows[0].double()
    return X.T @ X


def test_full_rank_features_equal_regmean(zoo, tmp_path):
    base, fts = zoo["llama"]
    res = hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "o"), quiet=True, scale=1.0,  # RegMean's λ
                        exemplars=[f"{os.path.basename(fts[0])}={zoo['ex'][0]}", f"2={zoo['ex'][1]}"])
    merged = state(res.path)
    for module in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.v_proj"):
        Gs = [_expert_gram(f, e, module, base) for f, e in zip(fts, zoo["ex"])]
        assert torch.linalg.matrix_rank(sum(Gs)) == Gs[0].shape[0]  # full rank: RegMean's regime
        Ws = [state(f)[module + ".weight"].double() for f in fts]
        regmean = sum(W @ G for W, G in zip(Ws, Gs)) @ torch.linalg.inv(sum(Gs))
        torch.testing.assert_close(merged[module + ".weight"].double(), regmean, rtol=0, atol=1e-4)
    k = "model.norm.weight"  # a scale op: between the two experts, not their plain mean in general
    lo = torch.minimum(state(fts[0])[k], state(fts[1])[k]) - 1e-6
    hi = torch.maximum(state(fts[0])[k], state(fts[1])[k]) + 1e-6
    assert bool(((merged[k] >= lo) & (merged[k] <= hi)).all())


def test_chunked_capture_equals_one_pass_and_scale(zoo, tmp_path):
    base, fts = zoo["gpt2"]
    ex = {"1": zoo["ex"][0], "2": zoo["ex"][1]}
    kw = dict(quiet=True, exemplars=ex, n_exemplars=16, batch_size=16)
    one = state(hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "a"), **kw).path)
    many = state(hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "b"), gram_budget_gb=1e-8,
                               **kw).path)  # one op per forward pass
    for k in one:
        torch.testing.assert_close(many[k], one[k], rtol=0, atol=1e-6, msg=k)
    half = state(hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "c"), scale=0.75, **kw).path)
    b = state(base)
    k = "transformer.h.1.mlp.c_fc.weight"
    torch.testing.assert_close(half[k] - b[k], 0.5 * (one[k] - b[k]), rtol=0, atol=1e-6)  # λ 0.75 vs the default 1.5


def test_cli_lot_and_recipe(zoo, tmp_path):
    base, fts = zoo["llama"]
    out = tmp_path / "cli"
    rc = cli_main(["merge", *fts, "--base", base, "--method", "lot", "--exemplars", f"1={zoo['ex'][0]}",
                   "--exemplars", f"2={zoo['ex'][1]}", "-p", "n_exemplars=16", "--out", str(out), "-q"])
    assert rc == 0
    recipe = open(out / "hubsoup_recipe.yaml").read()
    assert "exemplars" in recipe and "ex1.jsonl" in recipe and "n_exemplars: 16" in recipe


# --- bad input ------------------------------------------------------------------------------

def test_lot_without_exemplars(zoo, tmp_path):
    base, fts = zoo["llama"]
    with pytest.raises(ParameterError, match="exemplars"):
        hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "o"), quiet=True)
    with pytest.raises(MethodError, match="none for input 2"):
        hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "o"), quiet=True, exemplars={"1": zoo["ex"][0]})
    with pytest.raises(MethodError, match="names no input"):
        hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "o"), quiet=True,
                      exemplars={"1": zoo["ex"][0], "2": zoo["ex"][1], "nope": zoo["ex"][1]})
    with pytest.raises(ParameterError, match="no parameter 'exemplars'"):
        hubsoup.merge(fts, method="ties", base=base, out=str(tmp_path / "o"), quiet=True, exemplars={"1": "x"})
    assert not os.path.exists(tmp_path / "o")
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_exemplars_that_cannot_be_tokenized(zoo, tmp_path, capsys):
    base, fts = zoo["llama"]
    root = zoo["root"]

    def lot(ex2, b=base):
        return hubsoup.merge(fts, method="lot", base=b, out=str(tmp_path / "o"), quiet=True,
                             exemplars={"1": zoo["ex"][0], "2": ex2})

    numbers = root / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"x": i, "y": 2 * i}) + "\n" for i in range(5)))
    with pytest.raises(ExemplarError, match="which column"):
        lot(str(numbers))
    blank = root / "blank.jsonl"
    blank.write_text(json.dumps({"text": "abc"}) + "\n" + json.dumps({"text": "   "}) + "\n")
    with pytest.raises(ExemplarError, match="cannot be tokenized"):
        lot(str(blank))
    with pytest.raises(ExemplarError, match="cannot load"):
        lot(str(root / "missing-dir" / "nothing"))  # neither a file nor a Hub dataset (offline)
    with pytest.raises(ExemplarError, match="unknown file type"):
        lot(__file__)  # a .py file
    big = root / "ids.jsonl"
    big.write_text(json.dumps({"input_ids": [1, 2, 500]}) + "\n")
    with pytest.raises(ExemplarError, match="outside the model's vocabulary"):
        lot(str(big))
    no_tok = make_base("llama", str(root / "no-tok-base"))
    plain = [make_finetune(no_tok, str(root / "no-tok-ft"), seed=3)]
    with pytest.raises(ExemplarError, match="no tokenizer"):
        hubsoup.merge(plain, method="lot", base=no_tok, out=str(tmp_path / "o"), quiet=True,
                      exemplars={"1": zoo["ex"][0]})
    assert not os.path.exists(tmp_path / "o")
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]
    rc = cli_main(["merge", *fts, "--base", base, "--method", "lot", "--exemplars", f"1={zoo['ex'][0]}",
                   "--exemplars", f"2={numbers}", "--out", str(tmp_path / "o")])
    assert rc == 2 and "which column" in capsys.readouterr().err
    with pytest.raises(HubsoupError, match="TASK=PATH"):
        hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "o"), quiet=True, exemplars=["nothing"])


def test_exemplars_from_a_hub_dataset(hub, zoo, tmp_path):
    base, fts = zoo["llama"]
    api = hub.api("alice")
    api.create_repo("alice/task2-texts", repo_type="dataset")
    api.upload_file(path_or_fileobj=zoo["ex"][1], path_in_repo="train.jsonl", repo_id="alice/task2-texts",
                    repo_type="dataset")
    hub.login("alice")
    res = hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "hub"), quiet=True,
                        exemplars={"1": zoo["ex"][0], "2": "alice/task2-texts:train"})
    local = hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / "local"), quiet=True,
                          exemplars={"1": zoo["ex"][0], "2": zoo["ex"][1]})
    got, want = state(res.path), state(local.path)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_lot_on_a_lora_input_equals_lot_on_its_dense_model(zoo, tmp_path):
    from tests.sources.test_lora import densify, make_adapter

    base, fts = zoo["llama"]
    adapter = make_adapter(tmp_path / "adapter", "llama", seed=4, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    dense = densify("llama", base, adapter, tmp_path / "dense")
    ex = {"1": zoo["ex"][0], "2": zoo["ex"][1]}
    a = hubsoup.merge([fts[0], adapter], method="lot", base=base, out=str(tmp_path / "a"), quiet=True, exemplars=ex)
    b = hubsoup.merge([fts[0], dense], method="lot", base=base, out=str(tmp_path / "b"), quiet=True, exemplars=ex)
    assert [r.kind for r in a.inputs] == ["full", "lora"]
    got, want = state(a.path), state(b.path)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)


def test_lines_over_lot_gets_the_exemplar_features(zoo, tmp_path):
    """A modifier hands prepare()/finish() to the method it wraps: LiNeS over LOT runs LOT's capture."""
    base, fts = zoo["llama"]
    res = hubsoup.merge(fts, "lines", base=base, out=str(tmp_path / "o"), quiet=True,
                        params={"base_method": "lot", "exemplars": [f"1={zoo['ex'][0]}", f"2={zoo['ex'][1]}"],
                                "n_exemplars": 8, "beta": 0.5})
    assert res.params["base_params"]["n_exemplars"] == 8
    assert "lot.features" in res.stats


def test_a_search_over_lambda_runs_the_experts_once(zoo, tmp_path, monkeypatch):
    """LOT's λ acts in the merge only: a search over it captures the exemplar features once, every point
    equals its own merge, and the Gram scratch folder is gone when the search ends (also on failure)."""
    from safetensors.torch import load_file

    from hubsoup.methods.lot import Lot
    from hubsoup.workflows.search import search

    base, fts = zoo["llama"]
    ex = {"1": zoo["ex"][0], "2": zoo["ex"][1]}
    kw = dict(quiet=True, exemplars=ex, n_exemplars=16)
    calls, stores = [], []
    real = Lot.prepare

    def prepare(self, params, ctx):
        out = real(self, params, ctx)
        calls.append(params.scale)
        stores.append(out["lot.features"])
        return out

    monkeypatch.setattr(Lot, "prepare", prepare)
    seen = []

    def score(folder):
        seen.append(load_file(os.path.join(folder, "model.safetensors")))
        return float(len(seen))  # the last point wins

    search(fts, "lot", base=base, out=str(tmp_path / "s"), grid={"scale": [0.5, 1.5]}, score_fn=score, **kw)
    assert len(calls) == 1 and len(seen) == 2
    assert stores[0]._tmp is None  # closed: its scratch folder removed
    for got, lam in zip(seen, (0.5, 1.5)):
        ref = state(hubsoup.merge(fts, method="lot", base=base, out=str(tmp_path / f"r{lam}"), scale=lam, **kw).path)
        assert all(torch.equal(got[k], ref[k]) for k in ref)

    def failing(folder):
        raise RuntimeError("scoring failed")

    calls.clear()
    with pytest.raises(RuntimeError, match="scoring failed"):
        search(fts, "lot", base=base, out=str(tmp_path / "f"), grid={"scale": [0.5, 1.5]}, score_fn=failing, **kw)
    assert len(calls) == 1 and stores[-1]._tmp is None
    assert not (tmp_path / "f").exists()
    calls.clear()
    stores.clear()
    open_then = []

    def score_open(folder):  # which stores hold Gram files while each point is scored
        open_then.append([st._tmp is not None for st in stores])
        return 0.0

    search(fts, "lot", base=base, out=str(tmp_path / "n"), grid={"n_exemplars": [8, 16]}, score_fn=score_open,
           quiet=True, exemplars=ex)
    assert len(calls) == 2  # what the capture reads changed: captured again
    assert open_then == [[True], [False, True]]  # one set of Gram files at a time
    assert all(st._tmp is None for st in stores)

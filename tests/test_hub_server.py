"""The local Hub server, driven by the real huggingface_hub / transformers / peft clients."""

from __future__ import annotations

import hashlib
import json
import re

import httpx2
import pytest
import torch
from huggingface_hub import (
    HfApi,
    ModelCard,
    ModelCardData,
    constants,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hub_server import ALICE_READ_TOKEN, ALICE_WRITE_TOKEN, BOB_WRITE_TOKEN, git_blob_oid, lfs_pointer

SHA_RE = re.compile(r"^[0-9a-f]{40}$")


# ---- tiny models, built once per module ------------------------------------------------------


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=37)
    model = transformers.BertModel(config)
    model.save_pretrained(folder)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "soup", "model", "merge", "hub", "##s"]
    transformers.BertTokenizer(vocab={w: i for i, w in enumerate(words)}).save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def _tiny_llama(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).eval()


# ---- repos: create / exist_ok / private / delete ----------------------------------------------


def test_offline_by_default_and_online_inside_hub(hub):
    assert constants.HF_HUB_OFFLINE is False
    assert hub.endpoint == constants.ENDPOINT
    assert hub.api("alice").whoami()["name"] == "alice"


def test_suite_default_is_offline():
    assert constants.HF_HUB_OFFLINE is True
    with pytest.raises(Exception, match="offline"):
        HfApi().model_info("alice/anything")


def test_create_repo_exist_ok_and_delete(hub):
    api = hub.api("alice")
    url = api.create_repo("soup")
    assert url.repo_id == "alice/soup" and url.endpoint == hub.endpoint
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo("alice/soup")
    assert err.value.response.status_code == 409
    assert api.create_repo("alice/soup", exist_ok=True).repo_id == "alice/soup"
    # Repo names only, and organisations the user belongs to.
    assert api.create_repo("soup-org/shared").repo_id == "soup-org/shared"
    assert api.repo_exists("alice/soup")
    api.delete_repo("alice/soup")
    assert not api.repo_exists("alice/soup")
    with pytest.raises(RepositoryNotFoundError):
        api.delete_repo("alice/soup")
    api.delete_repo("alice/soup", missing_ok=True)


def test_private_repo_needs_the_owner_token(hub):
    api = hub.api("alice")
    api.create_repo("secret", private=True)
    api.upload_file(path_or_fileobj=b"hidden", path_in_repo="notes.txt", repo_id="alice/secret")
    assert api.model_info("alice/secret").private is True

    # Anonymous: 401 + RepoNotFound -> RepositoryNotFoundError, for the API and for downloads.
    with pytest.raises(RepositoryNotFoundError) as err:
        hub.api().model_info("alice/secret")
    assert err.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("alice/secret", "notes.txt", token=False)
    # Another user: 404 + RepoNotFound.
    with pytest.raises(RepositoryNotFoundError) as err:
        hub.api("bob").model_info("alice/secret")
    assert err.value.response.status_code == 404
    # The owner, even with a read token, and through the implicit HF_TOKEN.
    path = hf_hub_download("alice/secret", "notes.txt", token=ALICE_READ_TOKEN)
    assert open(path, "rb").read() == b"hidden"
    hub.login("alice", write=False)
    assert HfApi().model_info("alice/secret").id == "alice/secret"
    # Making it public opens it to everyone.
    api.update_repo_settings("alice/secret", private=False)
    assert hub.api().model_info("alice/secret").private is False


def test_write_permissions(hub):
    hub.api("alice").create_repo("mine")
    bob = hub.api("bob")
    with pytest.raises(HfHubHTTPError) as err:
        bob.create_repo("alice/stolen")
    assert err.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as err:
        bob.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="alice/mine")
    assert err.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as err:
        bob.create_repo("soup-org/nope")
    assert err.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as err:  # read token of the owner
        hub.api("alice", write=False).upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="alice/mine")
    assert err.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as err:  # anonymous
        hub.api().create_repo("alice/anon")
    assert err.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as err:  # unknown token
        HfApi(token="hf_bogus").model_info("alice/mine")
    assert err.value.response.status_code == 401
    assert not isinstance(err.value, RepositoryNotFoundError)
    assert hub.files("alice/mine") == {".gitattributes": hub.files("alice/mine")[".gitattributes"]}


# ---- upload + transformers round trip ---------------------------------------------------------


def test_upload_folder_then_transformers_loads_identical_model(hub, bert_dir):
    import transformers

    folder, state = bert_dir
    api = hub.api("alice")
    api.create_repo("tiny-bert")
    info = api.upload_folder(repo_id="alice/tiny-bert", folder_path=folder, commit_message="Add tiny BERT")
    assert SHA_RE.match(info.oid) and info.commit_url.endswith(f"/alice/tiny-bert/commit/{info.oid}")
    assert info.pr_url is None

    files = set(api.list_repo_files("alice/tiny-bert"))
    assert {".gitattributes", "config.json", "model.safetensors", "tokenizer_config.json"} <= files
    minfo = api.model_info("alice/tiny-bert", files_metadata=True)
    assert minfo.sha == info.oid
    assert {s.rfilename for s in minfo.siblings} == files
    weights = next(s for s in minfo.siblings if s.rfilename == "model.safetensors")
    assert weights.size == (folder / "model.safetensors").stat().st_size
    content = (folder / "model.safetensors").read_bytes()
    # an LFS file, as on the Hub: its git blob is the pointer file; its object is named by its sha256
    assert weights.lfs.sha256 == hashlib.sha256(content).hexdigest() and weights.lfs.size == len(content)
    assert weights.blob_id == git_blob_oid(lfs_pointer(weights.lfs.sha256, len(content)))
    assert minfo.config["model_type"] == "bert"

    hub.login("alice")
    config = transformers.AutoConfig.from_pretrained("alice/tiny-bert")
    assert config.hidden_size == 32 and config.num_hidden_layers == 2
    model = transformers.AutoModel.from_pretrained("alice/tiny-bert")
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    tok = transformers.AutoTokenizer.from_pretrained("alice/tiny-bert")
    assert tok.convert_tokens_to_ids(["soup", "hub"]) == [5, 8]
    assert hub.unhandled == []


def test_old_commit_sha_still_serves_old_content(hub):
    api = hub.api("alice")
    api.create_repo("history")
    first = api.upload_file(path_or_fileobj=b"v1", path_in_repo="weights.txt", repo_id="alice/history",
                            commit_message="first")
    second = api.upload_file(path_or_fileobj=b"v2", path_in_repo="weights.txt", repo_id="alice/history",
                             commit_message="second")
    assert first.oid != second.oid

    latest = hf_hub_download("alice/history", "weights.txt")
    old = hf_hub_download("alice/history", "weights.txt", revision=first.oid)
    assert open(latest, "rb").read() == b"v2"
    assert open(old, "rb").read() == b"v1"
    assert open(hf_hub_download("alice/history", "weights.txt", revision=first.oid[:10]), "rb").read() == b"v1"
    snap = snapshot_download("alice/history", revision=first.oid)
    assert snap.endswith(first.oid) and open(f"{snap}/weights.txt", "rb").read() == b"v1"

    commits = api.list_repo_commits("alice/history")
    assert [c.commit_id for c in commits[:2]] == [second.oid, first.oid]
    assert [c.title for c in commits] == ["second", "first", "initial commit"]
    assert commits[0].authors == ["alice"] and commits[-1].authors == ["system"]
    assert [c.commit_id for c in api.list_repo_commits("alice/history", revision=first.oid)][0] == first.oid
    refs = api.list_repo_refs("alice/history")
    assert [(b.name, b.target_commit) for b in refs.branches] == [("main", second.oid)]

    (info,) = api.get_paths_info("alice/history", ["weights.txt", "missing.txt"], revision=first.oid)
    assert info.blob_id == git_blob_oid(b"v1") and info.size == 2

    # Deleting a file, and a delete of a missing file.
    api.delete_file("weights.txt", repo_id="alice/history")
    assert "weights.txt" not in api.list_repo_files("alice/history")
    assert "weights.txt" in api.list_repo_files("alice/history", revision=second.oid)
    with pytest.raises(RemoteEntryNotFoundError):
        api.delete_file("weights.txt", repo_id="alice/history")


def test_tree_folders_pagination_branches_and_tags(hub):
    api = hub.api("alice")
    api.create_repo("tree")
    from huggingface_hub import CommitOperationAdd

    ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=p.encode())
           for p in ["a.txt", "sub/b.txt", "sub/deep/c.txt", "sub/deep/d.txt"]]
    commit = api.create_commit("alice/tree", ops, commit_message="tree")
    hub.page_size = 2  # force the Link-header pagination
    top = {e.path: type(e).__name__ for e in api.list_repo_tree("alice/tree")}
    assert top == {".gitattributes": "RepoFile", "a.txt": "RepoFile", "sub": "RepoFolder"}
    everything = [e.path for e in api.list_repo_tree("alice/tree", recursive=True)]
    assert sorted(everything) == sorted([".gitattributes", "a.txt", "sub", "sub/b.txt", "sub/deep",
                                         "sub/deep/c.txt", "sub/deep/d.txt"])
    assert len(hub.calls("GET", r"/tree/")) > 2
    assert [e.path for e in api.list_repo_tree("alice/tree", path_in_repo="sub/deep")] == [
        "sub/deep/c.txt", "sub/deep/d.txt"]
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree("alice/tree", path_in_repo="nope"))

    api.create_branch("alice/tree", branch="dev")
    api.upload_file(path_or_fileobj=b"dev only", path_in_repo="dev.txt", repo_id="alice/tree", revision="dev")
    api.create_tag("alice/tree", tag="v1", revision=commit.oid)
    assert "dev.txt" in api.list_repo_files("alice/tree", revision="dev")
    assert "dev.txt" not in api.list_repo_files("alice/tree", revision="v1")
    refs = api.list_repo_refs("alice/tree")
    assert {b.name for b in refs.branches} == {"main", "dev"}
    assert [(t.name, t.target_commit) for t in refs.tags] == [("v1", commit.oid)]
    with pytest.raises(RevisionNotFoundError):
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="alice/tree", revision="no-branch")


# ---- pull requests ----------------------------------------------------------------------------


def test_create_pr_gives_a_downloadable_pr_ref(hub):
    api = hub.api("alice")
    api.create_repo("prs")
    base = api.upload_file(path_or_fileobj=b"base", path_in_repo="a.txt", repo_id="alice/prs")
    pr = api.upload_file(path_or_fileobj=b"proposed", path_in_repo="a.txt", repo_id="alice/prs",
                         create_pr=True, commit_message="Propose")
    assert pr.pr_url.endswith("/alice/prs/discussions/1")
    assert pr.pr_revision == "refs/pr/1" and pr.pr_num == 1
    assert hub.head("alice/prs") == base.oid  # main untouched
    assert open(hf_hub_download("alice/prs", "a.txt", revision="refs/pr/1"), "rb").read() == b"proposed"
    assert open(hf_hub_download("alice/prs", "a.txt"), "rb").read() == b"base"

    # More commits on the PR branch, and PRs opened by someone who cannot write to main.
    api.upload_file(path_or_fileobj=b"more", path_in_repo="b.txt", repo_id="alice/prs", revision="refs/pr/1")
    assert api.list_repo_files("alice/prs", revision="refs/pr/1") == [".gitattributes", "a.txt", "b.txt"]
    bob_pr = hub.api("bob").upload_file(path_or_fileobj=b"bob", path_in_repo="c.txt", repo_id="alice/prs",
                                        create_pr=True)
    assert bob_pr.pr_revision == "refs/pr/2"
    refs = api.list_repo_refs("alice/prs", include_pull_requests=True)
    assert [r.ref for r in refs.pull_requests] == ["refs/pr/1", "refs/pr/2"]
    assert api.list_repo_files("alice/prs") == [".gitattributes", "a.txt"]


# ---- model cards ------------------------------------------------------------------------------


def test_model_card_push_and_load(hub):
    hub.api("alice").create_repo("carded")
    data = ModelCardData(license="apache-2.0", tags=["merge", "hubsoup"], library_name="transformers")
    card = ModelCard.from_template(data, model_description="A soup of two tiny models.")
    card.push_to_hub("alice/carded", token=ALICE_WRITE_TOKEN)

    loaded = ModelCard.load("alice/carded")
    assert loaded.data.license == "apache-2.0"
    assert loaded.data.tags == ["merge", "hubsoup"]
    assert "A soup of two tiny models." in loaded.text
    info = hub.api().model_info("alice/carded")
    assert info.card_data.license == "apache-2.0"
    assert info.tags == ["merge", "hubsoup"] and info.library_name == "transformers"
    # Broken metadata is refused (by /api/validate-yaml) before anything is committed.
    with pytest.raises(ValueError, match="(?i)invalid"):
        hub.api("alice").upload_file(path_or_fileobj=b"---\n- a list\n---\nhi", path_in_repo="README.md",
                                     repo_id="alice/carded")
    assert len(hub.history("alice/carded")) == 2


# ---- errors raised by the real client ---------------------------------------------------------


def test_not_found_errors(hub):
    api = hub.api("alice")
    api.create_repo("errs")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("alice/does-not-exist", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("alice/does-not-exist")
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("alice/does-not-exist")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("alice/errs", ".gitattributes", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        api.model_info("alice/errs", revision="0" * 40)
    with pytest.raises(RemoteEntryNotFoundError) as err:
        hf_hub_download("alice/errs", "config.json")
    assert SHA_RE.match(err.value.response.headers["X-Repo-Commit"])
    assert not api.file_exists("alice/errs", "config.json")
    assert api.file_exists("alice/errs", ".gitattributes")
    assert not api.revision_exists("alice/errs", "nope")
    import transformers

    with pytest.raises(OSError, match="alice/does-not-exist"):
        transformers.AutoConfig.from_pretrained("alice/does-not-exist")
    with pytest.raises(OSError, match="no-such-branch"):
        transformers.AutoModel.from_pretrained("alice/errs", revision="no-such-branch")


# ---- failure injection ------------------------------------------------------------------------


def test_injected_commit_failure_then_retry(hub, tmp_path):
    api = hub.api("alice")
    api.create_repo("flaky")
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    before = hub.head("alice/flaky")

    hub.fail_commits(1, status=500)
    with pytest.raises(HfHubHTTPError) as err:
        api.upload_folder(repo_id="alice/flaky", folder_path=tmp_path)
    assert err.value.response.status_code == 500
    assert hub.head("alice/flaky") == before and hub.pending_failures == 0
    info = api.upload_folder(repo_id="alice/flaky", folder_path=tmp_path)  # the retry
    assert hub.head("alice/flaky") == info.oid
    assert hub.files("alice/flaky")["b.txt"] == b"beta"
    assert [c["status"] for c in hub.calls("POST", r"/commit/")] == [500, 200]

    # A dropped connection, and a commit that lands but whose answer is lost.
    (tmp_path / "c.txt").write_text("gamma")
    hub.fail_commits(1, drop=True)
    with pytest.raises(httpx2.RemoteProtocolError):  # huggingface_hub 2.4 talks through httpx2
        api.upload_folder(repo_id="alice/flaky", folder_path=tmp_path)
    assert hub.calls("POST", r"/commit/")[-1]["status"] == 0  # logged as 0: no answer was sent
    hub.fail_commits(1, status=502, when="after")
    with pytest.raises(HfHubHTTPError):
        api.upload_folder(repo_id="alice/flaky", folder_path=tmp_path)
    landed = hub.head("alice/flaky")
    assert landed != info.oid and hub.files("alice/flaky")["c.txt"] == b"gamma"
    # Retrying an upload whose content is already there is a no-op: no new commit.
    again = api.upload_folder(repo_id="alice/flaky", folder_path=tmp_path)
    assert again.oid == landed == hub.head("alice/flaky")


def test_injected_download_failure(hub):
    api = hub.api("alice")
    api.create_repo("dl")
    api.upload_file(path_or_fileobj=b"payload", path_in_repo="f.bin", repo_id="alice/dl")
    # A 5xx on the metadata HEAD is retried by hf_hub_download itself...
    hub.fail_next(1, 503, method="HEAD", path=r"/resolve/")
    assert open(hf_hub_download("alice/dl", "f.bin"), "rb").read() == b"payload"
    assert [c["status"] for c in hub.calls("HEAD", r"/resolve/")] == [503, 200]
    # ... a 5xx on the GET of the content is not.
    hub.fail_next(1, 500, method="GET", path=r"/resolve/")
    with pytest.raises(HfHubHTTPError) as err:
        hf_hub_download("alice/dl", "f.bin", force_download=True)
    assert err.value.response.status_code == 500
    assert open(hf_hub_download("alice/dl", "f.bin", force_download=True), "rb").read() == b"payload"


# ---- LFS: the batch API, uploads, objects kept across commits -----------------------------------


def _raw_commit(hub, repo_id: str, lines: list[dict], token: str) -> httpx2.Response:
    body = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    return httpx2.post(f"{hub.endpoint}/api/models/{repo_id}/commit/main", content=body,
                       headers={"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"})


def test_safetensors_go_through_lfs_and_resolve_as_the_hub_serves_them(hub):
    from huggingface_hub import CommitOperationAdd, get_hf_file_metadata, hf_hub_url

    api = hub.api("alice")
    api.create_repo("alice/lfs")
    weights, text = bytes(range(256)) * 40, b'{"a": 1}'
    sha = hashlib.sha256(weights).hexdigest()
    info = api.create_commit("alice/lfs", [CommitOperationAdd("model.safetensors", weights),
                                           CommitOperationAdd("config.json", text)], commit_message="up")
    assert hub.lfs_uploads == [{"repo": "alice/lfs", "oid": sha, "size": len(weights)}]
    assert hub.lfs_uploaded_bytes == len(weights) and hub.lfs_uploaded_objects == 1
    assert hub.calls("POST", r"^/alice/lfs\.git/info/lfs/objects/batch$")[-1]["status"] == 200
    assert hub.files("alice/lfs")["model.safetensors"] == weights  # the content, not the pointer
    assert open(hf_hub_download("alice/lfs", "model.safetensors", token=hub.token("alice")), "rb").read() == weights
    meta = get_hf_file_metadata(hf_hub_url("alice/lfs", "model.safetensors"), token=hub.token("alice"))
    assert (meta.etag, meta.size, meta.commit_hash) == (sha, len(weights), info.oid)  # X-Linked-Etag / -Size
    (entry,) = api.get_paths_info("alice/lfs", ["model.safetensors"])
    assert entry.lfs.sha256 == sha and entry.lfs.size == len(weights) and entry.size == len(weights)
    (regular,) = api.get_paths_info("alice/lfs", ["config.json"])
    assert regular.lfs is None and regular.blob_id == git_blob_oid(text)
    sibling = next(x for x in api.model_info("alice/lfs", files_metadata=True).siblings
                   if x.rfilename == "model.safetensors")
    assert sibling.lfs.sha256 == sha and sibling.lfs.pointer_size == len(lfs_pointer(sha, len(weights)))

    # the same content again, elsewhere in the repo: the batch API says it is there, nothing is uploaded
    api.upload_file(path_or_fileobj=weights, path_in_repo="copy/model.safetensors", repo_id="alice/lfs")
    assert hub.lfs_uploaded_objects == 1 and hub.files("alice/lfs")["copy/model.safetensors"] == weights
    # a binary file and a 10 MB one are LFS whatever .gitattributes says; a small text file is not
    modes = {f["path"]: f["uploadMode"] for f in httpx2.post(
        f"{hub.endpoint}/api/models/alice/lfs/preupload/main", headers={"Authorization": f"Bearer {hub.token('alice')}"},
        json={"files": [{"path": "a.txt", "size": 3, "sample": "YWJj"},
                        {"path": "b.txt", "size": 3, "sample": "AAAA"},
                        {"path": "c.txt", "size": 10 * 1024 * 1024, "sample": "YWJj"}]}).json()["files"]}
    assert modes == {"a.txt": "regular", "b.txt": "lfs", "c.txt": "lfs"}


def test_preuploaded_objects_are_invisible_until_a_commit_names_them_and_kept_after_a_failed_one(hub):
    from huggingface_hub import CommitOperationAdd

    api = hub.api("alice")
    api.create_repo("alice/pre")
    before = hub.files("alice/pre")
    op = CommitOperationAdd("model-00001-of-00002.safetensors", b"\x01" * 5000)
    api.preupload_lfs_files("alice/pre", additions=[op])
    sha = op.upload_info.sha256.hex()
    assert op._is_uploaded and sha in hub.lfs_held("alice/pre") and hub.lfs_uploaded_objects == 1
    assert hub.files("alice/pre") == before and len(hub.history("alice/pre")) == 1  # nothing visible
    hub.fail_commits(1, status=500)
    with pytest.raises(HfHubHTTPError):
        api.create_commit("alice/pre", [op], commit_message="shards")
    assert hub.files("alice/pre") == before
    # a rerun: new operations for the same bytes upload nothing, the commit lands
    again = CommitOperationAdd("model-00001-of-00002.safetensors", b"\x01" * 5000)
    api.preupload_lfs_files("alice/pre", additions=[again])
    assert hub.lfs_uploaded_objects == 1
    api.create_commit("alice/pre", [again], commit_message="shards")
    assert hub.files("alice/pre")["model-00001-of-00002.safetensors"] == b"\x01" * 5000

    # a commit naming an object the repo does not hold is refused, as the Hub refuses it
    unknown = hashlib.sha256(b"never uploaded").hexdigest()
    resp = _raw_commit(hub, "alice/pre", [{"key": "header", "value": {"summary": "bad"}},
                                          {"key": "lfsFile", "value": {"path": "x.safetensors", "algo": "sha256",
                                                                       "oid": unknown, "size": 14}}],
                       hub.token("alice"))
    assert resp.status_code == 422 and "does not exist" in resp.headers["X-Error-Message"]
    # nor one held by another repo: objects belong to the repo they were uploaded to
    api.create_repo("alice/other")
    resp = _raw_commit(hub, "alice/other", [{"key": "header", "value": {"summary": "steal"}},
                                            {"key": "lfsFile", "value": {"path": "x.safetensors", "algo": "sha256",
                                                                         "oid": sha, "size": 5000}}],
                       hub.token("alice"))
    assert resp.status_code == 422
    # a deleted repo's objects go with it
    api.delete_repo("alice/pre")
    assert hub.lfs_held("alice/pre") == set()


def test_lfs_uploads_need_write_access_and_their_bytes_must_match(hub):
    payload = {"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256", "ref": {"name": "main"},
               "objects": [{"oid": hashlib.sha256(b"abc").hexdigest(), "size": 3}]}
    hub.api("alice").create_repo("alice/w")
    url = f"{hub.endpoint}/alice/w.git/info/lfs/objects/batch"
    assert httpx2.post(url, json=payload).status_code == 401
    assert httpx2.post(url, json=payload, headers={"Authorization": f"Bearer {hub.token('bob')}"}).status_code == 403
    ok = httpx2.post(url, json=payload, headers={"Authorization": f"Bearer {hub.token('alice')}"}).json()
    href = ok["objects"][0]["actions"]["upload"]["href"]
    assert httpx2.put(href, content=b"abd").status_code == 400  # not the announced object
    assert hub.lfs_uploaded_objects == 0
    assert httpx2.put(href, content=b"abc").status_code == 200  # the URL is the credential, as a pre-signed one
    assert hub.lfs_held("alice/w") == {hashlib.sha256(b"abc").hexdigest()}


def test_multipart_lfs_upload(hub):
    from huggingface_hub import CommitOperationAdd

    hub.lfs_multipart_chunk = 1000
    api = hub.api("alice")
    api.create_repo("alice/big")
    data = bytes(range(251)) * 17  # 4267 bytes: 5 parts
    api.create_commit("alice/big", [CommitOperationAdd("model.safetensors", data)], commit_message="big")
    assert len(hub.calls("PUT", r"^/_test-lfs/part/")) == 5 and hub.calls("POST", r"^/_test-lfs/complete/")
    assert hub.files("alice/big")["model.safetensors"] == data and hub.lfs_uploaded_bytes == len(data)


def test_lfs_uploads_are_received_at_the_links_rate_on_its_other_direction(hub):
    """limit_bandwidth paces LFS upload bodies as it paces downloads (the benchmark's upload time); an upload and a
    download each have the link's rate (full duplex). Only lower bounds on time: a loaded machine is slower, never
    faster."""
    import threading
    import time

    from huggingface_hub import CommitOperationAdd, hf_hub_download

    api = hub.api("alice")
    api.create_repo("alice/up")
    api.create_repo("alice/down")
    served = bytes(range(256)) * 4096  # 1 MiB
    api.create_commit("alice/down", [CommitOperationAdd("model.safetensors", served)], commit_message="seed")
    hub.limit_bandwidth(1_000_000)
    data = bytes(reversed(range(256))) * 4096  # 1 MiB
    before = hub.received
    got: dict = {}

    def download() -> None:
        t = time.monotonic()
        path = hf_hub_download("alice/down", "model.safetensors", token=hub.token("alice"), force_download=True)
        got["seconds"] = time.monotonic() - t
        with open(path, "rb") as f:
            got["data"] = f.read()

    t0 = time.monotonic()
    reader = threading.Thread(target=download)
    reader.start()
    api.create_commit("alice/up", [CommitOperationAdd("model.safetensors", data)], commit_message="up")
    upload_seconds = time.monotonic() - t0
    reader.join(60)
    assert hub.files("alice/up")["model.safetensors"] == data and got["data"] == served
    assert hub.received - before >= len(data)
    assert upload_seconds >= 0.95 * len(data) / 1e6 and got["seconds"] >= 0.95 * len(served) / 1e6
    hub.limit_bandwidth(None)
    api.create_commit("alice/up", [CommitOperationAdd("other.safetensors", served)], commit_message="fast")
    assert hub.received - before >= 2 * len(data)  # counted when unpaced too


# ---- datasets ---------------------------------------------------------------------------------


def test_dataset_repo(hub):
    api = hub.api("alice")
    api.create_repo("evalset", repo_type="dataset")
    rows = [{"text": "hi", "label": 1}]
    api.upload_file(path_or_fileobj=json.dumps(rows).encode(), path_in_repo="data/test.json",
                    repo_id="alice/evalset", repo_type="dataset")
    snap = snapshot_download("alice/evalset", repo_type="dataset")
    assert json.load(open(f"{snap}/data/test.json")) == rows
    assert api.dataset_info("alice/evalset").sha == hub.head("alice/evalset", repo_type="dataset")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("alice/evalset")  # a dataset is not a model


# ---- peft -------------------------------------------------------------------------------------


def test_peft_lora_adapter_roundtrip(hub, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = get_peft_model(_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False))
    lora.save_pretrained(tmp_path)
    api = hub.api("alice")
    api.create_repo("tiny-lora")
    api.upload_folder(repo_id="alice/tiny-lora", folder_path=tmp_path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(api.list_repo_files("alice/tiny-lora"))

    hub.login("alice")
    loaded = PeftModel.from_pretrained(_tiny_llama(), "alice/tiny-lora").eval()
    want = {k: v for k, v in lora.state_dict().items() if "lora_" in k}
    got = loaded.state_dict()
    assert want and all(torch.equal(got[k], v) for k, v in want.items())
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, lora.eval()(ids).logits)
        assert not torch.allclose(loaded(ids).logits, _tiny_llama()(ids).logits)


# ---- seeding without HTTP, and no leaks out of the ``hub`` fixture ----------------------------


def test_seed_repo_without_http(hub, bert_dir):
    import transformers

    folder, state = bert_dir
    sha = hub.seed("bob/seeded", folder, message="seeded from a folder")
    hub.seed("bob/seeded", {"notes/extra.txt": "extra"})
    assert hub.history("bob/seeded")[1].oid == sha
    assert hub.files("bob/seeded", revision=sha).keys() == {".gitattributes"} | {
        p.name for p in folder.iterdir() if p.is_file()}
    model = transformers.AutoModel.from_pretrained("bob/seeded", revision=sha)
    assert torch.equal(model.state_dict()["pooler.dense.weight"], state["pooler.dense.weight"])
    assert open(hf_hub_download("bob/seeded", "notes/extra.txt"), "rb").read() == b"extra"


def test_hub_fixture_leaves_nothing_behind():
    import os

    assert constants.HF_HUB_OFFLINE is True
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert "HF_TOKEN" not in os.environ


def test_commit_shas_are_random_unless_derived_from_content():
    """The benchmarks' servers derive shas from content (their seeded merges repeat across runs); tests'
    servers keep them random (a re-published repo must look new)."""
    from hub_server import HubServer

    def publish(server):
        a = server.seed("alice/m", {"config.json": "{}", "w.bin": b"\x00\x01"})
        return a, server.seed("alice/m", {"README.md": "# m"})

    same = [publish(HubServer(content_shas=True)) for _ in range(2)]
    assert same[0] == same[1] and all(SHA_RE.match(s) for s in same[0]) and same[0][0] != same[0][1]
    rand = [publish(HubServer()) for _ in range(2)]
    assert rand[0][0] != rand[1][0] and rand[0][1] != rand[1][1]

"""Publishing a pipeline's merges: a merge verified against its manifest (:mod:`~hubsoup.workflows.pipeline.workfolder`),
its card rendered again with the license the pipeline decided, pushed in one commit, never into a repo that holds
something else (:func:`target_problem`)."""

from __future__ import annotations

import json
import os

from huggingface_hub import ModelCard, constants
from huggingface_hub.errors import RepositoryNotFoundError

from hubsoup.api import MergeResult, merge
from hubsoup.errors import HubsoupError
from hubsoup.untrusted import load_yaml
from hubsoup.workflows.pipeline import hubio, workfolder
from hubsoup.workflows.pipeline.context import Run
from hubsoup.workflows.pipeline.hubio import Published, with_retry
from hubsoup.workflows.pipeline.report import PUBLISHED, PlannedMerge


def _write_scored(run: Run, m: PlannedMerge) -> str | None:
    """Write a merge an executor scored into the work folder (here, once, to push it) with its evaluation."""
    try:
        workfolder.remove(workfolder.manifest_path(run, m))
        result = with_retry(
            lambda: merge([i.pinned for i in m.inputs], m.spec.method, base=run.base.pinned, out=workfolder.out_path(run, m),
                          params=dict(m.spec.params), options=run.opts.replace(overwrite=True)),
            f"merge {m.label}", run.retry)
        with open(os.path.join(result.path, hubio.EVAL_FILE), "w", encoding="utf-8") as f:
            json.dump(m.results, f, indent=2)  # what the task measured, as write_results writes it
        workfolder.write_manifest(run, m, result.path)
    except Exception as e:  # noqa: BLE001 - this merge fails; the others go on
        return run.public(e) if isinstance(e, HubsoupError) else f"{type(e).__name__}: {run.public(e)}"
    m.path = result.path
    return None


def push(run: Run, m: PlannedMerge) -> None:
    """Publish ``m`` from the work folder (verified first; one an executor scored is written here now)."""
    problem = target_problem(run, m)
    if problem == "same":
        run.line(f"skipped    {m.label}: {m.url} already holds it (published by another run meanwhile)")
        return
    if problem is None and m.path is None and m.results is not None:  # scored by an executor: written now
        problem = _write_scored(run, m)
    if problem is None:
        problem = workfolder.verify(run, m, m.path) if m.path else "no merge"
        if problem is not None:
            problem = f"not pushed: the merge in the work folder {problem}; the next run merges it again"
    if problem:
        run.failed(m, problem)
        return
    run.emit("pushing", m)
    message = f"Upload {m.spec.method} merge made with a hubsoup pipeline (recipe {m.recipe_hash[:12]})"
    try:
        assert m.path is not None  # verified above
        result = MergeResult.from_folder(m.path)
        write_card(run, m, result)
        info = with_retry(lambda: result.push_to_hub(m.repo_id, private=run.p.push.private or None,
                                                     token=run.token, commit_message=message,
                                                     allow_private_inputs=run.p.allow_private_inputs),
                          f"push of {m.repo_id}", run.retry)
    except HubsoupError as e:
        run.failed(m, run.public(e))
        return
    pushed(run, m, info)


def pushed(run: Run, m: PlannedMerge, info: object) -> None:
    """``m`` is published (``info``: the commit): its status, the run's record of the namespace, the event, a line."""
    m.status, m.action, m.url = PUBLISHED, "pushed", f"{constants.ENDPOINT}/{m.repo_id}"
    run.published[m.recipe_hash] = Published(m.repo_id, getattr(info, "oid", "") or "", m.url, m.recipe_hash,
                                              dict(m.scores))
    run.repo_hash[m.repo_id] = m.recipe_hash
    run.emit("pushed", m)
    run.line(f"pushed     {m.label} -> {m.url}")


def write_card(run: Run, m: PlannedMerge, result: MergeResult, folder: str | None = None) -> None:
    """The card, rendered again from the verified files: the license this pipeline decided (or none),
    never one inherited by default, and a note naming private or gated inputs when they were allowed."""
    d = m.license
    notes = []
    restricted = [f"`{r.repo_id}` ({r.restricted})" for r in (run.base, *m.inputs) if r.restricted]
    if restricted:
        notes.append(f"**Private or gated inputs:** {', '.join(restricted)} went into this merge; it was "
                     "published because the pipeline sets `allow_private_inputs: true`"
                     + (" (the repo is private)." if run.p.push.private else "."))
    if d.ok and d.license:
        why = f"**License:** `{d.license}`, derived from the base's and every input's license by the pipeline."
    else:
        why = ("**License:** none is set: the inputs' licenses cannot be combined and the pipeline publishes "
               f"it anyway (`license.allow_mix`): {d.reason}. Check every input's license before using it.")
    notes.append(why)
    path = result.write_card(folder, repo_id=m.repo_id, license=d.card_license if d.ok else None, notes=notes)
    card = ModelCard.load(path)
    card.data.license = d.card_license if d.ok else None  # None: no license, not the base's by default
    card.data.license_name = d.license_name if d.ok and d.card_license == "other" else None
    card.data.license_link = d.license_link if d.ok and d.card_license == "other" else None
    card.save(path)
    result.card_text = None


def target_problem(run: Run, m: PlannedMerge) -> str | None:
    """Never write into a repo that holds something else (a merge of another recipe, or any other model).

    ``"same"``: the target already holds this very merge (a concurrent run pushed it): ``m`` is published.
    """
    repo_id, h = m.repo_id, m.recipe_hash
    known = run.repo_hash.get(repo_id)
    if known is not None:
        return None if known == h else f"target {repo_id} already holds another merge (recipe {known[:12]})"
    try:
        info = with_retry(lambda: run.api.model_info(repo_id, token=run.token), f"model info of {repo_id}",
                          run.retry)
    except RepositoryNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - the push itself will say what is wrong
        return None
    files = {s.rfilename for s in info.siblings or []} - {".gitattributes"}
    if not files:
        return None  # created by a run killed before its commit: ours to fill
    if hubio.RECIPE_FILE in files:
        try:
            raw = with_retry(lambda: hubio.fetch_file(repo_id, hubio.RECIPE_FILE, "model", run.token),
                             f"recipe of {repo_id}", run.retry)
            there = (load_yaml(raw or b"", f"recipe of {repo_id}") or {}).get("hash")
        except Exception:  # noqa: BLE001 - unreadable: not ours
            there = None
        if there == h:
            m.status, m.action, m.url = PUBLISHED, "skipped (published meanwhile)", f"{constants.ENDPOINT}/{repo_id}"
            run.published[h] = Published(repo_id, info.sha or "", m.url, h, dict(m.scores))
            run.repo_hash[repo_id] = h
            return "same"
    return f"target {repo_id} exists and holds files that are not this merge; change push.name"

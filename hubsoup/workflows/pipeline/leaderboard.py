"""A pipeline's leaderboard: every merge it planned (this run's and the earlier runs' rows), ranked by the selection
metric, written to the work folder as JSON and markdown and committed to the Hub only when its content changed."""

from __future__ import annotations

import json
import os
from typing import Any

from hubsoup.hubclient import scrub_secrets
from hubsoup.workflows.pipeline import hubio, select
from hubsoup.workflows.pipeline.context import Run
from hubsoup.workflows.pipeline.report import PUBLISHED, Candidate, PipelineReport, finite


def leaderboard(run: Run, report: PipelineReport) -> None:
    """Write the leaderboard (and push it to `leaderboard.repo`, a failure reported as a candidate's)."""
    p = run.p
    rows = {m.recipe_hash: {**m.row(report.base), "eval": run.eval_signature}
            for m in report.merges if m.recipe_hash}
    for h, r in run.previous.items():  # earlier runs' rows stay (a candidate gone from a query, ...)
        rows.setdefault(h, {**r, "scores": {k: finite(v) for k, v in r["scores"].items()}})
    ordered = sorted(rows.values(), key=lambda r: (r.get("status") != PUBLISHED, r.get("score") is None,
                                                   -(r.get("score") or 0.0) * (1 if _goal_or_max(run) == "max" else -1),
                                                   r.get("repo_id") or "", r["recipe_hash"]))
    data: dict[str, Any]
    data = {"pipeline": p.name, "base": report.base.pinned, "namespace": p.push.namespace,
            "select": None if p.select is None else {"metric": p.select.metric, "goal": select.goal(p.select),
                                                     "top_k": p.select.top_k, "threshold": p.select.threshold},
            "candidates": [{"repo_id": c.repo_id, "sha": c.info.sha if c.info else None,
                            "license": c.info.license if c.info else None,
                            "status": "failed" if c.error else ("left out" if c.skipped else "ok"),
                            "reason": c.error or c.skipped} for c in report.candidates
                           if p.push.private or not _hidden(c)],
            "merges": ordered}
    hidden = [c for c in report.candidates if _hidden(c)]
    if hidden and not p.push.private:  # a private repo's name is not for a public leaderboard
        data["private_candidates"] = len(hidden)
    text_json = json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"
    text_md = render_leaderboard(data)
    folder = os.path.join(run.work, p.leaderboard.folder)
    os.makedirs(folder, exist_ok=True)
    for name, text in ((hubio.LEADERBOARD_JSON, text_json), (hubio.LEADERBOARD_MD, text_md)):
        tmp = os.path.join(folder, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, os.path.join(folder, name))
    report.leaderboard_path = folder
    if p.leaderboard.repo:
        files = {hubio.LEADERBOARD_JSON: text_json.encode(), "README.md": text_md.encode()}
        try:
            report.leaderboard_url = hubio.push_files(run.api, p.leaderboard.repo, files,
                                                      "Update the hubsoup pipeline leaderboard", run.retry,
                                                      repo_type=p.leaderboard.repo_type,
                                                      private=p.push.private or None, token=run.token)
        except Exception as e:  # noqa: BLE001 - the merges are published; the leaderboard push is reported
            report.candidates.append(Candidate(p.leaderboard.repo, error=(
                f"leaderboard push failed: {scrub_secrets(str(e).splitlines()[0] if str(e) else type(e).__name__)}")))


def _goal_or_max(run: Run) -> str:
    return select.goal(run.p.select) if run.p.select is not None else "max"


def _hidden(c: Candidate) -> bool:
    """A private candidate left out: its name (not public on the Hub) stays off a public leaderboard."""
    return bool(c.info and c.info.private and (c.error or c.skipped))


def _cell(v: Any) -> str:
    """A score in the markdown table: 4 decimals; a score that was not a finite number is ``n/a``."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.4f}" if finite(float(v)) is not None else "n/a"
    return "n/a" if v is None else ""


def render_leaderboard(data: dict[str, Any]) -> str:
    """The leaderboard as markdown (the JSON's content, one row per merge)."""
    lines = [f"# {data['pipeline']}: leaderboard", "",
             f"Merges of fine-tunes of `{data['base']}` made with hubsoup, published under `{data['namespace']}`.", ""]
    sel = data.get("select")
    if sel:
        what = ", ".join(x for x in (f"top {sel['top_k']}" if sel.get("top_k") else "",
                                    f"threshold {sel['threshold']}" if sel.get("threshold") is not None else "") if x)
        lines += [f"Selection: `{sel['metric']}` ({sel['goal']}){'; ' + what if what else ''}.", ""]
    metrics = sorted({k for r in data["merges"] for k in (r.get("scores") or {})})
    head = ["model", "status", "method", "inputs", *metrics, "license", "recipe"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in data["merges"]:
        model = f"[{r['repo_id']}]({r['url']})" if r.get("url") else f"`{r.get('repo_id') or '-'}`"
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        inputs = "<br>".join(f"`{i.split('@')[0]}@{i.split('@')[1][:8]}`" if "@" in i else f"`{i}`"
                             for i in r.get("inputs", []))
        params = ", ".join(f"{k}={v}" for k, v in (r.get("params") or {}).items() if v is not None)
        method = f"{r['method']}" + (f" ({params})" if params else "")
        scores = [_cell((r.get("scores") or {}).get(k, "")) for k in metrics]
        cells = [model, status, method, inputs, *scores, r.get("license") or "", f"`{r['recipe_hash'][:12]}`"]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    failed = [c for c in data.get("candidates", []) if c.get("status") in ("failed", "left out")]
    if failed or data.get("private_candidates"):
        lines += ["", "## Candidates left out", ""]
        lines += [f"- `{c['repo_id']}`: {c['reason']}" for c in failed]
        if data.get("private_candidates"):
            lines.append(f"- {data['private_candidates']} private repo(s), not named here")
    return "\n".join(lines) + "\n"

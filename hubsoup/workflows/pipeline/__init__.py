"""Unattended community-merge pipelines: candidates from the Hub → merges → evals → selection → push → leaderboard.

``hubsoup pipeline PIPELINE.yml`` (or :func:`run_pipeline`) reads a pipeline file
(:mod:`~hubsoup.workflows.pipeline.config`), finds what is already published in the target
namespace through the Hub, and makes, evaluates and publishes only the rest; see
:mod:`~hubsoup.workflows.pipeline.run` for the semantics and ``examples/pipelines/`` for a
complete pipeline and a scheduled CI workflow.

Example:
    >>> from hubsoup.workflows.pipeline import run_pipeline
    >>> report = run_pipeline("pipeline.yml", dry_run=True)     # doctest: +SKIP
"""

from hubsoup.workflows.pipeline.config import Pipeline, load_pipeline
from hubsoup.workflows.pipeline.report import PipelineReport, PlannedMerge
from hubsoup.workflows.pipeline.run import run_pipeline

__all__ = ["run_pipeline", "load_pipeline", "Pipeline", "PipelineReport", "PlannedMerge"]

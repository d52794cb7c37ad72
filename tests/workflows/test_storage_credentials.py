"""A database URL's credentials (an evolve ``storage:``) are never printed, logged or put in an error."""

from __future__ import annotations

import logging
import warnings

import pytest
import yaml
from method_helpers import tiny_lm_zoo  # tests/ is on sys.path

from hubsoup.errors import EvolveError


SECRET = "hunter2-Zq81"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base, fts, data = tiny_lm_zoo(tmp_path_factory.mktemp("lows44"))
    return base, fts, str(data)


def evolve_config(tiny, **over) -> dict:
    base, fts, data = tiny
    cfg = {"base": base, "models": fts, "method": "ties", "space": {"density": [0.1, 0.9]}, "trials": 2,
           "population": 2, "optimizer": "tpe", "eval": {"tasks": [f"perplexity:{data}"]}}
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("url", [f"postgresql://alice:{SECRET}@127.0.0.1:1/studies",
                                 f"postgresql://alice:{SECRET}@@127.0.0.1:1/studies",  # an unescaped @ in it
                                 f"postgresql://127.0.0.1:1/studies?user=alice&password={SECRET}",
                                 f"sqlite:////nonexistent-dir/x.db?password={SECRET}",
                                 f"not a url {SECRET}"])
def test_a_storage_urls_password_is_never_shown(tiny, tmp_path, url, capsys):
    pytest.importorskip("optuna", reason="hubsoup[evolve] is not installed")
    from hubsoup.cli import main
    from hubsoup.workflows.evolve import evolve

    with pytest.raises(EvolveError, match="cannot open the study storage") as e:
        evolve(evolve_config(tiny, storage=url), str(tmp_path / "a"), quiet=True)
    assert SECRET not in str(e.value) and e.value.__cause__ is None  # nor chained to the driver's message
    cfg = tmp_path / "evolve.yml"
    cfg.write_text(yaml.safe_dump(evolve_config(tiny, storage=url)))
    assert main(["evolve", str(cfg), "--out", str(tmp_path / "b"), "-q", "-v"]) == 2  # the traceback too
    out = capsys.readouterr()
    assert "cannot open the study storage" in out.err
    assert SECRET not in out.err + out.out


def test_credentials_are_scrubbed_from_every_message_log_and_warning(capsys):
    from hubsoup.hubclient import install_log_scrubber, scrub_secrets

    cases = {f"postgresql://alice:{SECRET}@db:5432/x": "postgresql://***@db:5432/x",
             f"mysql+pymysql://u:{SECRET}@h/x?charset=utf8": "mysql+pymysql://***@h/x?charset=utf8",
             f"postgresql://db/x?sslmode=require&password={SECRET}&user=a": "postgresql://db/x?sslmode=require&password=***&user=a",
             f"host=db password={SECRET} user=a": "host=db password=*** user=a",
             "password authentication failed for user \"alice\"": "password authentication failed for user \"alice\"",
             "https://huggingface.co/alice/soup": "https://huggingface.co/alice/soup",
             "alice@example.com wrote": "alice@example.com wrote"}
    for text, want in cases.items():
        assert scrub_secrets(text) == want
    install_log_scrubber()
    log = logging.getLogger("hubsoup.test44")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log.addHandler(handler)
    try:
        log.error("cannot connect to %s", f"postgresql://alice:{SECRET}@db/x")
    finally:
        log.removeHandler(handler)
    assert records and SECRET not in records[0].getMessage()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn(f"engine postgresql://alice:{SECRET}@db/x is slow", UserWarning)
    assert SECRET not in capsys.readouterr().err

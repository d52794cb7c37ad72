"""A push interrupted or cut off says what is true, in one line: the folder intact and the push one commit;
a dropped connection one error, not a warning per retried request (``-v`` shows them).
"""

from __future__ import annotations

import logging




def test_an_interrupted_push_says_the_folder_is_intact_and_the_push_one_commit(tmp_path, monkeypatch, capsys):
    """``hubsoup push`` interrupted said "no output was left behind" (issue 44): the folder stays (a push
    removes nothing) and the push is one commit, there or not; so says the line, and exit 130."""
    import hubsoup.hub
    from hubsoup.cli import main

    folder = tmp_path / "soup"
    folder.mkdir()
    (folder / "config.json").write_text("{}")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(hubsoup.hub, "push_folder", interrupted)
    assert main(["push", str(folder), "alice/soup"]) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "no output was left behind" not in err[0], err
    assert f"'{folder}' is intact" in err[0] and "one commit" in err[0] and "alice/soup" in err[0], err
    assert (folder / "config.json").is_file()


def test_a_dropped_connection_is_one_line_not_a_warning_per_retry(hub, tmp_path, capfd, monkeypatch):
    """Every upload request dropped: huggingface_hub retries each (1, 2, 4, 8, 8 s) and logged two warnings per
    attempt (72 lines before the error in the probe); the command line shows the error alone, ``-v`` the retries."""
    import time

    import hubsoup
    from hubsoup.cli import main
    from hubsoup.testing import make_base, make_finetune

    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)  # huggingface_hub's backoff: recorded, not waited
    base = make_base("llama", str(tmp_path / "base"))
    out = hubsoup.merge([make_finetune(base, str(tmp_path / "ft"), seed=1)], "linear", base=base,
                        out=str(tmp_path / "soup"), quiet=True).path
    hub.login("alice")
    seen: list[str] = []  # what reaches huggingface_hub's own handler (it writes to the stderr of its import)
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("huggingface_hub.utils._http").addHandler(handler)
    capfd.readouterr()
    try:
        for verbose in (False, True):
            seen.clear()
            hub.fail_next(100_000, drop=True, path=r"/preupload/|/commit/")
            rc = main(["push", out, "alice/soup", *(["-v"] if verbose else [])])
            hub.clear_failures()
            err = capfd.readouterr().err
            assert rc == 2 and waits, err[-500:]
            retries = [m for m in seen if "Retrying in" in m or "thrown while requesting" in m]
            if verbose:
                assert retries, seen  # -v: each retry, as huggingface_hub says it
            else:
                assert seen == []
                lines = [line for line in err.splitlines() if line.strip()]
                assert len(lines) == 1 and lines[0].startswith("error: push of") and "network error" in lines[0], \
                    lines[:5]
    finally:
        logging.getLogger("huggingface_hub.utils._http").removeHandler(handler)

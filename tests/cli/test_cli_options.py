"""The merge options' flags are generated from :class:`MergeOptions`' fields (issue 33: one owner for option parsing)."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from hubsoup.cli.options import add_merge_options, merge_options
from hubsoup.options import MergeOptions

FLAGGED = [f for f in fields(MergeOptions) if "help" in f.metadata]


def _parser(inputs: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_merge_options(p, inputs=inputs)
    return p


def test_every_flagged_field_is_a_flag_with_its_help_and_default():
    actions = {a.dest: a for a in _parser()._actions if a.dest != "help"}
    assert set(actions) == {f.name for f in FLAGGED}
    for f in FLAGGED:
        a = actions[f.name]
        assert a.help == f.metadata["help"] and a.default == f.default, f.name
        assert "--" + f.name.replace("_", "-") in a.option_strings
    assert actions["quiet"].option_strings == ["--quiet", "-q"]
    assert list(actions["shape_mismatch"].choices) == ["error", "base-slice"]
    # the options only the Python API takes (a token never on a command line; callbacks; a server's cache)
    assert {f.name for f in fields(MergeOptions)} - set(actions) == {"token", "prefetch", "progress", "cancel",
                                                                     "cache_dir"}


def test_a_continual_state_fixes_the_input_rules():
    dests = {a.dest for a in _parser(inputs=False)._actions}
    assert "ignore_extra" not in dests and "shape_mismatch" not in dests and "overwrite" in dests


def test_flags_give_the_options_and_merge_options_parses_the_values():
    args = _parser().parse_args(["--shard-size", "2GiB", "--dtype", "bf16", "-q", "--shape-mismatch", "base-slice",
                                 "--max-download", "1GB", "--device-map", "auto"])
    opts = merge_options(args)
    assert (opts.shard_bytes, opts.dtype, opts.quiet, opts.max_download_bytes, opts.device_map) == \
        (2 * 2**30, "bf16", True, 10**9, "auto")
    assert opts.hashed == {"shape_mismatch": "base-slice", "ignore_extra": False}
    assert merge_options(_parser().parse_args([])) == MergeOptions()
    with pytest.raises(Exception, match="shard-size"):
        merge_options(_parser().parse_args(["--shard-size", "5XB"]))

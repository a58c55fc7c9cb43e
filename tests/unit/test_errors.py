"""Errors that cross process boundaries: pickling, how IPython renders them; the package's dir()."""
from __future__ import annotations

import pickle

import colab_kit as ck
from colab_kit.notebook.cluster import RankOutput
from colab_kit.errors import MessageOnly

TB = "Traceback (most recent call last):\n  File \"cell\", line 4, in <module>\nValueError: rank one is unhappy\n"


def test_rank_error_survives_pickling_with_every_field():
    err = ck.RankError({1: TB, 3: "KeyError: 'x'"}, [2, 0], "%%colossal", "run %colossal restart")
    err.outputs, err.shown = {1: RankOutput(1, stdout="before 1\n", error=TB, status="error")}, True
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ck.RankError and str(back) == str(err) and back.args == err.args
    assert (back.failures, back.stuck, back.where, back.advice) == ({1: TB, 3: "KeyError: 'x'"}, [0, 2], "%%colossal",
                                                                    "run %colossal restart")
    assert list(back.failures) == [1, 3] and back.rank == 1  # the first failure stays the cause
    assert back.outputs == err.outputs and back.shown is True


def test_rank_timeout_survives_pickling_with_every_field():
    err = ck.RankTimeout([3, 1], 0.5, "run", "wait for them")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ck.RankTimeout and str(back) == str(err) == (
        "ranks 1, 3 did not finish within 0.5 s in run (a collective that not every rank entered waits forever)\n"
        "wait for them")
    assert (back.failures, back.stuck, back.timeout) == ({}, [1, 3], 0.5)
    assert (back.where, back.advice) == ("run", "wait for them")
    assert back.rank == 1


def test_render_traceback_is_the_message_or_after_the_ranks_were_shown_the_summary():
    err = ck.RankError({1: TB}, [0], "%%colossal", "run %colossal restart")
    assert err._render_traceback_() == [
        "RankError: rank 1 failed in %%colossal: ValueError: rank one is unhappy",
        "  ranks 0 were still waiting (most likely in a collective for the failed rank)",
        "run %colossal restart",
        "--- traceback of rank 1 ---", *TB.rstrip().splitlines()]
    err.shown = True  # every rank's traceback is on screen already
    assert err._render_traceback_() == [
        "RankError: rank 1 failed in %%colossal: ValueError: rank one is unhappy",
        "  ranks 0 were still waiting (most likely in a collective for the failed rank)",
        "run %colossal restart"]
    timeout = ck.RankTimeout([0], 2, "run")
    assert timeout._render_traceback_() == [f"RankTimeout: {timeout}"]


def test_message_only_mixin_renders_name_and_message():
    class Refused(MessageOnly, RuntimeError):
        pass

    assert Refused("no cluster started\nrun %colossal start")._render_traceback_() == [
        "Refused: no cluster started", "run %colossal start"]


def test_dir_lists_the_lazily_loaded_names():
    names = dir(ck)
    assert {"Cluster", "boost", "Engine", "models", "datasets", "viz", "widgets", "comm", "magics", "cluster",
            "tensor", "pipeline", "reference"} <= set(names)
    assert set(ck.__all__) <= set(names) and names == sorted(names)

"""Tier 1: every ParallelConfig rule, one valid and one invalid case each, with the message checked.

No processes. The messages are part of the interface (a notebook user reads them), so the
tests assert the rule and the suggestion, not only that something was raised.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

import colab_kit as ck
from colab_kit.config import SCHEDULES, SP_MODES, TP_MODES, ConfigError, ParallelConfig

P = ParallelConfig


def refused(match: str, **kwargs) -> str:
    """Build ``P(**kwargs)``, expect a ConfigError whose message contains ``match`` literally."""
    with pytest.raises(ConfigError) as info:
        P(**kwargs)
    msg = str(info.value)
    assert match in msg, f"{match!r} not in {msg!r}"
    return msg


# --------------------------------------------------------------------------- basics
def test_config_error_is_a_value_error_and_exported():
    assert issubclass(ConfigError, ValueError)
    assert ck.ConfigError is ConfigError
    assert ck.ParallelConfig is ParallelConfig
    with pytest.raises(ValueError):  # callers that catch ValueError still catch it
        P(dp=0)


def test_defaults_are_the_single_rank_config():
    c = P()
    assert (c.dp, c.tp, c.pp, c.sp) == (1, 1, 1, 1)
    assert (c.tp_mode, c.tp_depth, c.sp_mode, c.zero, c.offload) == ("1d", 1, "ring", 0, "none")
    assert (c.microbatches, c.schedule, c.chunks, c.precision) == (1, "1f1b", 1, "fp32")
    assert c.world_size == 1
    assert c.describe() == "single rank = 1 rank"


def test_public_api_example_from_the_design():
    cfg = P(dp=2, tp=2, pp=1, sp=1, tp_mode="1d", tp_depth=1, sp_mode="ring", zero=0, offload="none",
            microbatches=1, schedule="1f1b", chunks=1, precision="fp32")
    assert cfg.world_size == 4


def test_frozen_dataclass():
    c = P(dp=2)
    assert dataclasses.is_dataclass(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dp = 4
    assert c == P(dp=2) and hash(c) == hash(P(dp=2))  # frozen -> hashable, usable as a key
    assert c != P(dp=4)


def test_replace_returns_a_validated_copy():
    c = P(dp=2, tp=4, tp_mode="2d")
    d = c.replace(dp=4)
    assert (d.dp, d.tp, d.tp_mode) == (4, 4, "2d") and c.dp == 2
    with pytest.raises(ConfigError, match=r"tp=6 with tp_mode='2d' needs tp to be a square \(q\*q\): try 4 or 9"):
        c.replace(tp=6)
    with pytest.raises(ConfigError, match="dp must be a positive whole number, got 0"):
        c.replace(dp=0)


def test_to_dict_round_trip():
    c = P(dp=2, tp=8, tp_mode="2.5d", tp_depth=2, zero=1, offload="cpu")
    d = c.to_dict()
    assert d["tp_depth"] == 2 and d["offload"] == "cpu"
    assert P(**d) == c
    assert P.from_dict(d) == c


@pytest.mark.parametrize("kwargs, world, shape", [
    (dict(), 1, dict(pp=1, dp=1, sp=1, tp=1)),
    (dict(dp=2, tp=2), 4, dict(pp=1, dp=2, sp=1, tp=2)),
    (dict(dp=2, pp=3, sp=5, tp=7), 210, dict(pp=3, dp=2, sp=5, tp=7)),
    (dict(dp=3, tp=9, tp_mode="2d"), 27, dict(pp=1, dp=3, sp=1, tp=9)),
])
def test_world_size_is_the_product_of_degrees(kwargs, world, shape):
    c = P(**kwargs)
    assert c.world_size == world
    assert c.shape == shape
    assert list(c.shape) == ["pp", "dp", "sp", "tp"]  # rank order, slowest first


@pytest.mark.parametrize("kwargs, q", [
    (dict(tp=6), 6), (dict(tp=9, tp_mode="2d"), 3), (dict(tp=8, tp_mode="2.5d", tp_depth=2), 2),
    (dict(tp=18, tp_mode="2.5d", tp_depth=2), 3), (dict(tp=27, tp_mode="3d"), 3), (dict(tp=64, tp_mode="3d"), 4),
])
def test_tp_q(kwargs, q):
    assert P(**kwargs).tp_q == q


def test_describe():
    assert P(dp=2, tp=4, tp_mode="2d").describe() == "dp=2 x tp=4 (2d) = 8 ranks"
    assert P(tp=8, tp_mode="2.5d", tp_depth=2).describe() == "tp=8 (2.5d, depth 2) = 8 ranks"
    assert P(dp=2, pp=2, sp=2).describe() == "dp=2 x pp=2 x sp=2 = 8 ranks"
    assert P(pp=2, schedule="gpipe").describe() == "pp=2 = 2 ranks, gpipe x 1 microbatch"
    # every field off its default is named, so two different configs never read alike
    assert P(dp=2, pp=2, schedule="zb-v", chunks=2, microbatches=8, zero=2, precision="bf16",
             recompute=True).describe() == ("dp=2 x pp=2 = 4 ranks, zb-v x 8 microbatches, 2 chunks, zero=2, bf16, "
                                            "recompute")
    assert P(tp=2, sp_mode="split_gather").describe() == "tp=2 (1d) = 2 ranks, split_gather"
    assert P(sp=2, sp_mode="ulysses", microbatches=2, zero=3, offload="cpu").describe() == (
        "sp=2 = 2 ranks, ulysses, 2 microbatches, zero=3, offload=cpu")
    assert P(dp=2, zero=1).describe() != P(dp=2, zero=2).describe()


# --------------------------------------------------------------------------- rule: positive degrees
@pytest.mark.parametrize("name", ["dp", "tp", "pp", "sp", "tp_depth", "microbatches", "chunks"])
def test_positive_whole_degrees(name):
    extra = dict(tp_mode="2.5d", tp=2) if name == "tp_depth" else {}
    extra = dict(schedule="interleaved", pp=2, microbatches=2) if name == "chunks" else extra
    ok = P(**{**extra, name: 2})
    assert getattr(ok, name) == 2
    for bad in (0, -1):
        refused(f"{name} must be a positive whole number, got {bad}: try {name}=1", **{name: bad})
    refused(f"{name} must be a positive whole number, got 2.0", **{name: 2.0})
    refused(f"{name} must be a positive whole number, got '2'", **{name: "2"})
    refused(f"{name} must be a positive whole number, got True", **{name: True})


# --------------------------------------------------------------------------- rule: known mode names
@pytest.mark.parametrize("field, good, bad, suggestion, choices", [
    ("tp_mode", "2.5d", "25d", "2.5d", "'1d', '2d', '2.5d' or '3d'"),
    ("tp_mode", "2d", "2D", "2d", "'1d', '2d', '2.5d' or '3d'"),
    ("sp_mode", "ulysses", "ulyses", "ulysses", "'ring', 'ulysses' or 'split_gather'"),
    ("schedule", "gpipe", "gpipee", "gpipe", "'gpipe', '1f1b', 'interleaved', 'zb-h1' or 'zb-v'"),
    ("schedule", "1f1b", "1F1B", "1f1b", "'gpipe', '1f1b', 'interleaved', 'zb-h1' or 'zb-v'"),
    ("offload", "cpu", "cpuu", "cpu", "'none', 'cpu' or 'auto'"),
    ("precision", "bf16", "bf15", "bf16", "'fp32', 'fp16' or 'bf16'"),
])
def test_unknown_mode_names_suggest_the_nearest(field, good, bad, suggestion, choices):
    extra = {"tp_mode": dict(tp=4, tp_depth=1 if good != "2.5d" else 4),
             "sp_mode": dict(sp=2), "offload": dict(zero=1)}.get(field, {})
    assert getattr(P(**{**extra, field: good}), field) == good
    msg = refused(f"unknown {field} {bad!r}: did you mean {suggestion!r}? choose one of {choices}",
                  **{field: bad})
    assert msg.endswith(choices)


def test_unknown_mode_without_a_near_name_lists_the_choices():
    msg = refused("unknown tp_mode 'xyz': choose one of '1d', '2d', '2.5d' or '3d'", tp_mode="xyz")
    assert "did you mean" not in msg


def test_every_listed_mode_is_accepted():
    for m in TP_MODES:
        P(tp_mode=m)  # tp=1 is valid for every tensor mode (1 = 1*1 = 1**3)
    for m in SP_MODES:
        P(sp_mode=m, tp=2 if m == "split_gather" else 1)
    for s in SCHEDULES:
        P(schedule=s, pp=2, chunks=2 if s in ("interleaved", "zb-v") else 1, microbatches=2)


# --------------------------------------------------------------------------- rule: ZeRO stage
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_accepted(stage):
    assert P(zero=stage, dp=2).zero == stage


@pytest.mark.parametrize("bad", [4, -1, True, "1", 1.0])
def test_zero_out_of_range(bad):
    refused(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {bad!r}", zero=bad)


# --------------------------------------------------------------------------- rule: 2d needs a square
@pytest.mark.parametrize("tp", [1, 4, 9, 16])
def test_2d_square_ok(tp):
    assert P(tp=tp, tp_mode="2d").tp_q ** 2 == tp


@pytest.mark.parametrize("tp, hint", [(6, "try 4 or 9"), (2, "try 1 or 4"), (8, "try 4 or 9"), (12, "try 9 or 16")])
def test_2d_not_square(tp, hint):
    msg = refused(f"tp={tp} with tp_mode='2d' needs tp to be a square (q*q): {hint}", tp=tp, tp_mode="2d")
    assert msg.endswith(hint)


def test_2d_message_of_the_design_verbatim():
    with pytest.raises(ConfigError) as info:
        P(tp=6, tp_mode="2d")
    assert str(info.value) == "tp=6 with tp_mode='2d' needs tp to be a square (q*q): try 4 or 9"


# --------------------------------------------------------------------------- rule: 2.5d needs depth*q*q
@pytest.mark.parametrize("tp, d", [(8, 2), (18, 2), (4, 1), (12, 3), (2, 2)])
def test_2_5d_ok(tp, d):
    c = P(tp=tp, tp_mode="2.5d", tp_depth=d)
    assert d * c.tp_q ** 2 == tp


@pytest.mark.parametrize("tp, d, hint", [
    (6, 2, "try tp=2 or 8 (q = 1 or 2)"),       # 6/2 = 3 is not a square
    (8, 3, "try tp=3 or 12 (q = 1 or 2)"),      # 8 is not a multiple of 3
    (16, 2, "try tp=8 or 18 (q = 2 or 3)"),
])
def test_2_5d_not_depth_q_q(tp, d, hint):
    refused(f"tp={tp} with tp_mode='2.5d' and tp_depth={d} needs tp = depth*q*q: {hint}",
            tp=tp, tp_mode="2.5d", tp_depth=d)


# --------------------------------------------------------------------------- rule: 3d needs a cube
@pytest.mark.parametrize("tp", [1, 8, 27, 64])
def test_3d_cube_ok(tp):
    assert P(tp=tp, tp_mode="3d").tp_q ** 3 == tp


@pytest.mark.parametrize("tp, hint", [(4, "try 1 or 8"), (9, "try 8 or 27"), (2, "try 1 or 8"), (30, "try 27 or 64")])
def test_3d_not_cube(tp, hint):
    refused(f"tp={tp} with tp_mode='3d' needs tp to be a cube (q*q*q): {hint}", tp=tp, tp_mode="3d")


# --------------------------------------------------------------------------- rule: tp_depth only with 2.5d
def test_tp_depth_with_2_5d_ok():
    assert P(tp=8, tp_mode="2.5d", tp_depth=2).tp_depth == 2


@pytest.mark.parametrize("mode, tp", [("1d", 4), ("2d", 4), ("3d", 8)])
def test_tp_depth_without_2_5d(mode, tp):
    refused("tp_depth=2 applies only to tp_mode='2.5d' (tp = depth*q*q): set tp_depth=1 or tp_mode='2.5d'",
            tp=tp, tp_mode=mode, tp_depth=2)


# --------------------------------------------------------------------------- rule: split_gather
def test_split_gather_ok():
    c = P(tp=2, sp_mode="split_gather")
    assert c.world_size == 2 and c.sp == 1


def test_split_gather_needs_tp():
    refused("sp_mode='split_gather' splits the sequence inside the tensor-parallel group, so it needs tp > 1: "
            "try tp=2, or sp_mode='ring' with sp > 1", sp_mode="split_gather")


def test_split_gather_needs_sp_1():
    refused("sp_mode='split_gather' runs on the tp group and has no sp axis, so it needs sp=1 (got sp=2): "
            "try sp=1 tp=4, or sp_mode='ring'", sp_mode="split_gather", tp=2, sp=2)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_ring_and_ulysses_have_their_own_sp_axis(mode):
    assert P(sp=4, sp_mode=mode).world_size == 4
    assert P(sp=2, tp=2, sp_mode=mode).world_size == 4


# --------------------------------------------------------------------------- rule: interleaved schedule
def test_interleaved_ok():
    c = P(pp=2, schedule="interleaved", chunks=2, microbatches=4)
    assert (c.chunks, c.microbatches) == (2, 4)


def test_interleaved_needs_chunks():
    refused("schedule='interleaved' gives each pipeline rank several model chunks, so it needs chunks > 1 "
            "(got chunks=1): try chunks=2", pp=2, schedule="interleaved", microbatches=4)


@pytest.mark.parametrize("pp, m, hint", [(2, 3, "try microbatches=2 or 4"), (4, 6, "try microbatches=4 or 8"),
                                         (3, 2, "try microbatches=3")])
def test_interleaved_needs_microbatches_divisible_by_pp(pp, m, hint):
    refused(f"schedule='interleaved' needs microbatches divisible by pp={pp} (got microbatches={m}): {hint}",
            pp=pp, schedule="interleaved", chunks=2, microbatches=m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_chunks_need_interleaved(schedule):
    assert P(pp=2, schedule=schedule, microbatches=4).chunks == 1
    refused(f"chunks=2 (virtual stages) needs schedule='interleaved' (or 'zb-v', which takes exactly 2); "
            f"schedule={schedule!r} runs one chunk per rank: set chunks=1 or schedule='interleaved'",
            pp=2, schedule=schedule, chunks=2, microbatches=4)


# --------------------------------------------------------------------------- rule: zb-v schedule
@pytest.mark.parametrize("m", [1, 3, 5, 8])
def test_zb_v_takes_any_microbatch_count(m):
    assert P(pp=4, schedule="zb-v", chunks=2, microbatches=m).chunks == 2


@pytest.mark.parametrize("chunks, hint", [(1, "set chunks=2"),
                                          (3, "set chunks=2, or schedule='interleaved' for 3 chunks")])
def test_zb_v_needs_two_chunks(chunks, hint):
    refused(f"schedule='zb-v' places exactly two model chunks per pipeline rank, in a V (stages 0..pp-1 down the "
            f"ranks, pp..2pp-1 back up), so it needs chunks=2 (got chunks={chunks}): {hint}",
            pp=2, schedule="zb-v", chunks=chunks, microbatches=4)


# --------------------------------------------------------------------------- rule: offload needs ZeRO
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_offload_with_zero_ok(zero):
    assert P(dp=2, zero=zero, offload="cpu").offload == "cpu"


def test_offload_needs_zero():
    refused("offload='cpu' moves ZeRO's sharded optimizer states to the host, so it needs zero >= 1: try zero=1",
            dp=2, offload="cpu")


# --------------------------------------------------------------------------- check_world_size
def test_check_world_size_match():
    assert P(dp=2, pp=2, tp=2).check_world_size(8) is None


@pytest.mark.parametrize("kwargs, n, tail", [
    (dict(dp=2, tp=2), 8, ": try dp=4"),
    (dict(dp=2, tp=2), 2, ": try dp=1"),
    (dict(dp=1, pp=2, tp=2), 12, ": try dp=3"),
    (dict(dp=2, tp=2), 3, ": choose degrees whose product is 3"),
    (dict(dp=2, tp=2), 1, ": choose degrees whose product is 1"),
    (dict(dp=2, tp=2), 0, ": choose degrees whose product is 0"),  # never suggests dp=0
])
def test_check_world_size_mismatch(kwargs, n, tail):
    c = P(**kwargs)
    with pytest.raises(ConfigError) as info:
        c.check_world_size(n)
    msg = str(info.value)
    needs = f"this config needs dp*pp*sp*tp = {c.dp}*{c.pp}*{c.sp}*{c.tp} = {c.world_size} ranks, but there are {n}"
    assert msg == needs + tail
    if "try dp=" in tail:  # the suggestion is itself a config that fits
        dp = int(re.search(r"dp=(\d+)", tail).group(1))
        c.replace(dp=dp).check_world_size(n)


# --------------------------------------------------------------------------- parsing
def test_parse_key_value_words():
    assert P.parse("dp=2 tp=4 tp_mode=2d") == P(dp=2, tp=4, tp_mode="2d")


def test_parse_flags_with_separate_values():
    assert P.parse("--dp 2 --tp 4 --tp_mode 2d") == P(dp=2, tp=4, tp_mode="2d")


def test_parse_flags_with_equals():
    assert P.parse("--dp=2 --tp=4 --zero=1 --offload=cpu") == P(dp=2, tp=4, zero=1, offload="cpu")


def test_parse_dashed_flag_names():
    assert P.parse("--tp-mode 2.5d --tp-depth 2 --tp 8") == P(tp=8, tp_mode="2.5d", tp_depth=2)
    assert P.parse("--sp-mode=ulysses --sp 2") == P(sp=2, sp_mode="ulysses")


def test_parse_mixed_forms_and_list_input():
    want = P(dp=2, tp=2, pp=2, microbatches=4, schedule="gpipe")
    assert P.parse("dp=2 --tp 2 --pp=2 microbatches=4 --schedule gpipe") == want
    assert P.parse(["dp=2", "--tp", "2", "--pp=2", "microbatches=4", "--schedule", "gpipe"]) == want


def test_parse_lowercases_mode_names():
    assert P.parse("tp=4 tp_mode=2D precision=BF16").tp_mode == "2d"
    assert P.parse("tp=4 tp_mode=2D precision=BF16").precision == "bf16"


def test_parse_empty_is_default():
    assert P.parse("") == P()
    assert P.parse([]) == P()


def test_parse_validates():
    with pytest.raises(ConfigError, match=r"needs tp to be a square \(q\*q\): try 4 or 9"):
        P.parse("--tp 6 --tp-mode 2d")


@pytest.mark.parametrize("words, message", [
    ("dpp=2", "unknown config key 'dpp': did you mean 'pp'?"),
    ("--tp-mdoe 2d", "unknown config key 'tp_mdoe': did you mean 'tp_mode'?"),
    ("microbatch=4", "unknown config key 'microbatch': did you mean 'microbatches'?"),
    ("--precison fp16", "unknown config key 'precison': did you mean 'precision'?"),
])
def test_parse_unknown_key_suggests(words, message):
    with pytest.raises(ConfigError) as info:
        P.parse(words)
    assert str(info.value) == message


def test_parse_unknown_key_without_a_near_name_lists_the_keys():
    with pytest.raises(ConfigError) as info:
        P.parse("xyzzy=1")
    msg = str(info.value)
    assert msg.startswith("unknown config key 'xyzzy': known keys: dp, tp, pp, sp, tp_mode, tp_depth")
    for f in dataclasses.fields(P):
        assert f.name in msg


@pytest.mark.parametrize("words, message", [
    ("dp=two", "dp must be a whole number, got 'two'"),
    ("--tp 2.5", "tp must be a whole number, got '2.5'"),
    ("--zero=one", "zero must be a whole number, got 'one'"),
    ("dp=", "dp must be a whole number, got ''"),
])
def test_parse_non_integer_values(words, message):
    with pytest.raises(ConfigError) as info:
        P.parse(words)
    assert str(info.value) == message


@pytest.mark.parametrize("words, message", [
    ("--tp", "flag --tp needs a value, e.g. --tp 2"),
    ("--dp --tp 2", "flag --dp needs a value, e.g. --dp 2"),
    ("dp", "cannot read 'dp': write key=value (dp=2) or a flag (--dp 2)"),
])
def test_parse_malformed_words(words, message):
    with pytest.raises(ConfigError) as info:
        P.parse(words)
    assert str(info.value) == message


@pytest.mark.parametrize("words, message", [
    ("dp=2 dp=4", "config key 'dp' given twice, as dp=2 and as dp=4: give it once"),
    ("dp=2 --dp 4", "config key 'dp' given twice, as dp=2 and as --dp 4: give it once"),
    ("--tp-mode 2d tp=4 tp_mode=2d",
     "config key 'tp_mode' given twice, as --tp-mode 2d and as tp_mode=2d: give it once"),
])
def test_parse_refuses_a_key_given_twice(words, message):
    with pytest.raises(ConfigError) as info:  # even with the same value: which one was meant is unclear
        P.parse(words)
    assert str(info.value) == message


def test_parse_base_config_carries_over():
    base = P(dp=2, tp=4, tp_mode="2d", zero=1)
    c = P.parse("--pp 2", base=base)
    assert c == P(dp=2, tp=4, tp_mode="2d", zero=1, pp=2)
    assert base.pp == 1  # base untouched
    assert P.parse("tp=9", base=base) == P(dp=2, tp=9, tp_mode="2d", zero=1)
    with pytest.raises(ConfigError, match="needs tp to be a square"):  # the merged result is validated
        P.parse("tp=6", base=base)


def test_from_dict_converts_strings_and_refuses_fractions():
    assert P.from_dict({"dp": "2", "tp_mode": "2D", "tp": 4}) == P(dp=2, tp=4, tp_mode="2d")
    with pytest.raises(ConfigError, match="dp must be a positive whole number, got 2.5"):
        P.from_dict({"dp": 2.5})  # not silently truncated to dp=2
    with pytest.raises(ConfigError, match="unknown config key 'dpp': did you mean 'pp'"):
        P.from_dict({"dpp": 2})


def test_from_dict_accepts_numpy_integers():
    np = pytest.importorskip("numpy")
    c = P.from_dict({"dp": np.int64(2), "zero": np.int32(1)})
    assert c == P(dp=2, zero=1) and type(c.dp) is int


def test_an_unknown_keyword_names_the_field_it_was_likely_meant_to_be():
    """As ``from_dict`` and ``parse`` do (a bare TypeError before), and a config still pickles and copies."""
    import copy
    import pickle

    with pytest.raises(ConfigError, match=r"unknown config key 'microbatch': did you mean 'microbatches'\?"):
        ParallelConfig(dp=2, microbatch=4)
    with pytest.raises(ConfigError, match=r"unknown config key 'tensor': known keys: dp, tp"):
        ParallelConfig(tensor=2)
    c = ParallelConfig(dp=2, tp=2, microbatches=4)
    assert pickle.loads(pickle.dumps(c)) == c == copy.deepcopy(c)

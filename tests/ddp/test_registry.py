"""The one registry of stages (wrap.STAGES): every program offers every stage, options a stage has no
use for are refused by name, and the sharded stages' shared pieces cut as they say."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import sharded as sharded_benchmark
from ddp_from_scratch import compare, trace, train
from ddp_from_scratch.parts.bucket import runs_of_at_most
from ddp_from_scratch.steps.fsdp import FullyShardedDataParallel
from ddp_from_scratch.workload.models import SmallNet
from ddp_from_scratch.parts.sharding import DDP_ONLY_OPTIONS
from ddp_from_scratch.wrap import SHARDED, STAGES, wrap
from ddp_from_scratch.steps.zero2 import ZeroTwoDataParallel


def _choices(parser, dest):
    return next(a.choices for a in parser._actions if a.dest == dest)


def test_every_program_offers_every_sharded_stage():
    """A stage registered in wrap.STAGES reaches every program without being named there again."""
    assert SHARDED == ["zero1", "zero2", "zero2-bucketed", "fsdp"]
    assert set(SHARDED) <= set(_choices(train.build_parser(), "impl"))
    assert set(SHARDED) <= set(_choices(compare.build_parser(), "impl"))
    assert set(SHARDED) <= {name for name, _ in sharded_benchmark.ROWS.values()}


def test_trace_help_lists_every_sharded_stage(capsys):
    """The timeline program builds its choices inside main: read its --help."""
    with pytest.raises(SystemExit):
        trace.main(["--help"])
    out = capsys.readouterr().out.replace("\n", " ")
    assert all(name in out for name in SHARDED)


@pytest.mark.parametrize("cls", [ZeroTwoDataParallel, FullyShardedDataParallel])
@pytest.mark.parametrize("option", DDP_ONLY_OPTIONS)
def test_reduce_scattering_stages_refuse_ddp_only_options_by_name(cls, option):
    """Refused before any collective (no process group is needed to see it): ZeRO-2 used to drop them."""
    with pytest.raises(ValueError, match=rf"{cls.__name__} takes no {option}: it is an option of the bucketed all_reduce"):
        cls(SmallNet(), **{option: True})


def test_an_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=r"unexpected options \['bucket_size'\]"):
        ZeroTwoDataParallel(SmallNet(), bucket_size=3)


@pytest.mark.parametrize("impl, option, takers", [
    ("zero2", "compress", "only bucketed, zero1 do"),
    ("fsdp", "bucket_cap_mb", "only bucketed, zero1, zero2, zero2-bucketed do"),
    ("naive", "bucket_cap_mb", "only bucketed, zero1, zero2, zero2-bucketed do"),
    ("flat", "timeline", None),
])
def test_wrap_refuses_an_option_the_stage_does_not_take(impl, option, takers):
    with pytest.raises(ValueError) as info:
        wrap(SmallNet(), impl, **{option: 1})
    assert str(info.value).startswith(f"{impl} takes no {option}")
    if takers:
        assert str(info.value).endswith(takers)


def test_wrap_names_the_stages_when_the_name_is_unknown():
    with pytest.raises(ValueError, match="no stage named 'zero3'; the stages are torch, naive, flat, bucketed, zero1"):
        wrap(SmallNet(), "zero3")


def test_stages_say_which_torch_wrapper_they_match_at_every_world_size():
    twins = {name: STAGES[name].bitwise_twin for name in SHARDED}
    assert twins == {"zero1": "torch", "zero2": "torch-fsdp", "zero2-bucketed": None, "fsdp": "torch-fsdp"}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 120), st.booleans())
def test_runs_of_at_most_keep_order_and_close_before_the_cap(nbytes, cap, backwards):
    order = list(reversed(range(len(nbytes)))) if backwards else None
    runs = runs_of_at_most(nbytes, cap, order)
    walked = [i for run in runs for i in run]
    assert walked == (order if backwards else list(range(len(nbytes))))  # every index once, in order
    for k, run in enumerate(runs):
        size = sum(nbytes[i] for i in run)
        assert run and (size <= cap or len(run) == 1), (run, size)  # over the cap only alone
        if k + 1 < len(runs):  # closed because the next item would have passed the cap
            assert size + nbytes[runs[k + 1][0]] > cap


def test_the_options_passed_to_wrap_win_over_the_stages_defaults(monkeypatch):
    """zero2-bucketed's default bucket (a quarter of the model) is for when none is given: a
    bucket_cap_mb passed to wrap is the one built with (defaults winning passed every other test)."""
    import dataclasses

    from ddp_from_scratch.wrap import quarter_of_the_model_mb

    built = []
    monkeypatch.setitem(STAGES, "zero2-bucketed", dataclasses.replace(
        STAGES["zero2-bucketed"], build=lambda module, **options: built.append(options)))
    model = SmallNet()
    wrap(model, "zero2-bucketed", bucket_cap_mb=0.125, timeline=False)
    wrap(model, "zero2-bucketed")
    wrap(model, "zero2-bucketed", bucket_cap_mb=None)  # None: the stage's default
    assert quarter_of_the_model_mb(model) != 0.125
    assert built == [{"bucket_cap_mb": 0.125, "timeline": False}, {"bucket_cap_mb": quarter_of_the_model_mb(model)},
                     {"bucket_cap_mb": quarter_of_the_model_mb(model)}]

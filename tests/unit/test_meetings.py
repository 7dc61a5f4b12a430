"""sdpipe on slow links: meetings every H steps, and the choice of H and precision from the
links (sdpipe_cli.core.meetings), as the launcher and the simulator resolve them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from sdpipe_cli.core.meetings import Meetings, average_of, choose, meetings_of, precision_of


@settings(max_examples=200, deadline=None)
@given(every=st.integers(1, 64), meeting=st.integers(0, 10_000))
def test_a_meeting_is_the_last_step_of_its_block_and_nothing_else_meets(every, meeting):
    m = Meetings(every)
    last = m.last_step(meeting)
    assert m.meets(last) and m.meeting(last) == meeting
    block = range(m.steps(meeting), last + 1)  # the block's local steps
    assert len(block) == every and all(m.meeting(k) == meeting for k in block)
    assert [k for k in block if m.meets(k)] == [last]


@settings(max_examples=200, deadline=None)
@given(every=st.integers(1, 64), steps=st.integers(0, 10**6))
def test_a_budget_in_meetings_covers_it_with_less_than_one_meeting_to_spare(every, steps):
    m = Meetings(every)
    assert steps <= m.steps(m.meetings(steps)) < steps + every


def test_periods_in_meetings_keep_never_and_are_at_least_one():
    m = Meetings(8)
    assert (m.period(0), m.period(3), m.period(50), m.period(12)) == (0, 1, 6, 2)
    assert Meetings(1).period(50) == 50
    with pytest.raises(ValueError):
        Meetings(0)


# a meeting's seconds per precision on a slow link: float32 2.5 iterations of 0.1 s
SLOW = {"fp32": 0.25, "bf16": 0.125, "int8": 0.065}


def test_where_a_float32_meeting_fits_the_budget_nothing_changes():
    c = choose(iteration_s=0.1, round_s={"fp32": 0.005, "bf16": 0.003, "int8": 0.002}, share=0.1)
    assert (c.every, c.precision) == (1, "fp32")


def test_on_a_slow_link_int8_and_the_fewest_steps_over_which_a_meeting_fits():
    # a float32 meeting takes 2.5 iterations, an int8 one 0.65: at 10 %, every 7 steps (a
    # bfloat16 one, 1.25, would need 13)
    c = choose(iteration_s=0.1, round_s=SLOW, share=0.1)
    assert (c.every, c.precision) == (7, "int8")
    assert c.round_s / c.every > 0.1 * 0.1  # float32 would not have fitted at that period
    assert 0.065 / 7 <= 0.1 * 0.1 < 0.065 / 6
    assert "sync.every=7 sync.precision=int8" in c.describe()


@settings(max_examples=200, deadline=None)
@given(iteration=st.floats(1e-4, 10), fp32=st.floats(0, 100), share=st.floats(0.01, 1))
def test_the_choice_keeps_meetings_within_the_share_with_the_fewest_steps(iteration, fp32, share):
    costs = {"fp32": fp32, "bf16": fp32 / 2, "int8": fp32 / 4}
    c = choose(iteration, costs, share)
    assert costs[c.precision] / c.every <= share * iteration * (1 + 1e-6)
    if c.every > 1:  # one step fewer would not fit
        assert costs[c.precision] / (c.every - 1) > share * iteration * (1 - 1e-6)
    assert (c.precision == "fp32") == (fp32 <= share * iteration)


def test_a_chosen_period_is_at_most_a_pipelines_share_of_the_budget():
    # every 7 steps would fit the share; a run of 5 steps a pipeline meets after its 5th
    assert choose(0.1, SLOW, 0.1, most=5).every == 5
    assert choose(0.1, SLOW, 0.1, most=50).every == 7


def test_what_the_user_gave_is_kept():
    slow = SLOW
    assert (choose(0.1, slow, 0.1, every=4).every, choose(0.1, slow, 0.1, every=4).precision) \
        == (4, "int8")
    c = choose(0.1, slow, 0.1, precision="fp32")
    assert (c.every, c.precision) == (25, "fp32")
    c = choose(0.1, slow, 0.1, precision="bf16")
    assert (c.every, c.precision) == (13, "bf16")
    with pytest.raises(ValueError):
        choose(0.0, slow, 0.1)
    with pytest.raises(ValueError):
        choose(0.1, slow, 0.0)


def test_a_config_left_unresolved_means_every_iteration_in_float32():
    sync = OmegaConf.create({"name": "sdpipe", "every": 0, "precision": "auto",
                             "average": "weights_grads"})
    assert (meetings_of(sync).every, precision_of(sync), average_of(sync)) == (
        1, "fp32", "weights_grads")
    old = OmegaConf.create({"name": "sdpipe", "average": "weights_grads"})  # an older run
    assert (meetings_of(old).every, precision_of(old)) == (1, "fp32")
    other = OmegaConf.create({"name": "allreduce", "every": 8, "precision": "bf16"})
    assert (meetings_of(other).every, precision_of(other)) == (1, "fp32")


def test_meetings_and_bf16_changes_average_weights_after_the_step():
    for every, precision in ((4, "fp32"), (1, "bf16"), (8, "bf16"), (1, "int8")):
        sync = OmegaConf.create({"name": "sdpipe", "every": every, "precision": precision,
                                 "average": "weights_grads"})
        assert average_of(sync) == "weights"


def test_with_meetings_apart_a_global_sync_comes_at_most_once_in_1_over_share_meetings():
    assert Meetings(1).global_period(50, 0.1) == 50  # every iteration: as before
    assert Meetings(17).global_period(50, 0.1) == 10  # 3 meetings would make one in 3 global
    assert Meetings(4).global_period(200, 0.1) == 50  # a longer period is kept
    assert Meetings(8).global_period(0, 0.1) == 0  # only at the end
    assert Meetings(8).global_period(50, 0.25) == 6  # 50 steps are 6 meetings, more than 4


def test_with_meetings_apart_a_round_waits_at_most_the_wire_share_of_a_meeting():
    assert Meetings(1).patience(0.5, 0.1) == 0.5  # every iteration: sync.patience as it is
    assert Meetings(14).patience(0.5, 0.1) == 0.1  # 1.4 steps, not 7
    assert Meetings(14).patience(0.05, 0.1) == 0.05  # a smaller patience is kept


@pytest.mark.parametrize("values", [{"every": 4, "precision": "fp32"},
                                    {"every": 1, "precision": "int8"},
                                    {"every": 1, "precision": "fp32", "average": "weights"}])
def test_a_typed_sync_section_meets_as_its_config_and_its_plain_dict(values):
    """The scheduler builds its policy from its typed settings, the simulator from a config: the
    two forms of one section meet alike; a key a mode's dataclass lacks (allreduce has no
    ``every``) is its default, as a missing key is."""
    from sdpipe_cli.config.schema import AllReduceSyncConfig, SdpipeSyncConfig

    section = {"name": "sdpipe", "average": "weights_grads", **values}
    forms = (SdpipeSyncConfig(**section), OmegaConf.create(section))
    got = [(meetings_of(f).every, precision_of(f), average_of(f)) for f in forms]
    assert got[0] == got[1]
    assert got[0][0] == values["every"] and got[0][1] == values["precision"]
    lock_step = AllReduceSyncConfig()
    assert (meetings_of(lock_step).every, precision_of(lock_step)) == (1, "fp32")

"""The coordination protocol: every message survives the trip through JSON unchanged, and every
malformed value is refused with the store key and the field, before anything acts on it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from sdpipe_cli.runtime import protocol as P

ids = st.integers(min_value=0, max_value=10**6)
seconds = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(ids, ids, ids, ids, ids)
def test_coordination_events_round_trip(rank, pipeline, stage, iteration, incarnation):
    for message in (P.Ready(rank, pipeline, stage, iteration, incarnation),
                    P.Begin(rank, pipeline, stage, iteration, incarnation),
                    P.Rejoin(rank, pipeline, stage, incarnation),
                    P.Saved(rank, pipeline, stage, iteration, iteration + 1, incarnation, 1.5),
                    P.Lost(rank, pipeline, "killed", True, 2.0),
                    P.Restart(rank, pipeline, incarnation, 2, 0.5, 3.0), P.Tick()):
        assert P.decode_event(P.encode(message)) == message


@given(st.lists(ids, min_size=1, max_size=8), ids, st.sampled_from(["group", "global"]),
       st.booleans(), st.one_of(st.none(), ids), st.booleans())
def test_group_decisions_round_trip(members, round_, kind, stop, checkpoint, twins):
    group = P.Group(members, round_, kind, stop, [0] * len(members), checkpoint, 7, twins,
                    [P.HealTarget(3, 1, round_)])
    assert P.decode(P.encode(group), P.Group, "k") == group


def test_answers_and_reports_round_trip():
    for message, cls in ((P.BeginAnswer(True), P.BeginAnswer),
                         (P.HealAnswer(stop=True, iteration=None), P.HealAnswer),
                         (P.HealAnswer(False, 4, 1, 0, 12, 3), P.HealAnswer),
                         (P.Hung([(3, 0), (4, 1)]), P.Hung)):
        assert P.decode(P.encode(message), cls, "k") == message
    step = P.Report("step", 1, 0, 1, 2.5, 0, {"step": 3, "samples": 12, "samples_per_s": 4.0,
                                              "step_s": 0.25, "loss": None, "straggled": 1})
    assert P.decode_event(P.encode(step)) == step
    assert P.record(step)["loss"] is None and P.record(step)["straggled"] == 1


READY = {"type": "ready", "rank": 1, "pipeline": 0, "stage": 1, "iteration": 4}
STEP = {"type": "step", "rank": 1, "pipeline": 0, "stage": 1, "time": 1.0, "step": 3,
        "samples": 12, "samples_per_s": 4.0, "step_s": 0.2}

BAD_EVENTS = [
    ("{", "not JSON"),
    ("[1, 2]", "an event is a JSON object"),
    (json.dumps({"type": "explode"}), "unknown event type"),
    (json.dumps({"rank": 1}), "unknown event type"),
    (json.dumps({**READY, "rank": "1"}), "field 'rank' should be int"),
    (json.dumps({**READY, "iteration": True}), "field 'iteration' should be int"),
    (json.dumps({**READY, "iteration": 4.5}), "field 'iteration' should be int"),
    (json.dumps({k: v for k, v in READY.items() if k != "iteration"}), "lacks field 'iteration'"),
    (json.dumps({**READY, "members": [1]}), "has no field 'members'"),
    (json.dumps({**STEP, "loss": "low"}), "field 'loss' should be float | None"),
    (json.dumps({k: v for k, v in STEP.items() if k != "samples"}), "lacks field 'samples'"),
    (json.dumps({"type": "done", "rank": 0, "pipeline": 0, "stage": 0, "time": 1.0}),
     "a done report lacks field 'steps'"),
    (json.dumps({"type": "lost", "rank": 0, "pipeline": 0, "restart": "yes"}),
     "field 'restart' should be bool"),
    (json.dumps({"type": "consensus", "rank": 0, "pipeline": 0, "stage": 0, "time": 1,
                 "iteration": 1, "round": 1, "members": [0, "x"], "consensus": 0.1}),
     "field 'members[1]' should be int"),
]


@pytest.mark.parametrize("raw,message", BAD_EVENTS)
def test_malformed_events_are_refused_naming_the_key_and_the_field(raw, message):
    with pytest.raises(P.ProtocolError, match="store key 'sdpipe/events'") as err:
        P.decode_event(raw, "sdpipe/events")
    assert message in str(err.value)


GROUP = {"members": [0, 1], "round": 2, "kind": "group", "stop": False, "incarnations": [0, 0]}
BAD_ANSWERS = [
    (P.Group, {**GROUP, "members": []}, "non-empty"),
    (P.Group, {**GROUP, "incarnations": [0]}, "of one length"),
    (P.Group, {**GROUP, "kind": "party"}, "neither 'group' nor 'global'"),
    (P.Group, {**GROUP, "stop": 0}, "field 'stop' should be bool"),
    (P.Group, {**GROUP, "heal": [{"pipeline": 1}]}, "HealTarget lacks field 'incarnation'"),
    (P.HealAnswer, {"stop": False, "iteration": 3}, "a heal names its iteration, source"),
    (P.BeginAnswer, {}, "lacks field 'last'"),
    (P.Hung, [[1]], "field 'ranks[0]' should be tuple[int, int]"),
    (P.Hung, {"ranks": []}, "field 'ranks' should be list"),
]


@pytest.mark.parametrize("cls,value,message", BAD_ANSWERS)
def test_malformed_answers_are_refused(cls, value, message):
    with pytest.raises(P.ProtocolError, match="store key 'sdpipe/k'") as err:
        P.decode(json.dumps(value), cls, "sdpipe/k")
    assert message in str(err.value)


def test_the_progress_snapshot_is_checked_where_it_is_read():
    assert P.decode_progress(json.dumps({"loss": None, "iterations": 3, "extra": [1]}), "p")
    for bad in ('"fine"', json.dumps({"loss": "x"}), json.dumps({"pipelines": {"0": 1}})):
        with pytest.raises(P.ProtocolError, match="'p'"):
            P.decode_progress(bad, "p")

"""The supervision policy, driven directly: no process, no store, no clock (see core/supervision.py).

Each case the launcher meets (children ending well or badly, a lost pipeline under
``fault.on_pipeline_loss=continue``, another node's failure, interrupts during start-up and after
it) is one observation sequence here; tests/test_supervision.py checks the same cases end to end
with real processes. The hypothesis properties at the end drive random sequences.
"""

from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings, strategies as st

from sdpipe_cli.core.supervision import (
    SETTLE_S,
    Broken,
    ChildState,
    DropPipelines,
    Failed,
    FailedElsewhere,
    Finished,
    Kill,
    Observation,
    RequestStop,
    Respawn,
    RespawnScheduler,
    Resplit,
    Restarts,
    StopNow,
    Supervision,
    Wait,
    ending,
    first_failure,
)

KILLED = -signal.SIGKILL
TERMED = -signal.SIGTERM


def run(P: int = 2, S: int = 2, codes: dict | None = None, helpers: tuple = ("scheduler",),
        errors: dict | None = None) -> tuple[ChildState, ...]:
    """The children of a P x S run: helpers first (as the launcher starts them), then the workers,
    named by rank; ``codes`` and ``errors`` by name."""
    codes, errors = codes or {}, errors or {}
    names = [(h, None) for h in helpers] + [(str(r), r // S) for r in range(P * S)]
    return tuple(ChildState(n, p, codes.get(n), errors.get(n)) for n, p in names)


def see(children, now: float = 0.0, signals: int = 0, progress=None, elsewhere=None) -> Observation:
    return Observation(now, children, signals, progress, elsewhere)


def all_exit(P=2, S=2, code=0, helpers=("scheduler",)) -> dict:
    return {n: code for n in [*helpers, *map(str, range(P * S))]}


# == ending well ================================================================================


def test_running_children_mean_wait():
    assert Supervision(started=True).decide(see(run())) == Wait()


def test_every_child_exiting_0_is_finished():
    policy = Supervision(started=True)
    assert policy.decide(see(run(codes=all_exit()))) == Finished(interrupted=False)


def test_a_helper_exiting_0_early_is_no_event():
    """The scheduler may end first (it wrote the summary); the run ends when everyone has."""
    policy = Supervision(started=True)
    assert policy.decide(see(run(codes={"scheduler": 0}))) == Wait()
    assert policy.decide(see(run(codes={"scheduler": 0, "0": 0, "1": 0}))) == Wait()
    assert policy.decide(see(run(codes=all_exit()))) == Finished()


def test_workers_still_running_long_after_the_scheduler_ended_break_the_run():
    """Each worker's done report is its last act: workers still there STRANDED_S after the
    scheduler ended (it saw every report) wait for a scheduler that is gone."""
    policy = Supervision(started=True, stranded_s=10.0)
    assert policy.decide(see(run(codes={"scheduler": 0}), now=0.0)) == Wait()
    assert policy.decide(see(run(codes={"scheduler": 0, "0": 0}), now=9.0)) == Wait()
    action = policy.decide(see(run(codes={"scheduler": 0, "0": 0}), now=10.5))
    assert isinstance(action, Broken) and "worker(s) 1, 2, 3 still ran 10 s" in action.reason
    assert policy.decide(see(run(codes=all_exit()), now=11.0)) == action  # final


def test_a_malformed_store_value_breaks_the_run_even_when_everyone_exits_0():
    policy = Supervision(started=True)
    seen = Observation(0.0, run(codes=all_exit()), malformed="malformed message under store key "
                                                              "'sdpipe/hung': not JSON")
    assert policy.decide(seen) == Broken(seen.malformed)


def test_no_children_is_finished():
    assert Supervision(started=True).decide(see(())) == Finished()


# == failures ===================================================================================


def test_a_failure_waits_to_settle_then_names_the_child():
    """Peers of a crashed worker fail a moment later; the launcher waits SETTLE_S for them."""
    policy = Supervision(started=True)
    assert policy.decide(see(run(codes={"1": 1}, errors={"1": 10.0}), now=0.0)) == Wait()
    assert policy.decide(see(run(codes={"1": 1}, errors={"1": 10.0}), now=SETTLE_S / 2)) == Wait()
    later = run(codes={"1": 1, "0": 1}, errors={"1": 10.0, "0": 10.2})
    assert policy.decide(see(later, now=SETTLE_S)) == Failed("1")


def test_settle_zero_fails_at_once():
    policy = Supervision(started=True, settle_s=0)
    assert policy.decide(see(run(codes={"3": 2}))) == Failed("3")


def test_a_signal_is_the_root_cause_over_an_earlier_error_file():
    """An error file may be the echo of a peer's death; a signal comes from outside."""
    policy = Supervision(started=True, settle_s=0)
    children = run(codes={"0": 1, "2": KILLED}, errors={"0": 1.0})
    assert policy.decide(see(children)) == Failed("2")


def test_the_earliest_error_file_is_the_root_cause():
    policy = Supervision(started=True, settle_s=0)
    children = run(codes={"0": 1, "1": 1, "2": 1}, errors={"0": 5.0, "1": 3.0})
    assert policy.decide(see(children)) == Failed("1")


def test_without_error_files_the_first_in_launch_order():
    policy = Supervision(started=True, settle_s=0)
    assert policy.decide(see(run(codes={"2": 1, "3": 1}))) == Failed("2")


def test_a_helper_failure_fails_the_run():
    policy = Supervision(started=True, settle_s=0)
    assert policy.decide(see(run(codes={"scheduler": 1}))) == Failed("scheduler")


def test_a_parameter_server_failure_fails_the_run_even_when_tolerating():
    policy = Supervision(started=True, tolerate=True, settle_s=0)
    children = run(P=3, helpers=("scheduler", "ps0", "ps1"), codes={"ps1": KILLED})
    assert policy.decide(see(children)) == Failed("ps1")


def test_a_lost_pipeline_without_tolerance_fails_the_run():
    """on_pipeline_loss=stop (and every lock-step sync): one missing replica stops everyone."""
    policy = Supervision(started=True, tolerate=False, settle_s=0)
    assert policy.decide(see(run(P=3, codes={"4": KILLED}))) == Failed("4")


def test_first_failure_and_ending():
    a, b = ChildState("a", 0, 1, 2.0), ChildState("b", 0, 1, 1.0)
    assert first_failure([a, b]) is b
    assert first_failure([a, b, ChildState("c", 1, TERMED)]).name == "c"
    assert ending(KILLED) == "was killed by SIGKILL"
    assert ending(1) == "exited with code 1"
    assert ending(-200) == "was killed by signal 200"


# == pipeline loss (fault.on_pipeline_loss=continue) ============================================


def test_a_lost_pipeline_is_dropped_and_the_others_go_on():
    policy = Supervision(started=True, tolerate=True)
    assert policy.decide(see(run(P=3, codes={"4": KILLED}))) == DropPipelines(((2, "4"),))
    assert policy.lost == {2}
    # its mate, stopped by the launcher, is no failure; the others still run
    assert policy.decide(see(run(P=3, codes={"4": KILLED, "5": TERMED}), now=1)) == Wait()
    done = all_exit(P=3) | {"4": KILLED, "5": TERMED}
    assert policy.decide(see(run(P=3, codes=done), now=2)) == Finished()


def test_two_failures_in_one_pipeline_drop_it_once_naming_the_root_cause():
    policy = Supervision(started=True, tolerate=True)
    children = run(P=3, codes={"4": 1, "5": KILLED}, errors={"4": 1.0})
    assert policy.decide(see(children)) == DropPipelines(((2, "5"),))


def test_two_pipelines_lost_at_once_are_both_dropped():
    policy = Supervision(started=True, tolerate=True)
    children = run(P=4, codes={"1": 1, "6": KILLED})
    assert policy.decide(see(children)) == DropPipelines(((0, "1"), (3, "6")))


def test_losing_the_last_pipeline_fails_the_run():
    policy = Supervision(started=True, tolerate=True, settle_s=0)
    assert policy.decide(see(run(P=2, codes={"0": KILLED}))) == DropPipelines(((0, "0"),))
    after = run(P=2, codes={"0": KILLED, "1": TERMED, "3": 1})
    assert policy.decide(see(after)) == Failed("3")


def test_losing_every_pipeline_at_once_fails_the_run():
    policy = Supervision(started=True, tolerate=True, settle_s=0)
    assert policy.decide(see(run(P=2, codes={"0": KILLED, "2": 1}))) == Failed("0")


def test_a_helper_failing_with_a_worker_fails_the_run():
    policy = Supervision(started=True, tolerate=True, settle_s=0)
    children = run(P=3, codes={"4": 1, "scheduler": 1}, errors={"4": 1.0, "scheduler": 2.0})
    assert policy.decide(see(children)) == Failed("4")


# == restart (fault.on_pipeline_loss=restart) ==================================================


def test_restarts_back_off_doubling_until_the_budget_is_used():
    budget = Restarts(3, 0.5)
    assert [budget.take() for _ in range(4)] == [0.5, 1.0, 2.0, None]
    assert budget.left == 0 and Restarts(0, 1.0).take() is None


def test_the_back_off_doubles_per_pipeline_and_resets_after_a_good_while():
    budget = Restarts(6, 1.0, reset_s=60)
    assert budget.take(0, now=0) == 1.0
    assert budget.take(1, now=5) == 1.0  # another pipeline: its own back-off
    assert budget.take(0, now=10) == 2.0  # failed again 9 s after its restart
    assert budget.take(0, now=20) == 4.0
    assert budget.take(0, now=100) == 1.0  # ran 76 s since: from the start again
    assert budget.take(1, now=200) == 1.0 and budget.left == 0
    with pytest.raises(ValueError):
        Restarts(-1, 1.0)


def test_a_restart_that_trained_before_failing_again_backs_off_from_the_start():
    """Frequent unrelated faults (a worker lost every 20 s) are no crash loop: a run that trained
    past its restart point is retried after the first back-off, not after a doubled one."""
    budget = Restarts(10, 0.2, reset_s=60)
    assert budget.take("run", now=0) == 0.2
    assert budget.take("run", now=20, progressed=True) == 0.2
    assert budget.take("run", now=40, progressed=True) == 0.2
    assert budget.take("run", now=45) == 0.4  # failed again with nothing trained: doubles
    assert budget.take("run", now=50) == 0.8
    assert budget.take("run", now=70, progressed=True) == 0.2


def test_a_lost_pipeline_is_started_again_after_its_back_off():
    policy = Supervision(started=True, tolerate=True, restarts=Restarts(2, 1.0))
    assert policy.decide(see(run(P=3, codes={"4": KILLED}), now=10)) == DropPipelines(
        ((2, "4"),), (True,))
    stopped = run(P=3, codes={"4": KILLED, "5": TERMED})
    assert policy.decide(see(stopped, now=10.5)) == Wait()  # backing off
    assert policy.decide(see(stopped, now=11)) == Respawn(2, restart=1, backoff_s=1.0)
    assert policy.lost == frozenset()  # its new workers' failures count again
    assert policy.decide(see(run(P=3), now=12)) == Wait()
    # pipeline 2 again soon after its restart: twice the back-off; the next is past the budget
    assert policy.decide(see(run(P=3, codes={"4": 1}), now=20)).restart == (True,)
    assert policy.decide(see(run(P=3, codes={"4": 1}), now=21)) == Wait()
    assert policy.decide(see(run(P=3, codes={"4": 1}), now=22)) == Respawn(2, 2, 2.0)
    assert policy.decide(see(run(P=3, codes={"0": KILLED}), now=30)) == DropPipelines(
        ((0, "0"),), (False,))
    done = all_exit(P=3) | {"0": KILLED, "1": TERMED}
    assert policy.decide(see(run(P=3, codes=done), now=31)) == Finished()


def test_a_node_whose_only_pipeline_waits_to_restart_is_not_finished():
    """On a cluster of real nodes a launcher may hold one pipeline and no scheduler: while it
    backs off, every child it has has exited, yet its run is not over."""
    policy = Supervision(started=True, tolerate=True, restarts=Restarts(1, 1.0), pipelines=2)
    alone = run(P=1, helpers=())
    assert policy.decide(see(run(P=1, codes={"0": KILLED}, helpers=()), now=0)) == DropPipelines(
        ((0, "0"),), (True,))
    assert policy.decide(see(run(P=1, codes={"0": KILLED, "1": TERMED}, helpers=()), now=0.5)) == Wait()
    assert policy.decide(see(run(P=1, codes={"0": KILLED, "1": TERMED}, helpers=()), now=1)) == Respawn(
        0, 1, 1.0)
    assert policy.decide(see(alone, now=2)) == Wait()


def test_a_restart_is_still_made_after_a_stop_request():
    """Its new workers learn from the scheduler that the run ends; not starting them would
    leave the scheduler waiting for a pipeline that never comes back."""
    policy = Supervision(started=True, tolerate=True, restarts=Restarts(1, 1.0))
    policy.decide(see(run(P=3, codes={"4": KILLED}), now=0))
    assert policy.decide(see(run(P=3, codes={"4": KILLED}), now=0.1, signals=1)) == RequestStop()
    assert policy.decide(see(run(P=3, codes={"4": KILLED}), now=2, signals=1)) == Respawn(2, 1, 1.0)


def test_a_resplit_in_place_restarts_those_pipelines_at_once_whatever_the_loss_policy():
    """The scheduler asks (a new ``resplit`` version in its snapshot) to re-split pipelines 0
    and 2: they are stopped and started again at once, without the restart budget or
    tolerating losses otherwise; their stopped workers are no failure; one request is acted on
    once, and a malformed one breaks the run."""
    asked = {"started": 6, "resplit": {"version": 1, "partitions": {"2": [5], "0": [4]},
                                       "slowed": {"p0s1": 4.0}}}
    policy = Supervision(started=True, workers=6)  # fault.on_pipeline_loss=stop
    assert policy.decide(see(run(P=3), now=5, progress=asked)) == Resplit(
        1, ((0, (4,)), (2, (5,))), (("p0s1", 4.0),), (0, 2))
    stopped = run(P=3, codes={"0": TERMED, "1": TERMED, "4": TERMED, "5": KILLED})
    assert policy.decide(see(stopped, now=5.1, progress=asked)) == Respawn(0, 0, 0.0, True)
    respawned = run(P=3, codes={"4": TERMED, "5": KILLED})  # pipeline 0's new workers run
    assert policy.decide(see(respawned, now=5.1, progress=asked)) == Respawn(2, 0, 0.0, True)
    assert policy.decide(see(run(P=3), now=6, progress=asked)) == Wait()  # once per version
    assert policy.decide(see(run(P=3, codes={"4": 1}), now=7, progress=asked)) == Wait()  # settling
    assert isinstance(policy.decide(see(run(P=3, codes={"4": 1}), now=8, progress=asked)), Failed)
    with_budget = Supervision(started=True, workers=6, tolerate=True, restarts=Restarts(1, 1.0))
    with_budget.decide(see(run(P=3), now=0, progress=asked))
    assert with_budget.decide(see(run(P=3), now=0)).resplit and with_budget.restarts.left == 1
    # pipeline 2 lost just before: it is not stopped again, and starts on its new split
    # whenever it is started again (the config says so)
    tolerant = Supervision(started=True, workers=6, tolerate=True, restarts=Restarts(1, 5.0))
    assert tolerant.decide(see(run(P=3, codes={"4": KILLED}), now=0)).restart == (True,)
    assert tolerant.decide(see(run(P=3, codes={"4": KILLED}), now=1, progress=asked)) == Resplit(
        1, ((0, (4,)), (2, (5,))), (("p0s1", 4.0),), (0,))
    stopping = Supervision(started=True, workers=6)
    assert stopping.decide(see(run(P=3), now=0, signals=1)) == RequestStop()
    assert stopping.decide(see(run(P=3), now=1, signals=1, progress=asked)) == Wait()
    broken = Supervision(started=True, workers=6)
    action = broken.decide(see(run(P=3), progress={"resplit": {"version": "x", "partitions": {}}}))
    assert isinstance(action, Broken) and "re-split request is malformed" in action.reason


def test_a_hung_worker_is_killed_once_where_a_loss_is_tolerated():
    policy = Supervision(started=True, tolerate=True, restarts=Restarts(1, 0.0))
    hung = Observation(0, run(P=3), hung=("2", "3"))
    assert policy.decide(hung) == Kill(("2", "3"))
    assert policy.decide(hung) == Wait()  # killed already: its exit is what counts now
    assert policy.decide(see(run(P=3, codes={"2": KILLED, "3": KILLED}), now=1)) == DropPipelines(
        ((1, "2"),), (True,))
    assert policy.decide(see(run(P=3, codes={"2": KILLED, "3": KILLED}), now=1)) == Respawn(1, 1, 0.0)
    assert policy.decide(Observation(2, run(P=3), hung=("2",))) == Kill(("2",))  # the new one
    assert Supervision(started=True).decide(Observation(0, run(), hung=("1",))) == Wait()


# == another node ===============================================================================


def test_another_nodes_failure_ends_this_one():
    policy = Supervision(started=True)
    assert policy.decide(see(run(), elsewhere="worker rank 5 ...")) == FailedElsewhere("worker rank 5 ...")


def test_a_failure_here_is_named_before_another_nodes():
    policy = Supervision(started=True, settle_s=0)
    assert policy.decide(see(run(codes={"1": 1}), elsewhere="other")) == Failed("1")


def test_finished_here_wins_over_a_later_failure_elsewhere():
    policy = Supervision(started=True)
    assert policy.decide(see(run(codes=all_exit()), elsewhere="other")) == Finished()


# == interrupts =================================================================================

STARTED = {"started": 4}


def test_first_interrupt_after_start_is_a_graceful_stop():
    policy = Supervision(workers=4)
    assert policy.decide(see(run(), progress=STARTED)) == Wait()
    assert policy.started
    assert policy.decide(see(run(), signals=1)) == RequestStop()
    assert policy.interrupted
    assert policy.decide(see(run(), signals=1)) == Wait()  # acted on once
    assert policy.decide(see(run(codes=all_exit()), signals=1)) == Finished(interrupted=True)


def test_second_interrupt_stops_at_once():
    policy = Supervision(started=True)
    assert policy.decide(see(run(), signals=1)) == RequestStop()
    assert policy.decide(see(run(), signals=2)) == StopNow()


def test_two_interrupts_between_polls_count_as_two():
    assert Supervision(started=True).decide(see(run(), signals=2)) == StopNow()


def test_an_interrupt_during_start_up_stops_at_once():
    policy = Supervision(workers=4)
    assert policy.decide(see(run(), progress={"started": 3})) == Wait()
    assert policy.decide(see(run(), signals=1, progress={"started": 3})) == StopNow()
    assert not policy.started


def test_the_interrupts_observation_says_whether_start_up_is_over():
    """A Ctrl-C right after the last worker started: the progress read with it decides."""
    policy = Supervision(workers=4)
    assert policy.decide(see(run(), signals=1, progress=STARTED)) == RequestStop()


def test_a_snapshot_without_a_start_count_means_started():
    """A profiling job's snapshots (rank 0's) come once it runs."""
    policy = Supervision(workers=4)
    policy.decide(see(run(), progress={"phase": "measure"}))
    assert policy.started


def test_a_job_without_a_consistent_point_stops_at_the_first_interrupt():
    policy = Supervision(started=True, graceful=False)
    assert policy.decide(see(run(), signals=1)) == StopNow()


def test_a_failure_after_a_graceful_stop_is_still_a_failure():
    policy = Supervision(started=True, settle_s=0)
    assert policy.decide(see(run(), signals=1)) == RequestStop()
    assert policy.decide(see(run(codes={"2": 1}), signals=1)) == Failed("2", interrupted=True)


def test_an_interrupt_while_settling_on_a_failure_does_not_hide_it():
    policy = Supervision(started=True)
    assert policy.decide(see(run(codes={"1": 1}), now=0)) == Wait()
    assert policy.decide(see(run(codes={"1": 1}), now=0.1, signals=2)) == Wait()
    assert policy.decide(see(run(codes={"1": 1}), now=1, signals=2)) == Failed("1")


def test_an_interrupt_in_the_same_poll_as_a_failure_comes_first():
    """The launcher acts on an interrupt before it looks at the children (as it always did)."""
    policy = Supervision(workers=4)
    assert policy.decide(see(run(codes={"1": 1}), signals=1)) == StopNow()


@pytest.mark.parametrize("final", [
    (see(run(), signals=2), StopNow()),
    (see(run(codes=all_exit())), Finished()),
    (see(run(codes={"0": 1})), Failed("0")),
    (see(run(), elsewhere="x"), FailedElsewhere("x")),
])
def test_a_final_action_stays(final):
    observation, action = final
    policy = Supervision(started=True, settle_s=0)
    assert policy.decide(observation) == action
    assert policy.decide(see(run(codes=all_exit()), now=9)) == action
    assert policy.decide(see(run(), now=10, signals=5, elsewhere="y")) == action


# == properties =================================================================================

FINAL = (StopNow, Finished, Failed, FailedElsewhere)


@st.composite
def histories(draw):
    """A random run seen by the launcher: P x S workers and a scheduler that each exit (or not)
    at some poll with some code, interrupts arriving at some polls, start-up ending at some poll,
    another node failing at some poll. States only move forward, as real processes do."""
    P, S = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    polls = draw(st.integers(1, 25))
    children = [("scheduler", None)] + [(str(r), r // S) for r in range(P * S)]
    code = st.sampled_from([0, 0, 0, 1, KILLED, TERMED])
    exits = {n: draw(st.one_of(st.none(), st.tuples(st.integers(0, polls - 1), code,
                                                    st.one_of(st.none(), st.floats(0, 100)))))
             for n, _ in children}
    interrupts = sorted(draw(st.lists(st.integers(0, polls - 1), max_size=3)))
    started_at = draw(st.one_of(st.none(), st.integers(0, polls - 1)))
    elsewhere_at = draw(st.one_of(st.none(), st.integers(0, polls - 1)))
    steps = draw(st.lists(st.floats(0.01, 0.4), min_size=polls, max_size=polls))
    observations, now = [], 0.0
    for t in range(polls):
        now += steps[t]
        states = []
        for name, pipeline in children:
            e = exits[name]
            ended = e is not None and e[0] <= t
            states.append(ChildState(name, pipeline, e[1] if ended else None,
                                     e[2] if ended and e[1] != 0 else None))
        progress = {"started": P * S if started_at is not None and t >= started_at else 0}
        observations.append(see(tuple(states), now, sum(i <= t for i in interrupts), progress,
                                "elsewhere" if elsewhere_at is not None and t >= elsewhere_at
                                else None))
    return P, observations


@settings(max_examples=150, deadline=None)
@given(histories(), st.booleans(), st.booleans())
def test_final_actions_stay_final(history, tolerate, graceful):
    """Once the launcher decides to stop (or that the run ended) no later poll undoes it."""
    P, observations = history
    policy = Supervision(workers=0, tolerate=tolerate, graceful=graceful)
    final = None
    for obs in observations:
        action = policy.decide(obs)
        if final is not None:
            assert action == final
        elif isinstance(action, FINAL):
            final = action


@settings(max_examples=150, deadline=None)
@given(histories(), st.booleans())
def test_lock_step_never_drops_and_a_failure_always_stops(history, graceful):
    """Without tolerance no pipeline is ever dropped, the run never 'finishes' past a failure,
    and a failure seen before any stop is what the run ends with, once it has settled."""
    P, observations = history
    policy = Supervision(tolerate=False, graceful=graceful)
    seen_failure = None  # when a failure was first seen, while no final action was taken
    final = None
    for obs in observations:
        action = policy.decide(obs)
        assert not isinstance(action, DropPipelines)
        if final is None and seen_failure is None and any(c.failed for c in obs.children) \
                and isinstance(action, Wait):  # (an interrupt is acted on before the children)
            seen_failure = obs.now
        if isinstance(action, Finished):
            assert all(c.returncode == 0 for c in obs.children)
        if isinstance(action, Failed):
            assert {c.name: c for c in obs.children}[action.child].failed
        if seen_failure is not None and final is None:
            assert not isinstance(action, (Finished, FailedElsewhere, StopNow))
            if obs.now - seen_failure >= SETTLE_S:
                assert isinstance(action, Failed)
        if final is None and isinstance(action, FINAL):
            final = action


@settings(max_examples=150, deadline=None)
@given(histories(), st.booleans())
def test_tolerance_drops_only_workers_pipelines_and_never_the_last(history, graceful):
    P, observations = history
    policy = Supervision(tolerate=True, graceful=graceful)
    for obs in observations:
        before = policy.lost
        action = policy.decide(obs)
        if isinstance(action, DropPipelines):
            pipelines = [p for p, _ in action.lost]
            assert pipelines == sorted(set(pipelines)) and not before & set(pipelines)
            assert len(policy.lost) < P  # someone is left to go on
            by_name = {c.name: c for c in obs.children}
            for p, name in action.lost:
                assert by_name[name].pipeline == p and by_name[name].failed
        else:
            assert policy.lost == before
        if isinstance(action, Failed):  # never blames a worker that was stopped on purpose
            assert {c.name: c for c in obs.children}[action.child].pipeline not in policy.lost


@settings(max_examples=150, deadline=None)
@given(histories(), st.booleans(), st.booleans())
def test_interrupts(history, started, graceful):
    """Each new interrupt, unless the run has already ended or is settling on a failure, is acted
    on at once: a graceful stop only for the first one, after start-up, in a graceful job; a stop
    at once otherwise. So a graceful stop is asked at most once."""
    P, observations = history
    # workers: so many that start-up never ends by progress, unless ``started`` says it is over
    policy = Supervision(workers=10 ** 6, graceful=graceful, started=started)
    before, final, settling, requests = 0, None, False, 0
    for obs in observations:
        action = policy.decide(obs)
        requests += isinstance(action, RequestStop)
        if final is None and not settling and obs.signals > before:
            if obs.signals == 1 and started and graceful:
                assert action == RequestStop()
            else:
                assert action == StopNow()
        if final is None and isinstance(action, Wait) and any(c.failed for c in obs.children):
            settling = True
        if final is None and isinstance(action, FINAL):
            final = action
        before = obs.signals
    assert requests <= 1


def test_a_scheduler_killed_by_a_signal_is_started_again_while_the_budget_lasts():
    policy = Supervision(started=True, tolerate=True, restarts=Restarts(2, 1.0))
    assert policy.decide(see(run(codes={"scheduler": KILLED}), now=1)) == RespawnScheduler(1)
    assert policy.decide(see(run(), now=2)) == Wait()  # the new one runs
    assert policy.decide(see(run(codes={"scheduler": KILLED}), now=3)) == RespawnScheduler(2)
    # the budget is used up: the next death fails the run as any helper's does
    assert policy.decide(see(run(codes={"scheduler": KILLED}), now=4)) == Wait()  # settling
    assert policy.decide(see(run(codes={"scheduler": KILLED}), now=4 + SETTLE_S)) == \
        Failed("scheduler")


@pytest.mark.parametrize("policy", [
    Supervision(started=True, tolerate=True, restarts=Restarts(2, 1.0)),  # its own verdict
    Supervision(started=True, tolerate=True),  # continue: no restarts at all
    Supervision(started=True),  # stop
], ids=["exit 1", "continue", "stop"])
def test_a_scheduler_is_not_started_again_after_its_own_verdict_or_without_restarts(policy):
    code = 1 if policy.restarts is not None else KILLED
    assert policy.decide(see(run(codes={"scheduler": code}), now=1)) == Wait()
    assert policy.decide(see(run(codes={"scheduler": code}), now=1 + SETTLE_S)) == \
        Failed("scheduler")

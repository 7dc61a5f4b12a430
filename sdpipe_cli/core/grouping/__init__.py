"""Group scheduling policy: who averages weights with whom, and when. Pure: no I/O, injected clock.

Every stage of every pipeline, after its local optimizer step, reports *ready* (stage, pipeline,
iteration) and waits for a :class:`Decision`: the pipelines whose replicas of that stage average
their weights now. Each stage is scheduled on its own. The rules (SDPipe's, PVLDB 2023; see
docs/SYNC.md):

* **Window.** The first ready replica of a stage opens a window of its own adaptive length; the
  group closes when every available replica of the stage is ready, or when the window ends, with
  everyone ready at that moment. A replica's window doubles (up to ``window_max``) when its group
  had fewer than ``min_group`` members and shrinks by 0.9 (down to ``window_min``) otherwise, so
  fast replicas learn to wait a little for each other while stragglers never hold them up.
* **Who waits for whom** (``policy``). The scheduler sees every replica's speed (its own compute
  time, :meth:`~sdpipe_cli.core.forecast.Forecast.speed`: replicas that wait for each other share
  a pace, not a speed), so it can choose who waits. ``cost_aware``: a round waits only for
  replicas at most :data:`AWAIT_PACE_RATIO` x slower than its fastest member present (the
  opener, or a faster replica that joined since), forecast within its band
  (:meth:`.prediction.Prediction.band`, the forecasts' precision, at most :data:`JITTER_BAND` of
  an iteration), so fast replicas run at their own pace whatever a slower one's ratio; an opener
  not alike the stage's fastest replica waits only for replicas forecast within BEHIND_REACH of
  its own iteration (its phase drifts from theirs: waiting to fall in phase would cost it at
  every round); and past its forecast only
  about as long as its forecasts usually miss (:meth:`.prediction.Prediction.slack`), plus as
  late as the round's opener came against its own forecast (a stall they share); a
  stage due to connect (``connect_every`` x live updates since it was last connected, as the
  reference counts) holds a round only if it would merge nothing and its members are outside the
  component of the stage's fastest replica, until a replica of another component arrives. The
  fastest replica is never held, so every held round closes within one of its iterations: no
  token, no stage waiting on another, and a due stage connects within one round of each of its
  replicas. A fastest replica that goes silent (``suspect_after`` past its forecast: a hang) is
  no longer the one held rounds wait for; the next fastest is (:meth:`.connectivity.Connectivity.anchor`).
  Global syncs give each pipeline as many iterations as fit before the slowest one's
  next, so that they arrive together. ``classic`` is the rule below, kept for comparison.
* **Connectivity bound** (``classic``). A disjoint set per stage accumulates the groups since the
  stage's replicas were last all connected. When the next round would be the ``connect_every``-th,
  the group does not close at the window's end but waits until it merges every component that is left.
  So within every ``connect_every`` rounds information from each replica reaches every other,
  which bounds how far replicas drift apart. With ``connect_every = 1`` every round waits for all
  replicas: plain all-reduce. For ``connect_every > 1`` only one stage at a time may wait for
  connectivity (a token), as in the reference: two stages waiting on each other's pipelines could
  otherwise deadlock, since a pipeline only moves on when all its stages got their groups.
* **Global sync.** Every ``global_every`` iterations of an average pipeline (P x global_every
  pipeline-iterations in total) each pipeline p is assigned its next iteration k_p, and every stage
  of p averages with all live replicas at k_p: a consistent model for evaluation and checkpoints.
  The run's last round is such a global sync with ``stop`` set, placed so that the run ends after
  ``total_iterations`` pipeline-iterations (or after ``time_limit`` seconds); cost_aware places
  it so that the run ends as early as that budget allows (:mod:`.budget`).
* **Departures.** A pipeline that is gone (:meth:`GroupScheduler.leave`) never blocks a group.
  Its iterations that not every stage finished (no decision yet) no longer count: the budget is
  spent by iterations that were done, and a restarted pipeline redoes them.
* **Rejoining** (``fault.on_pipeline_loss=restart``). Each stage of a restarted pipeline asks to
  rejoin (:meth:`GroupScheduler.rejoin`); the next group round of that stage (not a global sync,
  and none pending) names one member, the first, as its source: after its update, that replica
  sends its weights and optimizer state to the restarted one (``Decision.heal``). A replica healed
  then is a copy of a live one, so it joins its source's component. The pipeline is live again once
  every stage is healed, and goes on from the first iteration it had not finished. While a global
  sync is pending no stage is healed, so a pipeline never becomes live halfway through one.
* **Prediction** (``patience > 0``). The scheduler sees every replica's ready signals and knows
  when it released each one, so it forecasts each replica's next ready signal from its release
  and its compute time (:mod:`~sdpipe_cli.core.forecast`), and knows its pace (a moving average
  of the interval between its rounds). When a round opens, it also waits for the replicas
  forecast within ``patience`` x the opener's own interval: replicas at the same pace (a
  homogeneous cluster) meet in full groups, as all-reduce would, while a replica forecast far
  later (a straggler) is not waited for. The adaptive window still applies (the round waits at
  least that long); ``patience = 0`` is the reference's rule alone. The workers' evaluations
  (every ``evaluate_every`` iterations, the run's ``train.eval_every``) are known pauses: a
  replica released before one is forecast with its last measured pause, so that equal replicas
  back from an evaluation meet again instead of scattering (the flushed schedules).

* **Group cap** (``max_group > 0``). A round closes as soon as that many are ready (a due round
  swaps in a replica of another component, and merging two components is then enough); global
  syncs always include everyone, and so does every round with ``connect_every = 1`` (all-reduce:
  the cap and ``cost_aware`` do not apply there).

Connectivity is measured among the live replicas; rounds of replicas catching up to a pending global
sync (which connects everyone when it closes) do not wait for connectivity.

The package holds one part per concept, each a plain class over the shared :class:`.state.RunState`
(no I/O, the injected clock), composed by the thin :class:`GroupScheduler` (:mod:`.scheduler`):

* :mod:`.rounds`: opening and closing a stage's rounds, the adaptive window;
* :mod:`.prediction`: who an open round waits for (patience, cost_aware's pace bound and slack);
* :mod:`.connectivity` (with :mod:`.disjoint`, the union-find): who must connect, the token (classic), the anchor
  (cost_aware), the group cap's pick;
* :mod:`.budget` (flushed schedules) and :mod:`.async_budget` (asynchronous 1F1B): global syncs
  and the end of the run, two planners of which the scheduler is built with one;
* :mod:`.membership`: departures, rejoining and healing;
* :mod:`.lineage`: twins (``sync.average=weights_grads``);
* :mod:`.freshness`: what stale members count in a round's averages (``sync.stale``);
* :mod:`.state`: ``Decision``, the shared state and the read-only :class:`.state.Snapshot`.
"""

from __future__ import annotations

from sdpipe_cli.core.grouping.async_budget import AsyncPlanner
from sdpipe_cli.core.grouping.budget import END_CHECKS, MAX_AHEAD, FlushedPlanner
from sdpipe_cli.core.grouping.connectivity import Connectivity
from sdpipe_cli.core.grouping.disjoint import DisjointSet
from sdpipe_cli.core.grouping.freshness import STALE_RULES, Freshness
from sdpipe_cli.core.grouping.prediction import AWAIT_PACE_RATIO, JITTER_BAND, LATE_SLACK, SLACK_ERRORS, SLACK_FLOOR
from sdpipe_cli.core.grouping.scheduler import POLICIES, AsyncGroupScheduler, GroupScheduler, make_policy
from sdpipe_cli.core.grouping.state import Decision, Snapshot, StageView, gossip_peer

__all__ = ["AWAIT_PACE_RATIO", "END_CHECKS", "JITTER_BAND", "LATE_SLACK", "MAX_AHEAD", "POLICIES",
           "SLACK_ERRORS", "SLACK_FLOOR", "STALE_RULES", "AsyncGroupScheduler", "AsyncPlanner",
           "Connectivity", "Decision", "DisjointSet", "FlushedPlanner", "Freshness",
           "GroupScheduler", "Snapshot", "StageView", "gossip_peer", "make_policy"]

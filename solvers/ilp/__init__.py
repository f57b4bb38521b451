"""The ILP: a Checkmate-style mixed-integer program (Jain et al., "Checkmate: Breaking the Memory Wall
with Optimal Tensor Rematerialization", MLSys 2020) for general DAGs, in memplan's plan space.

Checkmate lets the solver pick any schedule (``R[t,i]`` compute op i at stage t, ``S[t,i]`` keep it).
memplan's plans are narrower -- per saved activation keep / recompute / recompute_each / offload, plus a
prefetch point --
and the simulator (:mod:`memplan.planner.core.simulator`) fixes everything else: a missing saved tensor is
rebuilt *lazily* when its backward step needs it, by replaying its producer and, recursively, the
producers of missing inputs. So the stages here are the simulator's own: one per forward op, and in
backward one per (step ``s``, k-th saved tensor of op ``s``) materialisation pass. The variables encode
the simulator's boolean logic exactly, as linear constraints:

* decisions: ``r[u]`` recompute, ``each[u]`` recompute_each, ``o[u]`` offload (keep is ``1 - r - each -
  o``) per saved activation; ``each[u]`` is Checkmate's per-use re-creation (a tensor computed at several
  stages): freed after forward like ``r[u]``, and when a pass re-creates u for another target it is
  ``kept`` past the pass only when ``not each[u]`` (else freed after its last reader in the pass, like an
  unsaved tensor, and rebuilt by its own pass later); ``each[u] <= sum`` of those re-creations, since
  elsewhere recompute_each replays exactly as recompute (one of two equal plans, for the lazy cuts);
  ``y[u, slot]`` the moment u's copy back starts: at the start of a chosen backward step (the plan's
  ``prefetch_at``) or in a pass whose replay needs u earlier (the simulator then prefetches it there);
* per pass (s, k) and tensor u of the target's ancestor closure: ``vis`` (the replay's traversal
  reaches u), ``w = vis and not resident`` (u must be rebuilt or fetched), ``rp[p]`` (op p is replayed:
  Checkmate's R), ``made`` (an output allocated by the replay); residency (Checkmate's S) is a linear
  expression of the decisions and of earlier passes' ``made`` (replayed saved tensors stay until their
  own backward, the rest are freed after their last use in the pass);
* memory: one row per forward op, per backward step and per replayed op of every pass (the replay's
  live set: pass-start residents, this op's outputs, earlier outputs still read by a later replayed op);
* scratch copies (:func:`~memplan.planner.core.replay.reads_mid_chain`): a replayed op that reads a
  tensor before its in-place chain ends does not make the pass rebuild it in full; when the pass does
  not (``w = 0``), ``scratch`` is 1, the copy's bytes join that op's row, its producer's time the
  objective, and what its producer reads finished is needed like a replayed op's input;
* offload: the D2H copies form a FIFO chain of continuous end times in forward; ``z[u, i]`` says the
  copy of u has not ended when op i starts (u still on device); prefetches and exposed waits form a
  second chain over backward (clock ``tau``, copy stream ``cf``), lower bounds only, so at the optimum
  they equal the simulator's max(...) recurrences;
* objective: the simulated step time (replays + exposed waits; forward, backward and optimizer time
  are constants). A replayed op costs what the simulator charges (``schedule.replay_op_cost_s``: the
  executor's dispatch of it included), and the executor's watch window (:mod:`.window`) is charged per
  forward op, from the lowest to the highest op a plan needs (a recomputed tensor's producer, each
  replayed op and the producers of what it reads; with offload from op 0 to each offloaded tensor's
  last saver, chosen prefetch point and forward release). Without them a profiled graph's every plan
  was under-priced, cut and solved again (the built-in mlp: 16 rounds). Host memory:
  ``sum(o[u] * bytes) <= host_budget_bytes``.

The result's ``space`` (:func:`memplan.solvers.registry.plan_space`) says over which plans its status and
bound hold: ``all`` with recompute_each in the model (by default on graphs of at most ``per_use_saved``,
20, saved activations, where it costs a few seconds; past that the LP bound weakens and proofs take far
longer); ``keep/recompute`` (``/offload``) without (``per_use=False``, or larger graphs by default); offload only at
the default points with ``prefetch="default"``. The interval model's bound covers every plan without
offload (:mod:`.intervals`).

The model is formulated once (:class:`~memplan.solvers.ilp.linear.LinearModel`: variables, linear
rows, objective, all with integer coefficients) and handed to OR-Tools CP-SAT (``backend="cpsat"``,
default) or to PuLP's CBC (``"cbc"``) or HiGHS (``"highs"``; in a child process when the installed
highspy cannot load beside OR-Tools' own HiGHS library, see
:func:`~memplan.solvers.ilp.backends.solve_highs`). CBC and HiGHS run with a zero relative gap.

**Sound numerics.** Memory is counted in one unit per graph: the gcd of every size when the rows then
stay below ``max_memory_units`` (2^20 by default; the model is byte-exact), otherwise a coarser unit with
every size and the budget rounded *down*. Replay times are integer ticks (~1e-9 of the step) rounded
down. The memory and replay rows are then a *relaxation* of the exact problem: every plan that fits in
bytes is in the model, at a time no higher than the simulator's, so the solver's bound and its
"infeasible" hold for the exact problem. Byte-exact coefficients of GPU tensors (1e10 and more) made
CP-SAT report plans up to 10% off the optimum as optimal and CBC report "infeasible" where plans exist;
a relaxation with small coefficients does not. ``solve_ilp`` simulates every proposal exactly: one over
budget (possible after rounding) gets a no-good cut and the model is re-solved (a lazy-constraint loop
that keeps the relaxation valid: a cut removes only plans the simulator refused, or plans recorded as
the incumbent). ``optimal`` is reported only when a simulated plan meets the proven bound (to 1e-9
relative plus a tick per op); the bound is the best over the rounds, capped by the incumbent.

With offload the copy stream's clock mixes rounded-up copy durations, rounded backward steps and
rounded-down replays, so a plan's model time can differ from the simulator's by a counted number of
ticks (``Built.time_err_s``); bounds are lowered by it. The offload parts of the model are otherwise
conservative or exact:

* copy durations are rounded up to ticks and forward op starts down, so a copy is never modelled as
  ending earlier than it does;
* on large graphs (or with ``copy_window_ops`` set) an offloaded tensor's D2H copy must end within
  ``copy_window_ops`` ops after its last forward use and before backward starts; on small graphs a copy
  may run into backward, modelled exactly: the forward copy chain is an exact max, and per backward step
  a binary says whether the copy is still running (the tensor still on device, a prefetch then moving
  nothing);
* a replayed multi-output op may not re-create an offloaded output that is not yet back on device.

On large graphs (see :class:`~memplan.solvers.ilp.config.Config`) replays are limited to
``max_replay_depth`` producers deep and prefetch points to a window after the first backward use: plans
needing more are excluded, so that model's bound and "optimal" hold only over the plans it admits and
are reported in ``stats['model_bound_s']`` / ``stats['model_status']``, not as the method's.

**Past 400 saved activations** (a 1.1B Llama has 405, an 80-layer one 1,449) the replay and interval
models are not built: ``formulation="blocks"`` (:mod:`.blocks`) bounds the step time by the LP (then, with
the time left, the MIP) of :mod:`.staircase`, the interval relaxation with prefix-sum rows, the executor's
watch window and replay dispatch, valid over every keep / recompute / recompute_each plan without offload
(``stats['space']``), and proposes block-uniform plans (matched activations of repeated layers decided
alike, in 1, 2, 4... groups of layers), each simulated. Offload there is refused (the replay model's
limit stays 400).

Modules: :mod:`.linear` (the backend-free linear model), :mod:`.formulation` (the rows, from a graph),
:mod:`.backends` (CP-SAT, CBC, HiGHS), :mod:`.driver` (warm start, lazy cuts, the registered ``ilp``
strategy), :mod:`.config` (its options), :mod:`.staircase`, :mod:`.blocks` and :mod:`.lp` (HiGHS called
directly) for large graphs.
"""

from memplan.solvers.ilp.config import BACKENDS, Config
from memplan.solvers.ilp.driver import solve_ilp

__all__ = ["BACKENDS", "Config", "solve_ilp"]

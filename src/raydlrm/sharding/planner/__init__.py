"""The sharding planner: where each embedding table goes, and what it costs there.

TorchRec's planner, by concern (:func:`~raydlrm.sharding.planner.planners.plan_sharding` is the
entry point; :class:`~raydlrm.sharding.plan.ShardingPlan`, what it makes and the sharded
collections read, lives beside this package):

* :mod:`~raydlrm.sharding.planner.planners`: :func:`plan_sharding`, the search as a whole;
* :mod:`~raydlrm.sharding.planner.request`: its checked arguments and the budget error;
* :mod:`~raydlrm.sharding.planner.storage`: the storage reservations (memory and disk of a
  table where it is placed, the page cache, which ``auto`` tables go to SSD first);
* :mod:`~raydlrm.sharding.planner.shards`: a table's shards by its sharding type;
* :mod:`~raydlrm.sharding.planner.placement`: per-rank cost and memory, the greedy placement;
* :mod:`~raydlrm.sharding.planner.refine`: refinement moves, swaps and splits;
* :mod:`~raydlrm.sharding.planner.learned_placement`: placement by a learned cost model
  (NeuroShard), with :mod:`~raydlrm.sharding.planner.neural_search` its search;
* the estimators: :mod:`~raydlrm.sharding.planner.cost` (the analytic cost model),
  :mod:`~raydlrm.sharding.planner.calibration` (its constants measured on this machine),
  :mod:`~raydlrm.sharding.planner.learned_cost` (the learned compute model),
  :mod:`~raydlrm.sharding.planner.comm_samples` (the learned all-to-all model) and
  :mod:`~raydlrm.sharding.planner.measure` (what their measurements share);
* towers (Disaggregated Multi-Tower): :mod:`~raydlrm.sharding.planner.tower_plan` (each host's
  tables planned over its ranks) and :mod:`~raydlrm.sharding.planner.tower_partition` (features
  grouped into towers by how much they interact).

The search, deterministic for the same inputs:

1. **Greedy** (:mod:`.placement`): tables largest cost first on the least-loaded allowed
   rank(s) with room in the memory budget; a table's sharding type decides its shards.
2. **Refinement** (``search="refine"``, :mod:`.refine`): moves and swaps of table-wise tables
   off the most-loaded rank while it gets lighter.
3. **Splitting** (``default_type = "auto"`` only, :mod:`.refine`): row- and column-wise splits
   of the most-loaded rank's tables while they lower the maximum, then refinement again.

The maximum per-rank cost never increases after the greedy placement. The package imports
nothing eagerly: import the module that defines a name (``raydlrm.sharding`` exports the
public ones lazily).
"""

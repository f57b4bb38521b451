"""memplan.planner.probe: where torch meets the planner. It turns a real (or fake) training step into a
trace, hands it to ``memplan.planner.core.build`` for its graph, and measures what steps really cost.

Read bottom-up: ``storage`` says how a tensor's storage is seen; ``measure`` reads the allocator (CPU,
CUDA, per rank) and the clock, the one place that does; ``tracing`` is the dispatch mode that records a
step as a trace; ``fake`` runs the trace under FakeTensorMode; ``optime`` times ops one at a time or
analytically; ``profiler`` (``profile()``) orchestrates them into a graph; ``family`` profiles a family
of shapes; ``distributed`` adapts graphs to DDP/FSDP ranks; ``materialize`` builds a model planned on
the meta device for real (allocated on the device, initialised by its own code).
"""

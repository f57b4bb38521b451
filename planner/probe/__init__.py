"""memplan.planner.probe: where torch meets the planner. It turns a real (or fake) training step into a
``memplan.planner.core.graph.Graph`` and measures what steps really cost.

``profiler`` traces a step and builds the graph; ``fake`` runs the trace under FakeTensorMode; ``optime``
times ops one at a time or analytically; ``measure`` reads the allocator (CPU, CUDA, per rank);
``family`` profiles a family of shapes; ``distributed`` adapts graphs to DDP/FSDP ranks.
"""

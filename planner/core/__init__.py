"""memplan.planner.core: the torch-free model of a training step and of a plan.

Read it in pipeline order: ``graph`` (what a profiled step is: ops, tensors, saved sets, lifetimes),
``plan`` (keep / recompute / offload per tensor), ``replay`` (what re-creating one tensor runs),
``schedule`` (a plan lowered once into events), ``simulator`` (the events scored: peak bytes and step
time, the single source of truth), with ``units`` (byte and budget parsing), ``errors``, ``shapes``
(graphs as polynomials of dynamic dimensions), ``devicespec`` (GPU figures for analytic timing) and
``synthetic`` (random graphs for tests). Nothing here imports torch; solvers and the service use only this.
"""

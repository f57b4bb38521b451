"""memplan inside training frameworks: profile the framework's own step on its first batch, solve, and
train the rest under the plan. :mod:`.huggingface` (``MemplanCallback`` for ``transformers.Trainer``,
extra ``hf``) and :mod:`.lightning` (``MemplanCallback`` for ``lightning.Trainer``, extra ``lightning``);
each imports its framework only when imported itself. :mod:`.torch_compile` (``compile_with_budget``:
torch.compile under a budget in bytes on the step's measured peak, memplan's solver as the partitioner's
knapsack; docs/compile.md)."""

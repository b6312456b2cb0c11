"""Commands around the trainers: ``export-hf`` (checkpoint to Hugging Face folder), ``ablate`` (variants x
seeds on equal budgets), ``grow`` (function-preserving growth), ``embed`` (sentence embeddings), ``probe``
(probing tasks, their overlap check with the pretraining shards) and the fine-tuning baselines.

Imports: every other package of ``distaff.train`` and ``distaff.kernels``. Imported by: nothing in the
package but ``distaff.launch.cli``, which loads a command's module by name when it runs.
"""

"""``distaff ablate --config ABL.yaml``: named variants of one run config on equal budgets, compared.

Every variant runs on the same prepared data, for the same token budget (``train.max_steps`` is
derived from it), once per seed, evaluating on the held-out split every few steps. Runs go one
after another as subprocesses (``launcher: sequential``: plain ``python`` for one rank,
``torchrun`` for more; ``parallel: N`` runs up to N single-rank runs at once, each with the cores
split evenly between them) or are written as job scripts to start elsewhere (``launcher: script``;
``distaff ablate --config ABL.yaml --report`` then gathers them). Runs go seed by seed (every
variant of the first seed, then the second seed...), so a partial ablation holds paired results.
A run whose ``summary.json`` says it finished the planned number of steps, with the planned config (the
fingerprint of its resolved config: every key but ``wandb``, ``logging``, ``checkpoint``, ``distributed``,
``run.name`` and ``run.out_dir``), is not run again; a run made with other settings (a variant edited since) is
refused, naming the changed keys, until its folder is deleted; any other
run is started again and resumes from its latest checkpoint, so an interrupted ablation continues where
it stopped and only runs of the planned length are compared. A failed run is reported with its log and
the others go on; Ctrl-C or SIGTERM stops the runs in progress (each gets SIGTERM: it saves a checkpoint
it resumes from) and exits 75, as a run does (run the same command again to continue). One ablation at a time per ``out_dir``: a second is refused, naming the first (the lock
runs take, ``runlock.py``).

A variant may also be made from an earlier variant's run, for each seed (``derived``):
``branch: {of: NAME, decay: 0.2, shape: 1-sqrt}`` is a decay branch of NAME's WSD run (``distaff decay``) over
its last 20% of steps, at equal steps and tokens; ``average: {of: NAME, last: 5, ema: 0}`` is ``distaff average``
of the last 5 checkpoints of NAME's run, scored by the run's own held-out evaluation. They run after their
parent. ``budget: real`` counts ``tokens`` as real tokens (padding left out, from the prepared data's sample
lengths), to compare padded with packed batches at equal text; ``prepare.pack_documents: false`` prepares one
document per sequence.

The report, read back from each run's ``summary.json`` and ``metrics.jsonl``: ``ablation.csv``
(one row per run and one per variant), ``ablation.md`` (held-out loss and MLM accuracy, or for RTD the
discriminator's accuracy and AUC, mean +- std over seeds, tokens/s; each variant's per-seed difference in
held-out loss against the first variant, mean +- std) and ``ablation.png`` (held-out loss against tokens seen). The runs share the
W&B group ``name``. Paths in the file are relative to the working directory, like run configs; the
file itself and ``base`` may also name installed presets (``distaff ablate --config positions-cpu``,
``base: tiny-cpu``).

ABL.yaml::

    name: positions                       # W&B group, report title
    base: tiny-cpu                        # the run config every variant starts from (a file or a preset)
    out_dir: runs/ablation/positions      # runs/<variant>/seed-<s>/, data/, the report
    prepare:                              # optional: tokenizer + shards made here once (else data.dir)
      input: [data/austen-emma-pride.txt.gz]
      vocab_size: 4000
      seq_len: 128
      heldout_fraction: 0.02
    tokens: 1000000                       # per run: max_steps = ceil(tokens / tokens per step)
    seeds: [1, 2, 3]
    evals: 8                              # held-out evaluations per run (eval.every = max_steps // evals)
    ranks: 1
    launcher: sequential                  # sequential | script
    parallel: 1                           # sequential, ranks: 1: runs at once (cores split between them)
    overrides: {checkpoint.every: 0}      # dotted run-config keys for every variant
    budget: positions                     # positions | real: what `tokens` counts
    variants:
      - name: relative+emd
        overrides: {model.emd: true}
      - name: absolute
        overrides: {model.relative_attention: false, model.pos_att_type: [], model.position_biased_input: true}
      - name: wsd                         # a parent: it branches / averages need it to checkpoint
        overrides: {optim.schedule: wsd, checkpoint.every: 20}
      - name: wsd-decay
        branch: {of: wsd, decay: 0.2}
      - name: wsd-avg
        average: {of: wsd, last: 5}

Modules: ``config`` (the file read and checked; each variant's run config), ``derived`` (decay branches and
averages), ``plan`` (the runs and their step counts; the data prepared), ``runs`` (started, stopped, or written as
job scripts), ``report`` (the table, the paired differences, the plot), ``cli``.

Imports: what ``distaff.train.tools`` imports (run configs, the schedule, metrics, ``distaff average``'s and
``distaff decay``'s pieces). Imported by: ``distaff.launch.cli`` (``distaff ablate``) and nothing else in the package.
"""

from distaff.train.tools.ablate.cli import main
from distaff.train.tools.ablate.config import AblationConfig, load_ablation, variant_config
from distaff.train.tools.ablate.plan import PlannedRun, plan_runs, real_tokens_per_batch
from distaff.train.tools.ablate.report import paired_differences
from distaff.train.tools.ablate.runs import run_parallel, write_job_scripts

__all__ = ["AblationConfig", "PlannedRun", "load_ablation", "main", "paired_differences", "plan_runs",
           "real_tokens_per_batch", "run_parallel", "variant_config", "write_job_scripts"]

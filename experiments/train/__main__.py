"""Train and test one attention variant on one LRA task.

    python -m experiments.train --config=configs/lra/listops.py:performer \
        --workdir=runs/listops/performer
    python -m experiments.train --config=configs/lra/listops.py:full,tiny --workdir=runs/tiny \
        --config.model.num_layers=1 --plugins=my_attention

`--config=FILE:ATTENTION[,PRESET]` (preset paper, the default, fair or tiny); any field can
be overridden with `--config.<field>=value`. Running again with the same workdir resumes;
`--restart` starts it again from step 0, keeping the earlier run's files renamed (a workdir
holding checkpoints of another run is refused without it).
"""
from absl import flags, logging
from ml_collections import config_flags

from experiments.common import command_line, dry_run, task_configs
from experiments.common.errors import HarnessError

FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise HarnessError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not dry_run.requested():   # the imports take seconds, more under load: say what is happening
    logging.info("%s / %s -> %s: starting (importing JAX and the trainer)", FLAGS.config.task,
                 FLAGS.config.model.attention, FLAGS.workdir)
  from experiments.train import build, trainer  # import JAX: after the flags are known good

  # The plan, then where each value came from (the task, the preset, the variant's settings,
  # the command line).
  dry_run.plan(lambda: [trainer.plan_line(FLAGS.config, FLAGS.workdir, restart=FLAGS.restart),
                        *build.source_lines(FLAGS.config, task_configs.baseline(FLAGS.config)),
                        *trainer.sharding_lines(FLAGS.config)])
  trainer.initialize_distributed()
  results = trainer.train_and_evaluate(FLAGS.config, FLAGS.workdir, restart=FLAGS.restart)
  print(f"{results['task']} / {results['attention']}: test accuracy "
        f"{results['test_accuracy_final']:.4f} at the final step {results['steps']}, "
        f"{results['test_accuracy_best_validation']:.4f} at the best validation step "
        f"{results['best_step']}; {FLAGS.workdir}/results.json")


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "configs/lra/<task>.py:<attention>[,<preset>] "
                                  "(or configs/mqar.py:<attention>,tiny)", lock_config=True)
  flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and results.json.")
  flags.DEFINE_list("plugins", [], "Modules to import first; they may register attention variants.")
  flags.DEFINE_bool("restart", False, "Start from step 0 even if the workdir holds checkpoints; "
                    "the earlier run's files and checkpoints are renamed <name>.1.")
  flags.mark_flags_as_required(["config", "workdir"])
  command_line.run(main)

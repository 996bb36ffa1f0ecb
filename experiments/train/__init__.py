"""The train job: one run of one attention variant on one task, `python -m experiments.train`
(__main__.py). Its parts, each importing only those listed before it and experiments/common/:

  build        a config's presets resolved for its variant; the task's model
  optimizer    Adam / AdamW and LRA's learning-rate schedules
  metrics      metrics.jsonl and TensorBoard, kept step-consistent across resumes
  checkpoints  orbax checkpoints, verified by checksums before use
  data         the task's splits, generated when a tiny run lacks them; batches on the mesh
  steps        the compiled train and evaluation steps; what a task trains for (`score`)
  trainer      the run: checks, compile, train, evaluate, test, results.json

This file imports nothing, so that the command checks its flags before JAX starts.
"""

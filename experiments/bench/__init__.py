"""The efficiency benchmark behind `python -m experiments.benchmark` and
`python -m experiments.capacity`, one module per job:

  settings   what to measure (Settings), the Text model's config at a length, Status
  workloads  the programs: the trainer's train step of the LRA Text model, or the attention
             module alone (and jax.nn.dot_product_attention as an outside baseline)
  hlo        whether a compiled program loops over matrix products (its FLOP count is then a
             lower bound)
  measure    compile, memory, timing under budgets, the whole run, speed-ups and exponents
  output     CSV, markdown (LRA Table 2 layout beside the paper's), JSON, plots
  capacity   the longest length whose train step fits the device, per variant and setting
"""

"""The approximation mode: how far each approximate variant is from the exact attention it
stands for (it times nothing).

For random q, k ~ N(0, std²) and v ~ N(0, 1) ([batch, length, heads,
head_dim]), each variant's output at its default options is compared with exact softmax
attention on the same inputs: the relative error ||out - exact|| / ||exact||, mean over
--draws. Larger std gives peakier attention (score std is std²), which low-rank and
random-feature methods find harder. Shared-QK variants (reformer) are compared with what they
approximate: softmax over keys = unit-normalised queries, a query not attending to itself.
Learned projections (linformer, synthesizer, sinkhorn's sorter) are at their initialisation
here; training adapts them, so their figure says little about a trained model. Writes
benchmark_approximation.md.
"""
from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attention_zoo as az
from attention_zoo import reference
from experiments.benchmark.settings import lengths_text
from experiments.common import dry_run
from experiments.common.command_line import integers
from experiments.common.records import write_text
from experiments.common.variant_names import check_attention

def exact_attention(spec, q, k, v, causal):
  """What the variant approximates: softmax attention, on shared-QK keys when the spec says so."""
  if not spec.shared_qk:
    return reference.masked_softmax_attention(q, k, v, causal=causal)
  keys = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  n = q.shape[1]
  allowed = ~np.eye(n, dtype=bool)                             # [n, n]: not itself
  if causal:
    allowed &= reference.causal_pattern(n, n, causal=True)[0]
    allowed[0, 0] = True                                        # query 0 has only itself to see
  return reference.dense_attention(q, keys, v, allowed)


def relative_error(name: str, *, length: int, num_heads: int, head_dim: int, std: float, seed: int,
                   causal: bool = False, **options) -> float:
  """||out - exact|| / ||exact|| for one draw of inputs and of the variant's parameters."""
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  shape = (1, length, num_heads, head_dim)                      # [batch, n, heads, head_dim]
  q, k = std * jax.random.normal(kq, shape), std * jax.random.normal(kk, shape)
  v = jax.random.normal(kv, shape)
  attn = az.create(name, num_heads=num_heads, head_dim=head_dim, causal=causal, max_len=length,
                   rngs=nnx.Rngs(seed), **options)
  out = nnx.jit(lambda module, q, k, v: module(q, k, v))(attn, q, k, v)
  exact = exact_attention(az.spec(name), q, k, v, causal)
  return float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))


def approximation_table(names, *, length: int, num_heads: int, head_dim: int, stds,
                        draws: int, causal: bool) -> list[str]:
  """The markdown lines of one table: each variant's mean relative error at each q, k std."""
  names = [n for n in names
           if (az.spec(n).supports_causal if causal else az.spec(n).supports_bidirectional)]
  lines = [f"Relative error to exact {'causal ' if causal else ''}softmax attention at the "
           f"variants' defaults: length {length}, {num_heads} heads, head_dim {head_dim}, mean "
           f"of {draws} draws; jax {jax.__version__}, {jax.devices()[0].platform}.",
           "",
           "| variant | options | " + " | ".join(f"q, k std {s}" for s in stds) + " |",
           "|---|---|" + "---|" * len(stds)]
  for name in names:
    options = {k: v for k, v in az.spec(name).options.items() if k not in ("scale", "dropout_rate")}
    errors = [np.mean([relative_error(name, length=length, num_heads=num_heads,
                                      head_dim=head_dim, std=std, seed=seed, causal=causal)
                       for seed in range(draws)]) for std in stds]
    lines.append(f"| {name} | {', '.join(f'{k}={v}' for k, v in options.items())} | "
                 + " | ".join(f"{e:.3f}" for e in errors) + " |")
    print(lines[-1], flush=True)
  return lines


def run_mode(values, command: str) -> int:
  """`--mode=approximation` from the parsed flags (the mode's defaults filled in)."""
  del command   # the table states its settings itself
  lengths, head_dims = integers(values.lengths, "lengths"), integers(values.head_dims, "head_dims")
  names = values.attentions or [n for n in az.available("attention") if not az.spec(n).exact]
  for name in names:
    check_attention(name)
  stds = [float(s) for s in values.input_stds]
  path = os.path.join(values.out, "benchmark_approximation.md")
  dry_run.plan(lambda: [f"approximation {name}: lengths {lengths_text(lengths)}, head_dims "
                        f"{lengths_text(head_dims)}, masks {','.join(values.masks)}, input stds "
                        f"{','.join(values.input_stds)}" for name in names] + [f"then {path}"])
  lines = []
  for mask, length, head_dim in itertools.product(values.masks, lengths, head_dims):
    lines += approximation_table(names, length=length, head_dim=head_dim,
                                 num_heads=values.num_heads, stds=stds, draws=values.draws,
                                 causal=mask == "causal") + [""]
  write_text(path, "\n".join(lines))
  print(f"wrote {path}")
  return 0

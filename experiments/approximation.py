r"""How far each approximate variant is from the exact attention it stands for, at its defaults.

    python -m experiments.approximation --out=results/approximation.md \
        [--attentions=performer,nystromformer] [--length=1024] [--input_stds=0.5,1.0] [--causal] \
        [--plugins=my_variants]

For random q, k ~ N(0, std²) and v ~ N(0, 1) ([batch, length, heads, head_dim]), each variant's
output is compared with exact softmax attention on the same inputs: the relative error
||out - exact|| / ||exact||, mean over --seeds. Larger std gives peakier attention (score std
is std²), which low-rank and random-feature methods find harder. Shared-QK variants (reformer)
are compared with what they approximate: softmax over keys = unit-normalised queries, a query
not attending to itself. Learned projections (linformer, synthesizer, sinkhorn's sorter) are
at their initialisation here; training adapts them, so their figure says little about a
trained model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

import attention_zoo as az
from attention_zoo import reference
from experiments import cli, provenance
from experiments.plugins import load_plugins

FLAGS = flags.FLAGS


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


def main(argv):
  del argv
  load_plugins(FLAGS.plugins)   # already imported by cli.run from the command line; no-op then
  names = FLAGS.attentions or [n for n in az.available("attention") if not az.spec(n).exact]
  if FLAGS.causal:
    names = [n for n in names if az.spec(n).supports_causal]
  stds = [float(s) for s in FLAGS.input_stds]
  lines = [f"Relative error to exact {'causal ' if FLAGS.causal else ''}softmax attention at the "
           f"variants' defaults: length {FLAGS.length}, {FLAGS.num_heads} heads, head_dim "
           f"{FLAGS.head_dim}, mean of {FLAGS.seeds} draws; jax {jax.__version__}, "
           f"{jax.devices()[0].platform}.",
           "",
           "| variant | options | " + " | ".join(f"q, k std {s}" for s in stds) + " |",
           "|---|---|" + "---|" * len(stds)]
  for name in names:
    options = {k: v for k, v in az.spec(name).options.items() if k not in ("scale", "dropout_rate")}
    errors = [np.mean([relative_error(name, length=FLAGS.length, num_heads=FLAGS.num_heads,
                                      head_dim=FLAGS.head_dim, std=std, seed=seed,
                                      causal=FLAGS.causal)
                       for seed in range(FLAGS.seeds)]) for std in stds]
    lines.append(f"| {name} | {', '.join(f'{k}={v}' for k, v in options.items())} | "
                 + " | ".join(f"{e:.3f}" for e in errors) + " |")
    print(lines[-1], flush=True)
  table = "\n".join(lines) + "\n"
  print(table)
  if FLAGS.out:
    provenance.write_text(FLAGS.out, table)


# Flags are defined here, not at import: tests import this module next to other entry points.
if __name__ == "__main__":
  flags.DEFINE_list("attentions", [], "Variants (default: every registered one that is not exact).")
  flags.DEFINE_integer("length", 1024, "Sequence length.")
  flags.DEFINE_integer("num_heads", 4, "Heads.")
  flags.DEFINE_integer("head_dim", 64, "Head dimension.")
  flags.DEFINE_list("input_stds", ["0.5", "1.0"], "Standard deviations of q and k.")
  flags.DEFINE_integer("seeds", 3, "Input / parameter draws averaged.")
  flags.DEFINE_bool("causal", False, "Compare causal variants with causal softmax.")
  flags.DEFINE_string("out", None, "Markdown file to write (the table is printed in any case).")
  flags.DEFINE_list("plugins", [],
                    "Modules to import first; they may register more attention variants.")
  cli.run(main)

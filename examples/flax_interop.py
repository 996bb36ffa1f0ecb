"""Swap the attention of a Flax model for the zoo's, keeping its weights, and compare.

    python -m examples.flax_interop --length=4096

`Decoder` is a causal language model written only with `flax.nnx` layers, as Flax's lm1b
example writes one: token and learned position embeddings, pre-LayerNorm blocks of
`nnx.MultiHeadAttention` and an MLP, and the decoder mask built by Flax's helpers,
`combine_masks(make_attention_mask(tokens > 0, tokens > 0), make_causal_mask(tokens))`.
`attention_zoo.interop.swap_attention` replaces its attention layers in place, so each
variant runs on a copy (`nnx.clone`) with the same weights. For each model the script times a
forward and backward pass of the next-token loss (median of `--repeats` calls after one
warm-up call) and reads the compiled temporary memory (`memory_analysis()`: activations and
intermediates, parameters and inputs excluded).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from attention_zoo.interop import swap_attention


class DecoderBlock(nnx.Module):
  def __init__(self, emb_dim: int, num_heads: int, mlp_dim: int, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(emb_dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads, emb_dim, decode=False, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(emb_dim, rngs=rngs)
    self.mlp_in = nnx.Linear(emb_dim, mlp_dim, rngs=rngs)
    self.mlp_out = nnx.Linear(mlp_dim, emb_dim, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attention(self.attention_norm(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class Decoder(nnx.Module):
  """tokens [b, n] (0 = padding) -> next-token logits [b, n, vocab_size]."""

  def __init__(self, *, vocab_size: int = 256, max_len: int = 4096, emb_dim: int = 256,
               num_heads: int = 4, mlp_dim: int = 1024, num_layers: int = 2, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab_size, emb_dim, rngs=rngs)
    self.positions = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (max_len, emb_dim)))
    self.blocks = nnx.List([DecoderBlock(emb_dim, num_heads, mlp_dim, rngs=rngs)
                            for _ in range(num_layers)])
    self.norm = nnx.LayerNorm(emb_dim, rngs=rngs)

  def __call__(self, tokens):
    mask = nnx.combine_masks(nnx.make_attention_mask(tokens > 0, tokens > 0),
                             nnx.make_causal_mask(tokens))               # [b, 1, n, n]
    x = self.embed(tokens) + self.positions[:tokens.shape[1]]
    for block in self.blocks:
      x = block(x, mask)
    return self.embed.attend(self.norm(x))


def loss_fn(model, tokens):
  """Next-token cross-entropy over the real tokens."""
  logits = model(tokens)[:, :-1]
  targets = tokens[:, 1:]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  real = targets > 0
  return jnp.sum(losses * real) / jnp.maximum(real.sum(), 1)


def measure(model, tokens, repeats: int):
  """-> (median ms of a forward+backward pass, compiled temporary memory in MB)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)   # rest: e.g. random features

  def grads(params, rest, tokens):
    return jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), tokens))(params)

  compiled = jax.jit(grads).lower(params, rest, tokens).compile()
  memory_mb = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
  jax.block_until_ready(compiled(params, rest, tokens))                  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(params, rest, tokens))
    times.append(time.perf_counter() - start)
  return 1000 * statistics.median(times), memory_mb


# Each row: a name, swap_attention's arguments (None: the model as Flax built it).
VARIANTS = {"flax dot_product_attention": None,
            "full": dict(name="full", causal=True),
            "sliding_window": dict(name="sliding_window", causal=True, window=128),
            "performer": dict(name="performer", causal=True, nb_features=128)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--length", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--num_layers", type=int, default=2)
  parser.add_argument("--emb_dim", type=int, default=256)
  parser.add_argument("--dry_run", action="store_true",
                      help="print what would be measured, then exit without measuring")
  args = parser.parse_args(argv)
  if args.dry_run:
    for label in VARIANTS:
      print(f"{label}: length {args.length}, batch {args.batch}, {args.num_layers} layers, emb "
            f"{args.emb_dim}, {args.repeats} repeats")
    return {}
  model = Decoder(max_len=args.length, emb_dim=args.emb_dim, num_heads=4,
                  mlp_dim=4 * args.emb_dim, num_layers=args.num_layers, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (args.batch, args.length), 1, 256)
  rows = {}
  for label, swap in VARIANTS.items():
    variant = model if swap is None else swap_attention(nnx.clone(model), **swap)
    rows[label] = measure(variant, tokens, args.repeats)
  base_ms, base_mb = rows["flax dot_product_attention"]
  print(f"length {args.length}, batch {args.batch}, {args.num_layers} layers, emb "
        f"{args.emb_dim}, 4 heads; forward+backward, median of {args.repeats}")
  print("| attention | ms | speed-up | temp MB | of Flax's |")
  print("|---|---|---|---|---|")
  for label, (ms, mb) in rows.items():
    print(f"| {label} | {ms:.1f} | {base_ms / ms:.2f}x | {mb:.1f} | {mb / base_mb:.1%} |")
  return rows


if __name__ == "__main__":
  main()

"""A learned projection of the sequence axis (Linformer's E·K): k rows, each a weighted sum over
all n positions, and its context-parallel form.

    project_length(x, weights)[b, r] = Σ_n weights[n, r] · x[b, n]

Under a mesh whose `context` axis splits the sequence (ops/context.py) each device contracts
its own positions with its own rows of `weights` (the slice [i·n/C, (i+1)·n/C), which the
shard_map's in_specs cut from the replicated matrix) and the k partial sums are psummed across
`context`: the k x d result is on every device, no position of x leaves its device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from attention_zoo.ops.context import CONTEXT_AXIS, context_size, sequence_spec


def project_length(x, weights):
  """x [b, n, h, d], weights [h, n, r] -> [b, r, h, d]: the sum over positions, per head."""
  if context_size() == 1:
    return jnp.einsum("bnhd,hnr->brhd", x, weights)
  spec = sequence_spec()

  def shard(x, weights):
    return jax.lax.psum(jnp.einsum("bnhd,hnr->brhd", x, weights), CONTEXT_AXIS)

  return jax.shard_map(shard, in_specs=(spec, P(None, CONTEXT_AXIS)), out_specs=P(spec[0]))(
      x, weights)

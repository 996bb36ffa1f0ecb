"""Normalisations of the sequence mixers: the (gated) RMSNorm of their outputs and the L2
normalisation of their queries and keys."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def l2_normalise(x, eps: float = 1e-6):
  """x / sqrt(Σ x² + eps) over the last axis, in float32 (an all-zero vector stays zero)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


GATE_ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


class GatedRMSNorm(nnx.Module):
  """RMSNorm over groups of `group_size` channels of the last axis (default: all of them) with
  a learned scale per channel, optionally gated by act(gate), act SiLU (default) or sigmoid
  (`activation="sigmoid"`: KDA's):

      norm_before_gate=True  (fla's FusedRMSNormGated: GLA, DeltaNet, GDN, RetNet, KDA)
                             y = x / rms(x) ⊙ w ⊙ act(gate)
      norm_before_gate=False (Mamba2's RMSNormGated)   y = (x ⊙ act(gate)) / rms(..) ⊙ w

  Computed in float32 whatever the compute dtype (float64 for float64 inputs)."""

  def __init__(self, features: int, *, group_size: int | None = None, eps: float = 1e-5,
               norm_before_gate: bool = True, activation: str = "silu"):
    self.group_size = features if group_size is None else group_size
    if features % self.group_size:
      raise ValueError(f"GatedRMSNorm: group_size {group_size} must divide features {features}")
    if activation not in GATE_ACTIVATIONS:
      raise ValueError(f"GatedRMSNorm: activation must be one of {sorted(GATE_ACTIVATIONS)}, "
                       f"got {activation!r}")
    self.eps, self.norm_before_gate, self.activation = eps, norm_before_gate, activation
    self.scale = nnx.Param(jnp.ones((features,)))

  def __call__(self, x, gate=None):
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if gate is not None:
      gate = GATE_ACTIVATIONS[self.activation](gate.astype(x.dtype))
    if gate is not None and not self.norm_before_gate:
      x = x * gate
    groups = x.reshape(*x.shape[:-1], -1, self.group_size)                 # [..., G, group]
    rms = jax.lax.rsqrt(jnp.mean(groups * groups, axis=-1, keepdims=True) + self.eps)
    y = (groups * rms).reshape(x.shape) * self.scale[...]
    return y * gate if gate is not None and self.norm_before_gate else y

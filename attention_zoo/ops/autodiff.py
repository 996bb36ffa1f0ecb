"""Which differentiations are tracing a call, for the paths whose backward is a custom VJP.

JAX refuses forward-mode autodiff (jax.jvp, jax.jacfwd) through a `jax.custom_vjp` function, the
memory-linear backward of the dense path (softmax.py) and of the block-mask engine (flex.py).
When forward mode is the innermost differentiation at the call they run the same forward as
plain JAX instead, which JAX differentiates forward at the forward's memory; under reverse mode
(also inside a forward one: Hessian-vector products, jax.hessian) they keep the custom VJP.
"""
from __future__ import annotations

# JAX internals (jax 0.10), read only here; tests/testing/test_forward_mode.py checks autodiff_modes
# against each transformation, so a JAX that moves them fails there.
from jax._src import core as jax_core
from jax._src.interpreters import ad as jax_ad
from jax._src.interpreters import batching as jax_batching


def autodiff_modes() -> tuple[str, ...]:
  """The differentiations tracing the current call, innermost first: "forward" for jax.jvp (and
  jacfwd, the outer half of jax.hessian), "reverse" for jax.grad, vjp and linearize (jacrev).
  vmap is looked through. A jax.jit, jax.checkpoint or lax control flow between the
  differentiation and the call ends the list: it traces the call into a program first (which jit
  caches and reuses under any transformation), so the call cannot know what will differentiate
  it."""
  modes = []
  trace = jax_core.unsafe_get_current_trace()
  while True:
    if isinstance(trace, jax_ad.JVPTrace):
      modes.append("forward")
    elif isinstance(trace, jax_ad.LinearizeTrace):
      modes.append("reverse")
    elif not isinstance(trace, jax_batching.BatchTrace):
      return tuple(modes)
    trace = trace.parent_trace

"""The flash mode: the FlashAttention kernels (attention_zoo.ops.flash: Pallas on a GPU or TPU,
the chunked pure-JAX path) against cuDNN and XLA, after a correctness check.

Implementations (--impls):
  pallas   attention_zoo.ops.flash's kernels: Triton on a GPU, Mosaic on a TPU; on a CPU only with
           --interpret (the GPU kernels interpreted: a correctness run, its times mean nothing)
  cudnn    jax.nn.dot_product_attention(implementation="cudnn", is_causal=...) (GPU only)
  xla      the `full` variant's dense XLA path (reference.masked_softmax_attention)
  chunked  attention_zoo.ops.flash's pure-JAX path
Shapes follow the FlashAttention papers: batch = --tokens / length, heads = --hidden / head_dim
(16k tokens, hidden 2048), unless --batch_size / --num_heads are given. FLOPs = 4·b·h·n²·d,
halved for causal; backward = 2.5 × forward, so forward+backward = 3.5 × forward. Times are
medians of --repeats calls after one warm-up call of the ahead-of-time compiled program; "temp"
is the compiled program's temp memory (memory_analysis). Before timing, --verify checks the
pallas (and chunked) outputs and gradients against reference.dense_attention in f32 on small
shapes with padding, GQA, cross-attention, ALiBi and a head_dim that is not a power of two.
The table (benchmark_flash.md) is rewritten after every row, so a run stopped by a time limit
keeps what it measured; --time_budget_s stops starting new rows once that much time has passed.
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from attention_zoo import reference
from attention_zoo.ops.flash import chunked, pallas_gpu, pallas_tpu
from experiments.benchmark.attention import attention_flops
from experiments.benchmark.settings import lengths_text
from experiments.common import device, dry_run
from experiments.common.command_line import integers
from experiments.common.errors import HarnessError, first_line
from experiments.common.records import write_text

IMPL_NAMES = {"pallas": "flash (pallas)", "cudnn": "cuDNN", "xla": "XLA (full)",
              "chunked": "flash (chunked)"}


def attention_fn(impl: str, causal: bool, scale: float, interpret: bool):
  """(q, k, v) -> out for one implementation, or a string saying why it cannot run here.
  interpret: run the GPU Pallas kernels interpreted (on a CPU)."""
  backend = jax.default_backend()
  if impl == "pallas":
    if backend == "tpu":
      kernels, extra = pallas_tpu, {}
    elif backend == "gpu" or interpret:
      kernels, extra = pallas_gpu, {"interpret": interpret}
    else:
      return "n/a on CPU without --interpret"

    def run(q, k, v):
      kv_mask = jnp.ones(k.shape[:2], bool)
      return kernels.flash_attention(q, k, v, kv_mask, causal=causal, scale=scale, **extra)
    return run
  if impl == "chunked":
    return lambda q, k, v: chunked.flash_attention(q, k, v, jnp.ones(k.shape[:2], bool),
                                                   causal=causal, scale=scale)
  if impl == "xla":
    return lambda q, k, v: reference.masked_softmax_attention(q, k, v, causal=causal, scale=scale)
  if impl == "cudnn":
    if backend != "gpu":
      return f"n/a on {backend.upper()}"
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                        implementation="cudnn")
  raise HarnessError(f"unknown impl {impl!r}; choose from {', '.join(IMPL_NAMES)}")


def forward_backward(fn):
  def run(q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(d_out)
  return run


def time_program(fn, args, repeats: int):
  """(median ms, temp bytes) of an ahead-of-time compiled fn(*args), after one warm-up call."""
  compiled = jax.jit(fn).lower(*args).compile()
  memory = device.compiled_memory(compiled)
  return 1e3 * device.median_call_s(compiled, *args, repeats=repeats), memory and memory.temp_bytes


def short_error(error: BaseException) -> str:
  if device.is_out_of_memory(error):
    return "OOM"
  return f"{type(error).__name__}: {first_line(error, 80)}".replace("|", "/")


# -- correctness on this device ------------------------------------------------------------------

VERIFY_CASES = (  # (batch, q_len, kv_len, heads, kv_heads, head_dim, causal, alibi, padding, dtype)
    (2, 200, 200, 8, 2, 64, False, False, True, "float32"),
    (2, 130, 333, 8, 2, 80, True, True, True, "float32"),
    (1, 257, 129, 4, 1, 128, True, False, True, "float32"),
    (2, 300, 300, 8, 8, 128, True, False, True, "bfloat16"),
)


def verify_rows(impls, interpret: bool) -> list[str]:
  rows = []
  for case in VERIFY_CASES:
    batch, q_len, kv_len, heads, kv_heads, head_dim, causal, alibi, padding, dtype = case
    keys = jax.random.split(jax.random.key(q_len + kv_len), 4)
    q = jax.random.normal(keys[0], (batch, q_len, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, kv_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, kv_len, kv_heads, head_dim), dtype)
    d_out = jax.random.normal(keys[3], q.shape, dtype)
    kv_mask = np.ones((batch, kv_len), bool)
    if padding:
      kv_mask[-1, kv_len // 2:] = False
    kv_mask = jnp.asarray(kv_mask)
    slopes = jnp.linspace(0.5, 0.01, heads) if alibi else None
    scale = head_dim ** -0.5
    allowed = kv_mask[:, None, None, :]
    q_pos, k_pos = jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None]
    if causal:
      allowed = allowed & reference.causal_allowed(q_pos, k_pos, q_len, kv_len)
    bias = None if not alibi else reference.alibi_bias(slopes, q_pos, k_pos, q_len, kv_len)[None]
    oracle = lambda q, k, v: reference.dense_attention(q, k, v, allowed, scale=scale, bias=bias)
    expected = jax.jit(forward_backward(oracle))(*(x.astype(jnp.float32) for x in (q, k, v, d_out)))
    for impl in impls:
      if impl == "pallas":
        fn = attention_fn("pallas", causal, scale, interpret)
        if isinstance(fn, str):
          continue
        kernels = pallas_tpu if jax.default_backend() == "tpu" else pallas_gpu
        extra = {} if kernels is pallas_tpu else {"interpret": interpret}
        fn = lambda q, k, v: kernels.flash_attention(q, k, v, kv_mask, slopes, causal=causal,
                                                     scale=scale, **extra)
      elif impl == "chunked":
        fn = lambda q, k, v: chunked.flash_attention(q, k, v, kv_mask, slopes, causal=causal,
                                                     scale=scale)
      else:
        continue
      try:
        got = jax.jit(forward_backward(fn))(q, k, v, d_out)
        errors = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))
                        / max(1.0, float(jnp.max(jnp.abs(b)))))
                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected))]
        cells = [f"{e:.1e}" for e in errors]
      except Exception as error:  # a failure is a result to report, not a reason to stop
        cells = [short_error(error)] + [""] * 3
      rows.append(f"| {IMPL_NAMES[impl]} | {batch}×{q_len}×{kv_len} | {heads}/{kv_heads} | "
                  f"{head_dim} | {'yes' if causal else 'no'} | {'yes' if alibi else 'no'} | "
                  f"{dtype} | " + " | ".join(cells) + " |")
      print(rows[-1], flush=True)
  return rows


# -- the table ---------------------------------------------------------------------------------

def write(path: str, header: str, verify: list[str], rows: list[str]):
  lines = [header, ""]
  if verify:
    lines += ["Correctness against reference.dense_attention (f32 oracle), "
              "max |error| / max(1, max |oracle|):", "",
              "| impl | b×q×kv | heads/kv | d | causal | ALiBi | dtype | out | dq | dk | dv |",
              "|---|---|---|---|---|---|---|---|---|---|---|", *verify, ""]
  lines += ["| impl | n | d | causal | b×h | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
            "| temp MiB fwd+bwd |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
  write_text(path, "\n".join(lines))



def flash_table(path: str, *, lengths, head_dims, masks, impls, dtype: str, tokens: int,
                hidden: int, batch_size: int | None, num_heads: int | None,
                num_kv_heads: int | None, repeats: int, interpret: bool, verify: bool,
                budget_s: float, command: str) -> None:
  """Verifies (with `verify`), then times every implementation at every shape, rewriting the
  markdown table at `path` after every row."""
  start = time.perf_counter()
  header = (f"# FlashAttention benchmark\n\n{jax.devices()[0].device_kind} "
            f"({jax.default_backend()}), jax {jax.__version__}, {dtype}, median of {repeats} "
            f"calls; command: `{command}`"
            + ("\n\nPallas kernels INTERPRETED: their times measure the interpreter, not the "
               "kernels." if interpret else ""))
  checked = verify_rows(impls, interpret) if verify else []
  rows = []
  write(path, header, checked, rows)
  for head_dim in head_dims:
    for length in lengths:
      for mask in masks:
        causal = mask == "causal"
        batch = batch_size or max(1, tokens // length)
        heads = num_heads or max(1, hidden // head_dim)
        kv_heads = num_kv_heads or heads
        keys = jax.random.split(jax.random.key(length + head_dim), 4)
        q = jax.random.normal(keys[0], (batch, length, heads, head_dim), dtype)
        k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), dtype)
        v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), dtype)
        d_out = jax.random.normal(keys[3], q.shape, dtype)
        for impl in impls:
          fn = attention_fn(impl, causal, head_dim ** -0.5, interpret)
          if isinstance(fn, str):
            cells = [fn, "", "", "", ""]
          elif time.perf_counter() - start > budget_s:
            cells = [f"skipped (over --time_budget_s={budget_s:g})", "", "", "", ""]
          else:
            cells = []
            for name, program, args, backward in (("fwd", fn, (q, k, v), False),
                                                  ("fwd+bwd", forward_backward(fn),
                                                   (q, k, v, d_out), True)):
              work = attention_flops(batch, heads, length, head_dim, causal=causal,
                                     backward=backward)
              try:
                ms, temp = time_program(program, args, repeats)
                cells += [f"{ms:.3f}", f"{work / ms / 1e9:.3g}"]
                if backward:
                  cells.append("" if temp is None else f"{temp / 2 ** 20:.1f}")
              except Exception as error:  # OOM or an unsupported shape: report it, go on
                cells += [short_error(error), ""] + ([""] if backward else [])
          rows.append(f"| {IMPL_NAMES[impl]} | {length} | {head_dim} | "
                      f"{'yes' if causal else 'no'} | "
                      f"{batch}×{heads} | " + " | ".join(cells) + " |")
          print(rows[-1], flush=True)
          write(path, header, checked, rows)


def run_mode(values, command: str) -> int:
  """`--mode=flash` from the parsed flags (the mode's defaults filled in)."""
  lengths, head_dims = integers(values.lengths, "lengths"), integers(values.head_dims, "head_dims")
  path = os.path.join(values.out, "benchmark_flash.md")
  dry_run.plan(lambda: [f"flash {impl}: lengths {lengths_text(lengths)}, head_dims "
                        f"{lengths_text(head_dims)}, masks {','.join(values.masks)}, "
                        f"{values.dtype}, interpret {values.interpret}" for impl in values.impls]
               + [f"then {path} (budget {values.time_budget_s:g} s)"])
  flash_table(path, lengths=lengths, head_dims=head_dims, masks=values.masks, impls=values.impls,
              dtype=values.dtype, tokens=values.tokens, hidden=values.hidden,
              batch_size=values.batch_size, num_heads=values.num_heads,
              num_kv_heads=values.num_kv_heads, repeats=values.repeats,
              interpret=values.interpret, verify=values.verify, budget_s=values.time_budget_s,
              command=command)
  print(f"wrote {path}")
  return 0

"""FlashAttention speed: our Pallas kernels against cuDNN and XLA (and the chunked JAX path).

    python -m experiments.flash_bench --out=results/flash_bench.md                 # on a GPU
    python -m experiments.flash_bench --lengths=128,256 --interpret --out=/tmp/fb.md   # on a CPU
    python -m experiments.flash_bench --impls=chunked,xla --lengths=4096 --dtype=float32 \
        --batch=1 --num_heads=8 --head_dims=64 --masks=none --out=/tmp/cpu.md       # CPU target

Implementations (--impls):
  pallas   attention_zoo.flash's kernels: Triton on a GPU, Mosaic on a TPU; on a CPU only with
           --interpret (the GPU kernels interpreted: a correctness run, its times mean nothing)
  cudnn    jax.nn.dot_product_attention(implementation="cudnn", is_causal=...) (GPU only)
  xla      the `full` variant's dense XLA path (reference.masked_softmax_attention)
  chunked  attention_zoo.flash's pure-JAX path
Shapes follow the FlashAttention papers: batch = --tokens / length, heads = --hidden / head_dim
(16k tokens, hidden 2048), unless --batch / --num_heads are given. FLOPs = 4·b·h·n²·d, halved
for causal; backward = 2.5 × forward, so forward+backward = 3.5 × forward. Times are medians of
--repeats calls after one warm-up call of the ahead-of-time compiled program; "temp" is the
compiled program's temp memory (memory_analysis). Before timing, --verify checks the pallas (and
chunked) outputs and gradients against reference.dense_attention in f32 on small shapes with
padding, GQA, cross-attention, ALiBi and a head_dim that is not a power of two.

The markdown table is rewritten after every row, so a run stopped by a time limit keeps what it
measured; --budget_s stops starting new rows once that much time has passed. On any machine
with an NVIDIA GPU and a CUDA build of jax (`pip install -U "jax[cuda12]"`, then this
repository), a run that stops starting rows after 7.5 minutes:
    PYTHONUNBUFFERED=1 python -m experiments.flash_bench --out=results/flash_bench.md --budget_s=450
"""
from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from attention_zoo import reference
from attention_zoo.flash import chunked, pallas_gpu, pallas_tpu
from experiments import cli, provenance
from experiments.flops import attention_flops, median_call_s
from experiments.memory import compiled_memory, is_out_of_memory

FLAGS = flags.FLAGS

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
  raise cli.HarnessError(f"unknown impl {impl!r}; choose from {', '.join(IMPL_NAMES)}")


def forward_backward(fn):
  def run(q, k, v, d_out):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(d_out)
  return run


def measure(fn, args, repeats: int):
  """(median ms, temp bytes) of an ahead-of-time compiled fn(*args), after one warm-up call."""
  compiled = jax.jit(fn).lower(*args).compile()
  memory = compiled_memory(compiled)
  return 1e3 * median_call_s(compiled, *args, repeats=repeats), memory and memory.temp_bytes


def short_error(error: BaseException) -> str:
  text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  if is_out_of_memory(error):
    return "OOM"
  return f"{type(error).__name__}: {text[:80]}".replace("|", "/")


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
  provenance.write_text(path, "\n".join(lines))


def main(argv):
  del argv
  start = time.perf_counter()
  dtype = jnp.dtype(FLAGS.dtype)
  device = jax.devices()[0]
  header = (f"# FlashAttention benchmark\n\n{device.device_kind} ({jax.default_backend()}), "
            f"jax {jax.__version__}, "
            f"{FLAGS.dtype}, median of {FLAGS.repeats} calls; command: `{' '.join(sys.argv)}`"
            + ("\n\nPallas kernels INTERPRETED: their times measure the interpreter, not the "
               "kernels."
               if FLAGS.interpret else ""))
  verify = verify_rows(FLAGS.impls, FLAGS.interpret) if FLAGS.verify else []
  rows = []
  write(FLAGS.out, header, verify, rows)
  for head_dim in map(int, FLAGS.head_dims):
    for length in map(int, FLAGS.lengths):
      for mask in FLAGS.masks:
        causal = mask == "causal"
        batch = FLAGS.batch or max(1, FLAGS.tokens // length)
        heads = FLAGS.num_heads or max(1, FLAGS.hidden // head_dim)
        kv_heads = FLAGS.num_kv_heads or heads
        flops = attention_flops(batch, heads, length, head_dim, causal=causal, backward=False)
        keys = jax.random.split(jax.random.key(length + head_dim), 4)
        q = jax.random.normal(keys[0], (batch, length, heads, head_dim), dtype)
        k = jax.random.normal(keys[1], (batch, length, kv_heads, head_dim), dtype)
        v = jax.random.normal(keys[2], (batch, length, kv_heads, head_dim), dtype)
        d_out = jax.random.normal(keys[3], q.shape, dtype)
        for impl in FLAGS.impls:
          cells = []
          fn = attention_fn(impl, causal, head_dim ** -0.5, FLAGS.interpret)
          if isinstance(fn, str):
            cells = [fn, "", "", "", ""]
          elif time.perf_counter() - start > FLAGS.budget_s:
            cells = [f"skipped (over --budget_s={FLAGS.budget_s:g})", "", "", "", ""]
          else:
            for name, program, args, work in (
                ("fwd", fn, (q, k, v), flops),
                ("fwd+bwd", forward_backward(fn), (q, k, v, d_out),
                 attention_flops(batch, heads, length, head_dim, causal=causal, backward=True))):
              try:
                ms, temp = measure(program, args, FLAGS.repeats)
                cells += [f"{ms:.3f}", f"{work / ms / 1e9:.3g}"]
                if name == "fwd+bwd":
                  cells.append("" if temp is None else f"{temp / 2 ** 20:.1f}")
              except Exception as error:  # OOM or an unsupported shape: report it, go on
                cells += [short_error(error), ""] + ([""] if name == "fwd+bwd" else [])
          rows.append(f"| {IMPL_NAMES[impl]} | {length} | {head_dim} | "
                      f"{'yes' if causal else 'no'} | "
                      f"{batch}×{heads} | " + " | ".join(cells) + " |")
          print(rows[-1], flush=True)
          write(FLAGS.out, header, verify, rows)
  print(f"wrote {FLAGS.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  flags.DEFINE_list("lengths", ["1024", "2048", "4096", "8192", "16384"], "sequence lengths")
  flags.DEFINE_list("head_dims", ["64", "128"], "head dimensions")
  flags.DEFINE_list("masks", ["none", "causal"], "none and/or causal")
  flags.DEFINE_list("impls", ["pallas", "cudnn", "xla"], "pallas, cudnn, xla, chunked")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "input dtype")
  flags.DEFINE_integer("tokens", 16384, "batch · length when --batch is 0")
  flags.DEFINE_integer("hidden", 2048, "heads · head_dim when --num_heads is 0")
  flags.DEFINE_integer("batch", 0, "batch size (0: --tokens / length)")
  flags.DEFINE_integer("num_heads", 0, "query heads (0: --hidden / head_dim)")
  flags.DEFINE_integer("num_kv_heads", 0, "kv heads (0: as many as query heads)")
  flags.DEFINE_integer("repeats", 10, "timed calls per measurement (median reported)")
  flags.DEFINE_bool("interpret", False, "run the pallas kernels interpreted (needed on a CPU)")
  flags.DEFINE_bool("verify", True, "check pallas/chunked against the dense oracle before timing")
  flags.DEFINE_float("budget_s", 420.0, "start no new row after this many seconds")
  flags.DEFINE_string("out", "results/flash_bench.md", "markdown file to write")
  cli.run(main)

r"""The benchmark's modes that take one kernel alone (`python -m experiments.benchmark --mode=...`):

ops            the linear-recurrence ops of attention_zoo.ops, forward+backward, against causal
               `full` attention and against the gated delta rule's token-by-token form
flash          the FlashAttention kernels (attention_zoo.ops.flash: Pallas on a GPU or TPU, the
               chunked pure-JAX path) against cuDNN and XLA, after a correctness check
approximation  how far each approximate variant is from the exact attention it stands for

ops. At each length: batch 1, 4 heads, K = V = 64, float32, the gradients of Σ o with respect to
every input (q, k, v, and g and beta where the op takes them), in one process so that the
ratios share the machine's state. Each program is compiled first (its temporary memory from
XLA), then timed by measure.time_calls (median of --repeats calls after --warmup) under
--time_budget_s. Writes benchmark_ops.csv and .md.

flash. Implementations (--impls):
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

approximation. For random q, k ~ N(0, std²) and v ~ N(0, 1) ([batch, length, heads,
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

import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import attention_zoo as az
from attention_zoo import ops, reference
from attention_zoo.ops.flash import chunked, pallas_gpu, pallas_tpu
from experiments import benchmark_output, cli, measure, provenance
from experiments.workloads import Status, attention_flops, length_label

# -- ops ----------------------------------------------------------------------------------------

BATCH, HEADS, HEAD_DIM = 1, 4, 64
BASELINE = "full (causal)"
# name -> (function, its inputs after q, k, v)
OPS = {"chunk_gated_delta_rule": (ops.chunk_gated_delta_rule, ("g", "beta")),
       "recurrent_gated_delta_rule": (ops.recurrent_gated_delta_rule, ("g", "beta")),
       "chunk_delta_rule": (ops.chunk_delta_rule, ("beta",)),
       "chunk_simple_gla": (ops.chunk_simple_gla, ("g",)),
       "chunk_gla": (ops.chunk_gla, ("g_channel",))}
COLUMNS = ("op", "length", "status", "note", "fwd_bwd_ms", "speedup_vs_full",
           "speedup_vs_recurrent", "first_call_ms", "temp_bytes", "device", "jax_version",
           "xla_flags", "date")


def inputs(length: int) -> dict[str, jax.Array]:
  """Random inputs as a layer would give them: unit-norm keys, log-sigmoid gates, beta in
  (0, 1)."""
  keys = jax.random.split(jax.random.key(0), 6)
  shape = (BATCH, length, HEADS, HEAD_DIM)
  k = jax.random.normal(keys[1], shape)
  return {"q": jax.random.normal(keys[0], shape),
          "k": k / jnp.linalg.norm(k, axis=-1, keepdims=True),
          "v": jax.random.normal(keys[2], shape),
          "g": jax.nn.log_sigmoid(jax.random.normal(keys[3], shape[:3]) + 2),
          "g_channel": jax.nn.log_sigmoid(jax.random.normal(keys[4], shape) + 2),
          "beta": jax.nn.sigmoid(jax.random.normal(keys[5], shape[:3]))}


def program(name: str):
  """-> (forward+backward of `name` as a function of the inputs dict, the input names)."""
  if name == BASELINE:
    attention = az.create("full", num_heads=HEADS, head_dim=HEAD_DIM, causal=True,
                          rngs=nnx.Rngs(0))
    return lambda q, k, v: attention(q, k, v), ("q", "k", "v")
  fn, extra = OPS[name]
  return lambda *args: fn(*args)[0], ("q", "k", "v", *extra)


def measure_one(name: str, length: int, *, warmup: int, repeats: int, budget_s: float) -> dict:
  row = {"op": name, "length": length, "status": Status.OK, "note": ""}
  fn, names = program(name)
  loss = lambda *args: jnp.sum(fn(*args))
  fwd_bwd = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))
  args = [inputs(length)[key] for key in names]
  try:
    compiled = fwd_bwd.lower(*args).compile()
    row["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
    calls = types.SimpleNamespace(step=lambda _, compiled, args: (compiled(*args), args))
    row["fwd_bwd_ms"], row["first_call_ms"], _ = measure.time_calls(
        calls, "fwd_bwd", compiled, args, warmup=warmup, repeats=repeats, budget_s=budget_s)
  except measure.OverBudget as error:
    row.update(status=Status.OVER_TIME_BUDGET, note=str(error))
  return row


def run(lengths, *, warmup: int, repeats: int, budget_s: float, progress=None) -> list[dict]:
  """Every op (and the baseline) at every length, with speed-ups against full attention and
  against recurrent_gated_delta_rule at the same length."""
  env = measure.run_environment()
  rows = []
  for length in sorted(lengths):
    for name in (BASELINE, *OPS):
      rows.append({**measure_one(name, length, warmup=warmup, repeats=repeats,
                                 budget_s=budget_s), **env})
      if progress:
        progress(rows[-1])
  for row in rows:
    same = {r["op"]: r.get("fwd_bwd_ms") for r in rows if r["length"] == row["length"]}
    mine = row.get("fwd_bwd_ms")
    for key, base in (("speedup_vs_full", BASELINE),
                      ("speedup_vs_recurrent", "recurrent_gated_delta_rule")):
      row[key] = same[base] / mine if mine and same.get(base) else None
  return rows


def markdown(rows: list[dict], *, command: str, warmup: int, repeats: int) -> str:
  env = rows[0]
  lengths = sorted({r["length"] for r in rows})
  by_key = {(r["op"], r["length"]): r for r in rows}
  cell = lambda r: (f"{r['fwd_bwd_ms']:.1f} ms ({r['speedup_vs_full']:.2f}x)"
                    if r.get("fwd_bwd_ms") else r["status"].label)
  header = ["op"] + [length_label(n) for n in lengths]
  lines = ["# Linear-recurrence ops: forward+backward", "",
           f"- Device: {env['device']}; jax {env['jax_version']}; {env['date']}",
           f"- Batch {BATCH}, {HEADS} heads, K = V = {HEAD_DIM}, float32; gradients of Σ o "
           "with respect to every input.",
           f"- Times: median of {repeats} calls after {warmup} warm-up call(s); (Nx) = speed-up "
           f"vs `{BASELINE}` (az.create('full', causal=True)) in the same process.",
           f"- Command: `{command}`", "",
           benchmark_output.table_row(header), benchmark_output.table_row(["---"] * len(header))]
  names = list(dict.fromkeys(r["op"] for r in rows))
  lines += [benchmark_output.table_row([name] + [cell(by_key[(name, n)]) for n in lengths])
            for name in names]
  lines += ["", "chunk_gated_delta_rule vs recurrent_gated_delta_rule: " + ", ".join(
      f"{length_label(n)} {by_key[('chunk_gated_delta_rule', n)]['speedup_vs_recurrent']:.2f}x"
      for n in lengths if by_key[("chunk_gated_delta_rule", n)].get("speedup_vs_recurrent"))]
  return "\n".join(lines) + "\n"


def run_and_write(lengths, out: str, *, warmup: int, repeats: int, budget_s: float,
                  command: str, progress=None) -> list[dict]:
  rows = run(lengths, warmup=warmup, repeats=repeats, budget_s=budget_s, progress=progress)
  paths = benchmark_output.output_paths(out, "ops")
  benchmark_output.write_csv(rows, paths["csv"], COLUMNS)
  provenance.write_text(paths["markdown"], markdown(rows, command=command, warmup=warmup,
                                                    repeats=repeats))
  return rows


# -- flash ------------------------------------------------------------------------------------

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


def time_program(fn, args, repeats: int):
  """(median ms, temp bytes) of an ahead-of-time compiled fn(*args), after one warm-up call."""
  compiled = jax.jit(fn).lower(*args).compile()
  memory = measure.compiled_memory(compiled)
  return 1e3 * measure.median_call_s(compiled, *args, repeats=repeats), memory and memory.temp_bytes


def short_error(error: BaseException) -> str:
  if measure.is_out_of_memory(error):
    return "OOM"
  return f"{type(error).__name__}: {cli.first_line(error, 80)}".replace("|", "/")


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


# -- approximation ----------------------------------------------------------------------------

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
  if causal:
    names = [n for n in names if az.spec(n).supports_causal]
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

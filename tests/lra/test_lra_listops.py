"""The ListOps generator, checked by an evaluator written here, and the fixed vocabulary."""
import os
import shutil
import statistics
import subprocess
import sys

import numpy as np
import pytest

import lra
from lra import listops

SIZES = dict(num_train=40, num_val=5, num_test=5)


def read_rows(path):
  lines = path.read_text(encoding="utf-8").splitlines()
  assert lines[0] == "Source\tTarget"
  return [tuple(line.split("\t")) for line in lines[1:]]


def parse(tokens, i=0):
  """Parse a prefix expression (parens removed) from tokens[i]; returns (tree, next index).
  A tree is a digit (int) or (operator, [subtrees])."""
  token = tokens[i]
  if token.isdigit():
    return int(token), i + 1
  assert token in ("[MIN", "[MAX", "[MED", "[SM"), token
  args, i = [], i + 1
  while tokens[i] != "]":
    arg, i = parse(tokens, i)
    args.append(arg)
  return (token, args), i + 1


def evaluate(tree):
  if isinstance(tree, int):
    return tree
  op, args = tree
  values = [evaluate(a) for a in args]
  return {"[MIN": min, "[MAX": max, "[SM": lambda v: sum(v) % 10,
          "[MED": lambda v: int(statistics.median(v))}[op](values)


def wrap(tree):
  """The official Source text of a tree: ((op a1) a2) ... ]) with a paren pair per pair."""
  if isinstance(tree, int):
    return str(tree)
  op, args = tree
  text = f"( {op} {wrap(args[0])} )"
  for arg in args[1:]:
    text = f"( {text} {wrap(arg)} )"
  return f"( {text} ] )"


def walk(tree, depth=1):
  """Yield ("leaf", depth) for each digit and ("op", number of arguments) for each operator."""
  if isinstance(tree, int):
    yield "leaf", depth
    return
  yield "op", len(tree[1])
  for arg in tree[1]:
    yield from walk(arg, depth + 1)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
  out = tmp_path_factory.mktemp("listops")
  lra.generate_listops(out, seed=3, progress=False, **SIZES)
  return out, {split: read_rows(out / "listops-1000" / name)
               for split, name in listops.SPLIT_FILES.items()}


def test_median_follows_int_np_median():
  for values in ([2, 9], [1, 2, 3, 4], [0, 9, 9], [7, 0, 3, 8, 8, 1], [5, 6]):
    assert listops.apply_operator("[MED", values) == int(np.median(values))


def test_generated_answers_format_and_length_rule(generated):
  out, rows = generated
  assert {split: len(r) for split, r in rows.items()} == {"train": 40, "validation": 5,
                                                          "test": 5}
  all_rows = sum(rows.values(), [])
  for source, target in all_rows:
    tokens = source.replace("(", "").replace(")", "").split()
    tree, end = parse(tokens)
    assert end == len(tokens)
    assert int(target) == evaluate(tree)
    assert wrap(tree) == source  # every node wrapped in ( ... ) like the official files
    assert 500 < len(tokens) < 2000  # operators, digits and ], not parens
    nodes = list(walk(tree))
    assert all(depth <= 10 for kind, depth in nodes if kind == "leaf")  # max depth 10
    assert all(2 <= arity <= 10 for kind, arity in nodes if kind == "op")
  assert len({source for source, _ in all_rows}) == len(all_rows)  # unique across splits
  operators = {t for s, _ in all_rows for t in s.split() if t.startswith("[")}
  assert operators == {"[MIN", "[MAX", "[MED", "[SM"}


def test_loaded_generated_data_matches_the_files(generated):
  out, rows = generated
  ds = lra.load("listops", "train", data_dir=out)
  vocab = {token: i for i, token in enumerate(sorted("0123456789") + ["[MAX", "[MED", "[MIN",
                                                                      "[SM", "]"], start=1)}
  for i, (source, target) in enumerate(rows["train"]):
    ids = [vocab[t] for t in source.replace("(", "").replace(")", "").split()]
    assert ds.inputs[i, :len(ids)].tolist() == ids and not ds.inputs[i, len(ids):].any()
    assert ds.masks[i].sum() == len(ids) and ds.targets[i] == int(target)


def test_a_split_cut_at_a_line_boundary_is_refused_by_its_manifest(generated, tmp_path):
  """The manifest says how many rows each split has; a file cut short (after its cache was
  built, too) is an error naming the file and both counts, not a smaller training set."""
  out, rows = generated
  shutil.copytree(out / "listops-1000", tmp_path / "listops-1000")
  assert len(lra.load("listops", "train", data_dir=tmp_path)) == 40   # cached now
  train = tmp_path / "listops-1000" / "basic_train.tsv"
  train.write_text("".join(train.read_text().splitlines(keepends=True)[:1 + 17]))
  with pytest.raises(ValueError, match=(
      rf"^{train} holds 17 train examples, but {tmp_path}/listops-1000/generated.json says the "
      r"generator wrote 40: .*generate it again")):
    lra.load("listops", "train", data_dir=tmp_path)
  assert len(lra.load("listops", "test", data_dir=tmp_path)) == 5     # the other splits load


def test_closing_brackets_false_drops_every_end_token(generated):
  """closing_brackets=False: the pre-2021-03 LRA pipeline's sequence, operators and digits only,
  padded to max_len; cached apart from the default, which keeps them."""
  out, rows = generated
  dropped = lra.load("listops", "validation", data_dir=out, max_len=2048, closing_brackets=False)
  kept = lra.load("listops", "validation", data_dir=out, max_len=2048)
  end = listops.TOKEN_IDS["]"]
  for i, (source, _) in enumerate(rows["validation"]):
    tokens = [t for t in source.replace("(", "").replace(")", "").split() if t != "]"]
    assert dropped.inputs[i, :len(tokens)].tolist() == [listops.TOKEN_IDS[t] for t in tokens]
    assert dropped.masks[i].sum() == len(tokens) and dropped.inputs.shape == (5, 2048)
  assert not (dropped.inputs == end).any() and (kept.inputs == end).any()
  with pytest.raises(ValueError, match="closing_brackets is True or False, for listops only"):
    lra.load("text", "validation", data_dir=out, closing_brackets=False)


def test_statistics_of_a_file(generated):
  """Lengths with and without `]`, the deepest operator nesting, and the answers, against the
  parser and evaluator of this file."""
  out, rows = generated
  stats = listops.statistics(out / "listops-1000" / listops.SPLIT_FILES["train"])
  trees = [parse(source.replace("(", "").replace(")", "").split())[0]
           for source, _ in rows["train"]]
  nesting = lambda tree: 0 if isinstance(tree, int) else 1 + max(map(nesting, tree[1]))
  lengths = [len(source.replace("(", "").replace(")", "").split()) for source, _ in rows["train"]]
  operators = [sum(kind == "op" for kind, _ in walk(tree)) for tree in trees]
  assert stats["examples"] == 40
  assert stats["length"]["p100"] == max(lengths) and stats["length"]["p0"] == min(lengths)
  assert stats["length_without_closing_brackets"]["mean"] == pytest.approx(
      np.mean(np.array(lengths) - operators))
  assert stats["depth"]["p100"] == max(map(nesting, trees))
  assert stats["labels"] == np.bincount([int(t) for _, t in rows["train"]], minlength=10).tolist()


def test_deterministic_for_a_seed_and_any_workers(tmp_path, generated):
  out, rows = generated
  again = lra.generate_listops(tmp_path / "a", seed=3, progress=False, **SIZES)
  parallel = lra.generate_listops(tmp_path / "b", seed=3, workers=2, progress=False, **SIZES)
  other = lra.generate_listops(tmp_path / "c", seed=4, progress=False, **SIZES)
  for name in listops.SPLIT_FILES.values():
    reference = (out / "listops-1000" / name).read_bytes()
    assert (tmp_path / "a" / "listops-1000" / name).read_bytes() == reference
    assert (tmp_path / "b" / "listops-1000" / name).read_bytes() == reference
    assert (tmp_path / "c" / "listops-1000" / name).read_bytes() != reference
  assert again.endswith("listops-1000") and parallel and other


def test_interrupted_generation_leaves_nothing(tmp_path, monkeypatch):
  real = listops._unique_samples

  def interrupted(*args):
    for i, sample in enumerate(real(*args)):
      if i == 47:  # train and validation done, test half-way
        raise KeyboardInterrupt
      yield sample

  kept = tmp_path / "kept"
  lra.generate_listops(kept, seed=1, progress=False, **SIZES)
  before = {p.name: p.read_bytes() for p in (kept / "listops-1000").iterdir()}
  monkeypatch.setattr(listops, "_unique_samples", interrupted)
  for out in (tmp_path / "new" / "data", kept):
    with pytest.raises(KeyboardInterrupt):
      lra.generate_listops(out, seed=0, progress=False, **SIZES)
  assert [p.name for p in tmp_path.iterdir()] == ["kept"]   # not even the folders it made
  assert {p.name: p.read_bytes() for p in (kept / "listops-1000").iterdir()} == before
  assert [p.name for p in kept.iterdir()] == ["listops-1000"]   # no staging folder left


def test_bad_sizes(tmp_path):
  with pytest.raises(ValueError, match="num_val must be an integer >= 0"):
    lra.generate_listops(tmp_path, num_train=5, num_val=-1, num_test=1, progress=False)
  with pytest.raises(ValueError, match="workers"):
    lra.generate_listops(tmp_path, num_train=5, num_val=1, num_test=1, workers=0)


LIST_IDS = ("import lra, sys; ds = lra.load('listops', 'train', data_dir=sys.argv[1], "
            "cache=False); print(lra.listops.VOCAB); print(ds.inputs[:, :50].tolist())")


def test_cli_and_vocabulary_identical_across_hash_seeds(tmp_path):
  cli = subprocess.run([sys.executable, "-m", "lra.generate", "listops", "--out",
                        str(tmp_path), "--num_train", "3", "--num_val", "1", "--num_test", "1",
                        "--seed", "7", "--noprogress"], capture_output=True, text=True)
  assert cli.returncode == 0, cli.stderr
  assert str(tmp_path / "listops-1000") in cli.stdout
  outputs = []
  for hash_seed in ("1", "2"):
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    run = subprocess.run([sys.executable, "-c", LIST_IDS, str(tmp_path)], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    outputs.append(run.stdout)
  assert outputs[0] == outputs[1]
  assert outputs[0].splitlines()[0] == str(("<pad>",) + tuple("0123456789")
                                           + ("[MAX", "[MED", "[MIN", "[SM", "]"))


def test_cli_usage_errors(tmp_path):
  run = subprocess.run([sys.executable, "-m", "lra.generate", "listops", "--out",
                        str(tmp_path), "--num_train", "-2"], capture_output=True, text=True)
  assert run.returncode == 1 and "num_train must be an integer >= 0" in run.stderr
  run = subprocess.run([sys.executable, "-m", "lra.generate", "pathfinder", "--out",
                        str(tmp_path), "--num", "4", "--resolution", "48"],
                       capture_output=True, text=True)
  assert run.returncode == 1 and "value should be one of <32|64|128|256>" in run.stderr


def test_generate_command_writes_the_official_layout_and_refuses_bad_input(tmp_path):
  import subprocess
  import sys

  run = lambda *args: subprocess.run([sys.executable, "-m", "lra.generate", *args],
                                     capture_output=True, text=True, timeout=300)
  done = run("listops", f"--out={tmp_path}", "--num_train=3", "--num_val=1", "--num_test=1",
             "--noprogress", "--workers=1")
  assert done.returncode == 0, done.stderr
  assert (tmp_path / "listops-1000" / "basic_train.tsv").exists()
  for args, message in ((["cifar", f"--out={tmp_path}"], "expected one task"),
                        (["pathfinder", f"--out={tmp_path}"], "pathfinder needs --num")):
    failed = run(*args)
    assert failed.returncode == 1 and failed.stderr.strip().startswith(f"error: {message}")

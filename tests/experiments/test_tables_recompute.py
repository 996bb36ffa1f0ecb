"""Every row of the docs' result tables (docs/*.csv) recomputed from the runs archived in
docs/runs/ by the generator that wrote it (experiments.archive --tables); the rows without
archived runs are exactly the ones marked so, and exactly the ones listed here, so that a new
row without its runs fails."""
import csv
import shutil

import pytest

from experiments import archive
from experiments.common.records import PROVENANCE

# The rows whose runs were never archived (issue 49): re-running them (docs/reproducing.md) and
# archiving the runs removes them from here.
NOT_ARCHIVED = {
    "mqar_tuned.csv": {(variant, "mqar") for variant in archive.MQAR_FIRST},
    "state_tracking.csv": {(task, variant, negative) for task in ("parity", "s3", "s5")
                           for variant, negatives in (("full", ("n/a",)), ("mamba2", ("n/a",)),
                                                      ("deltanet", ("False", "True")),
                                                      ("gated_deltanet", ("False", "True")),
                                                      ("kda", ("False", "True")),
                                                      ("gated_deltaproduct", ("False", "True")))
                           for negative in negatives},
    "listops_light.csv": {("reformer",), ("linformer",), ("performer",), ("nystromformer",)},
}


def documented(name, docs=archive.DOCS):
  with (docs / name).open(encoding="utf-8") as f:
    return list(csv.DictReader(f))


def test_every_result_table_of_the_docs_is_recomputed():
  """A docs CSV of test accuracies is a result table: it must have its generator here."""
  results = {path.name for path in archive.DOCS.glob("*.csv")
             if "test_mean" in path.read_text(encoding="utf-8").splitlines()[0].split(",")}
  assert results == set(archive.TABLES)


@pytest.mark.parametrize("name", sorted(archive.TABLES))
def test_every_archived_row_recomputes_from_docs_runs(name):
  assert archive.check_table(name) == []


@pytest.mark.parametrize("name", sorted(archive.TABLES))
def test_the_rows_without_runs_are_exactly_the_ones_marked_so(name):
  table, rows = archive.TABLES[name], documented(name)
  marked = {tuple(row[c] for c in table.key) for row in rows
            if row[archive.RUNS] == archive.NOT_ARCHIVED}
  assert marked == NOT_ARCHIVED.get(name, set())
  # Every row says where it ran; a row not archived may leave commit or jax empty where the
  # page that reports it does not state them.
  assert all(row[column] for row in rows for column in ("device", "date"))
  assert all(row[column] for row in rows if row[archive.RUNS] != archive.NOT_ARCHIVED
             for column in PROVENANCE)


@pytest.fixture
def docs(tmp_path):
  """A docs folder with the light ListOps archive (three runs of `full`) and its table."""
  (tmp_path / "runs").mkdir()
  shutil.copy(archive.DOCS / "runs" / "listops_light.jsonl", tmp_path / "runs")
  shutil.copy(archive.DOCS / "listops_light.csv", tmp_path)
  return tmp_path


def rewrite(docs, edit):
  rows = documented("listops_light.csv", docs)
  edit(rows)
  with (docs / "listops_light.csv").open("w", encoding="utf-8", newline="") as f:
    writer = csv.DictWriter(f, list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)


def test_a_row_other_than_its_runs_or_without_them_is_named(docs):
  assert archive.check_table("listops_light.csv", docs) == []
  def edit(rows):
    rows[0]["test_mean"] = "36.05"                 # full: the runs give 36.04
    rows[1][archive.RUNS] = "listops_light.jsonl"   # reformer: it claims runs it has not
    rows[2][archive.RUNS] = ""                      # linformer: neither an archive nor marked
  rewrite(docs, edit)
  assert archive.check_table("listops_light.csv", docs) == [
      "listops_light.csv, variant=full: the runs give test_mean=36.04 (not 36.05)",
      "listops_light.csv, variant=reformer: listops_light.jsonl holds no runs of it",
      "listops_light.csv, variant=linformer: runs is '', where it should be listops_light.jsonl "
      "or 'not archived'"]
  # Rewriting gives the archived row back from its runs; the others stay as written.
  (docs / "listops_light.csv").write_text(archive.rewritten_table("listops_light.csv", docs))
  assert [row["test_mean"] for row in documented("listops_light.csv", docs)] == [
      "36.04", "22.58", "35.94", "35.43", "36.14"]
  assert len(archive.check_table("listops_light.csv", docs)) == 2


def test_archived_runs_marked_not_archived_or_missing_from_the_table_are_named(docs):
  rewrite(docs, lambda rows: rows[0].update({archive.RUNS: archive.NOT_ARCHIVED}))
  assert archive.check_table("listops_light.csv", docs) == [
      "listops_light.csv, variant=full: marked not archived, but listops_light.jsonl holds its "
      "runs"]
  rewrite(docs, lambda rows: rows.pop(0))
  assert archive.check_table("listops_light.csv", docs) == [
      "listops_light.csv, variant=full: listops_light.jsonl makes this row, the table lacks it"]
  rewrite(docs, lambda rows: [row.pop("jax") for row in rows])
  assert archive.check_table("listops_light.csv", docs)[0].startswith(
      "listops_light.csv: columns ['variant', 'seeds', 'test_mean', 'test_std', 'published', "
      "'source', 'device', 'commit', 'date', 'runs'], where the generator writes")

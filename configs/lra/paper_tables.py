"""The LRA paper's published results (Tay et al. 2021, arXiv:2011.04006), by registry name (the
Transformer is `full`): quoted for comparison, never measured here.

TABLE1: test accuracy (%) per task. Path-X is absent: every model in the paper failed it (FAIL,
    chance level).
NYSTROMFORMER_TABLE1: the Nyströmformer paper's Table 1 (Xiong et al. 2021, arXiv:2102.03902),
    its authors' PyTorch runs of their light protocol (the `light` preset), test accuracy (%) of
    the best-validation model; checked against the authors' rendering of the table
    (mlpen/Nystromformer, img/LRA.png).
TABLE2: the efficiency benchmark on the Text task, batch 32, TPU v3: steps/s and peak memory
    (GB) per length, with the speed-ups as printed in the paper (not recomputed from the
    rounded steps/s).
"""
TASKS = ("listops", "text", "retrieval", "image", "pathfinder")   # the tables' column order


def _by_task(rows: dict) -> dict:
  """{variant: accuracies in TASKS order} -> {variant: {task: accuracy}}."""
  return {name: dict(zip(TASKS, accuracies, strict=True)) for name, accuracies in rows.items()}


TABLE1 = _by_task({
    "full":               (36.37, 64.27, 57.46, 42.44, 71.40),
    "local":              (15.82, 52.98, 53.39, 41.46, 66.63),
    "sparse_transformer": (17.07, 63.58, 59.59, 44.24, 71.71),
    "longformer":         (35.63, 62.85, 56.89, 42.22, 69.71),
    "linformer":          (35.70, 53.94, 52.27, 38.56, 76.34),
    "reformer":           (37.27, 56.10, 53.40, 38.07, 68.50),
    "sinkhorn":           (33.67, 61.20, 53.83, 41.23, 67.45),
    "synthesizer":        (36.99, 61.68, 54.67, 41.61, 69.45),
    "bigbird":            (36.05, 64.02, 59.29, 40.83, 74.87),
    "linear_transformer": (16.13, 65.90, 53.09, 42.34, 75.30),
    "performer":          (18.01, 65.40, 53.82, 42.77, 77.05),
})

NYSTROMFORMER_TABLE1 = _by_task({
    "full":          (37.10, 65.02, 79.35, 38.20, 74.16),
    "reformer":      (19.05, 64.88, 78.64, 43.29, 69.36),
    "linformer":     (37.25, 55.91, 79.37, 37.84, 67.60),
    "performer":     (18.80, 63.81, 78.62, 37.07, 69.87),
    "nystromformer": (37.15, 65.52, 79.56, 41.58, 70.94),
})

TABLE2_LENGTHS = (1024, 2048, 3072, 4096)
TABLE2 = {   # name in the paper, steps/s per length, peak memory (GB) per length
    "full": ("Transformer", (8.1, 4.9, 2.3, 1.4), (0.85, 2.65, 5.51, 9.48)),
    "local": ("Local Attention", (9.2, 8.4, 7.4, 7.4), (0.42, 0.76, 1.06, 1.37)),
    "linformer": ("Linformer", (9.3, 9.1, 8.5, 7.7), (0.37, 0.55, 0.99, 0.99)),
    "reformer": ("Reformer", (4.4, 2.2, 1.5, 1.1), (0.48, 0.99, 1.53, 2.28)),
    "sinkhorn": ("Sinkhorn Trans", (9.1, 7.9, 6.6, 5.3), (0.47, 0.83, 1.13, 1.48)),
    "synthesizer": ("Synthesizer", (8.7, 5.7, 6.6, 1.9), (0.65, 1.98, 4.09, 6.99)),
    "bigbird": ("BigBird", (7.4, 3.9, 2.7, 1.5), (0.77, 1.49, 2.18, 2.88)),
    "linear_transformer": ("Linear Trans.", (9.1, 9.3, 8.6, 7.8), (0.37, 0.57, 0.80, 1.03)),
    "performer": ("Performer", (9.5, 9.4, 8.7, 8.0), (0.37, 0.59, 0.82, 1.06)),
}
TABLE2_SPEEDUPS = {
    "local": (1.1, 1.7, 3.2, 5.3), "linformer": (1.2, 1.9, 3.7, 5.5),
    "reformer": (0.5, 0.4, 0.7, 0.8), "sinkhorn": (1.1, 1.6, 2.9, 3.8),
    "synthesizer": (1.1, 1.2, 2.9, 1.4), "bigbird": (0.9, 0.8, 1.2, 1.1),
    "linear_transformer": (1.1, 1.9, 3.7, 5.6), "performer": (1.2, 1.9, 3.8, 5.7),
}

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
TABLE1 = {
    "full": {"listops": 36.37, "text": 64.27, "retrieval": 57.46, "image": 42.44,
             "pathfinder": 71.40},
    "local": {"listops": 15.82, "text": 52.98, "retrieval": 53.39, "image": 41.46,
              "pathfinder": 66.63},
    "sparse_transformer": {"listops": 17.07, "text": 63.58, "retrieval": 59.59, "image": 44.24,
                           "pathfinder": 71.71},
    "longformer": {"listops": 35.63, "text": 62.85, "retrieval": 56.89, "image": 42.22,
                   "pathfinder": 69.71},
    "linformer": {"listops": 35.70, "text": 53.94, "retrieval": 52.27, "image": 38.56,
                  "pathfinder": 76.34},
    "reformer": {"listops": 37.27, "text": 56.10, "retrieval": 53.40, "image": 38.07,
                 "pathfinder": 68.50},
    "sinkhorn": {"listops": 33.67, "text": 61.20, "retrieval": 53.83, "image": 41.23,
                 "pathfinder": 67.45},
    "synthesizer": {"listops": 36.99, "text": 61.68, "retrieval": 54.67, "image": 41.61,
                    "pathfinder": 69.45},
    "bigbird": {"listops": 36.05, "text": 64.02, "retrieval": 59.29, "image": 40.83,
                "pathfinder": 74.87},
    "linear_transformer": {"listops": 16.13, "text": 65.90, "retrieval": 53.09, "image": 42.34,
                           "pathfinder": 75.30},
    "performer": {"listops": 18.01, "text": 65.40, "retrieval": 53.82, "image": 42.77,
                  "pathfinder": 77.05},
}

NYSTROMFORMER_TABLE1 = {
    "full": {"listops": 37.10, "text": 65.02, "retrieval": 79.35, "image": 38.20,
             "pathfinder": 74.16},
    "reformer": {"listops": 19.05, "text": 64.88, "retrieval": 78.64, "image": 43.29,
                 "pathfinder": 69.36},
    "linformer": {"listops": 37.25, "text": 55.91, "retrieval": 79.37, "image": 37.84,
                  "pathfinder": 67.60},
    "performer": {"listops": 18.80, "text": 63.81, "retrieval": 78.62, "image": 37.07,
                  "pathfinder": 69.87},
    "nystromformer": {"listops": 37.15, "text": 65.52, "retrieval": 79.56, "image": 41.58,
                      "pathfinder": 70.94},
}

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

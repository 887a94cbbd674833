"""The field's reference numbers (average absolute accuracy %, 8 tasks: SUN397, Cars, RESISC45,
EuroSAT, SVHN, GTSRB, MNIST, DTD), shown as labelled guide lines for real pools. Sources are the
papers' own repositories (summarised in shared/papers/anchors-peer-projects.md)."""
from __future__ import annotations

REFERENCE = {
    "ViT-B-32": {
        "source": "task_vectors checkpoints; CART README and AdaMerging logs",
        "pre-trained": 48.0, "fine-tuned": 90.5, "weight_averaging": 65.9, "task_arithmetic": 69.1,
        "ties": 72.4, "cart": 84.7, "adamerging_task": 71.1, "adamerging_layer": 80.1, "adamerging_cart": 85.8,
        # recollections of the TSV and Iso papers, not found in their repositories: flagged
        "tsv_m": 85.9, "iso_c": 86.3,
    },
    "ViT-L-14": {"source": "CART README", "task_arithmetic": 84.5, "cart": 92.6},
}
UNVERIFIED = {("ViT-B-32", "tsv_m"), ("ViT-B-32", "iso_c")}


def guides(architecture: str | None, method: str) -> dict[str, float]:
    """Guide lines for the accuracy plot: pre-trained, fine-tuned and the current method, if known."""
    ref = REFERENCE.get(architecture or "")
    if not ref:
        return {}
    out = {}
    for key in ("pre-trained", "fine-tuned", method):
        if key in ref:
            flag = " (unverified)" if (architecture, key) in UNVERIFIED else ""
            out[f"paper {architecture} 8 tasks: {key}{flag}"] = ref[key] / 100
    return out

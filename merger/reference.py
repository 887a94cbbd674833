"""The field's reference lines for real pools: the pre-trained and fine-tuned averages per
architecture (8 tasks: SUN397, Cars, RESISC45, EuroSAT, SVHN, GTSRB, MNIST, DTD), and each
method's published number, which its registry record carries (``Method.published``). Sources:
the papers' own repositories, each named beside its number."""
from __future__ import annotations

from merger import methods
from merger.methods.registry import CART_README

ENDPOINTS = {"ViT-B-32": {"pre-trained": 48.0, "fine-tuned": 90.5}}
ENDPOINTS_SOURCE = CART_README


def guides(architecture: str | None, method: str) -> dict[str, float]:
    """Guide lines for the accuracy plot: pre-trained, fine-tuned and the current method, if known."""
    if not architecture:
        return {}
    architecture = architecture.removesuffix("-quickgelu")  # OpenAI's weights: the papers' model
    out = {f"paper {architecture} 8 tasks: {k}": v / 100 for k, v in ENDPOINTS.get(architecture, {}).items()}
    m = methods.get(method)
    for p in m.published:
        if p.architecture == architecture:
            flag = "" if p.verified else " (unverified)"
            out[f"paper {architecture} 8 tasks: {m.name}{flag}"] = p.accuracy / 100
    return out

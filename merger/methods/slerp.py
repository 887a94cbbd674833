"""SLERP of two experts: per tensor, spherical interpolation of their task vectors by t."""
from __future__ import annotations

import math


from merger.methods.registry import Method, Paper, Param, register
from merger.pool.task_vectors import TaskVectors

T_PARAM = Param("t", 0.5, 0.0, 1.0, 0.01, label="t (interpolation)",
                help="0: the first expert, 1: the second; in between, along the arc between their task vectors",
                sweep=tuple(round(0.1 * i, 2) for i in range(11)))
DOT_THRESHOLD = 0.9995  # |cos Ω| above this: the arc is nearly a line, interpolate linearly (mergekit's)


def slerp_coefficients(omega: float, t: float) -> tuple[float, float]:
    """(a, b) with slerp = a·τ1 + b·τ2: sin((1 − t)Ω)/sin Ω and sin(tΩ)/sin Ω, or 1 − t and t on a line."""
    if omega == 0.0:  # parallel, antiparallel or a zero task vector (see prepare_slerp)
        return 1.0 - t, t
    return math.sin((1 - t) * omega) / math.sin(omega), math.sin(t * omega) / math.sin(omega)


def prepare_slerp(tv: TaskVectors) -> dict:
    angles = {}
    for k, v in tv.items32():
        a, b = v[0].reshape(-1).double(), v[1].reshape(-1).double()
        na, nb = float(a.norm()), float(b.norm())
        cos = float(a @ b) / (na * nb) if na > 0 and nb > 0 else 1.0  # a zero vector: nothing to turn
        angles[k] = math.acos(cos) if abs(cos) <= DOT_THRESHOLD else 0.0
    return {"tv": tv, "omega": angles}


def apply_slerp(prepared: dict, t: float) -> dict:
    out = {}
    for k, v in prepared["tv"].items32():
        a, b = slerp_coefficients(prepared["omega"][k], t)
        out[k] = a * v[0] + b * v[1]
    return out


def slerp_weights(params, num_experts: int, prepared) -> tuple[list[float], str]:
    t = params.get("t", 0.5)
    pairs = [slerp_coefficients(w, t) for w in prepared["omega"].values()]
    return ([sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs)],
            "the mean over tensors of sin((1 − t)Ω)/sin Ω and sin(tΩ)/sin Ω")


SLERP = register(Method(
    name="slerp",
    display_name="SLERP (two experts)",
    paper=Paper("Animating rotation with quaternion curves (Shoemake, SIGGRAPH 1985): slerp", ""),
    description="Two experts: per tensor, τ = sin((1 − t)Ω)/sin Ω · τ1 + sin(tΩ)/sin Ω · τ2, Ω the angle between "
                "τ1 and τ2; θ0 + τ (t = 0: the first expert, t = 1: the second).",
    params=(T_PARAM,),
    num_experts=2,
    prepare=prepare_slerp,
    apply=apply_slerp,
    tune_grid={"t": tuple(round(0.1 * i, 2) for i in range(11))},
    weights=slerp_weights,
    conventions="Interpolates task vectors around the base (mergekit and FusionBench interpolate the full weights "
                "θ1, θ2); every floating-point tensor of the image tower; linear where the task vectors are "
                "nearly (anti)parallel (|cos Ω| > 0.9995, mergekit's threshold) or one is zero.",
))

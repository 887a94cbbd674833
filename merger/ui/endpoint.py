"""The ``evaluate`` endpoint (Gradio API, gradio_client, HTTP): every slider parameter of the
registry is an argument by its own name, so a new method's parameter is one more argument."""
from __future__ import annotations

import contextlib
import inspect
from typing import Optional

from merger import methods
from merger.errors import MergerError
from merger.methods.registry import param_record, with_param
from merger.ui.compare_tab import SPLITS_SHOWN
from merger.ui.errors import fail

FIXED = ("method", "experts", "split", "task_weights", "block_weights")  # all but the method's parameters
# The first endpoint's parameters, in its positional order (method, lam, rank_ratio, sparsity, seed,
# experts, split); every later one comes after task_weights and block_weights, so no positional call breaks.
FIRST = ("lam", "rank_ratio", "sparsity", "seed")
# The endpoint evaluates the splits the page offers (SPLITS_SHOWN). The live split is a slider
# move's forward (a preview); val and test are Compare's, run as batch work so that they wait for
# the room's slider moves; the train split (31,500 images on the demo, a held model for seconds) is
# the CLI's: `python -m merger eval`.


def endpoint_params() -> list[str]:
    """The endpoint's parameter arguments: every parameter of a method that evaluates live."""
    return [n for n in methods.PARAM_NAMES if with_param(n)]


def _signature() -> tuple[inspect.Signature, dict]:
    P = inspect.Parameter
    hints = {"method": str, "experts": Optional[list[str] | str], "split": str, "return": dict}
    params = [P("method", P.POSITIONAL_OR_KEYWORD, annotation=str)]

    def add(names):
        for name in names:
            kind = param_record(name)[1].kind
            hints[name] = Optional[int | str] if kind == "int" else Optional[float | str]
            params.append(P(name, P.POSITIONAL_OR_KEYWORD, default=None, annotation=hints[name]))

    names = endpoint_params()
    add([n for n in FIRST if n in names])
    params += [P("experts", P.POSITIONAL_OR_KEYWORD, default=None, annotation=hints["experts"]),
               P("split", P.POSITIONAL_OR_KEYWORD, default="live", annotation=str)]
    for name in ("task_weights", "block_weights"):  # {name: weight} or "a=1.2,b=0" (static methods)
        hints[name] = Optional[dict[str, float] | str]
        params.append(P(name, P.POSITIONAL_OR_KEYWORD, default=None, annotation=hints[name]))
    add([n for n in names if n not in FIRST])
    return inspect.Signature(params, return_annotation=dict), hints


def endpoint_data(method: str, **arguments) -> list:
    """The endpoint's arguments as the positional ``data`` list of a plain HTTP call
    (``POST /gradio_api/call/evaluate``), in the signature's order, its defaults where not given."""
    params = list(_signature()[0].parameters.values())
    unknown = set(arguments) - {p.name for p in params}
    if unknown:
        raise ValueError(f"the evaluate endpoint takes no {', '.join(sorted(unknown))}")
    return [method, *[arguments.get(p.name, p.default) for p in params[1:]]]


def evaluate_endpoint(ctl):
    """The endpoint's function for this app: evaluate a spec of a method that evaluates live;
    returns per-task accuracy and loss, averages and normalised accuracy, and the spec."""
    sig, hints = _signature()

    def evaluate(*args, **kwargs) -> dict:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        method, experts, split, task_weights, block_weights = (given.pop(k) for k in FIXED)
        try:
            if split not in SPLITS_SHOWN:
                raise MergerError(f"split {str(split)[:40]!r}: the endpoint evaluates {', '.join(SPLITS_SHOWN)} "
                                  "(other splits: python -m merger eval --split …)")
            if methods.get(method).data_driven:
                raise MergerError(f"{method} learns from data: run it in the Merge tab or with `python -m merger merge`")
            params = {k: v for k, v in given.items() if v is not None and v != ""}
            if experts is not None and not isinstance(experts, str) and len(experts) == 0:
                raise MergerError("experts: empty subset, pick at least one expert")
            names = experts.split(",") if isinstance(experts, str) else (experts or [])
            pool = ctl.pool
            private = [str(e).strip() for e in names if str(e).strip() in pool.expert_info
                       and str(e).strip() not in pool.tasks]
            if private:
                raise MergerError(f"experts: {', '.join(private)} belong(s) to a browser session's expert lab; the "
                                  f"endpoint merges the pool's experts ({', '.join(pool.tasks)})")
            spec = ctl.session.spec(method, experts=experts, task_weights=task_weights or None,
                                    block_weights=block_weights or None, **params).snap()
            cached = ctl.session.cached(spec, split) is not None
            with ctl.session.batch() if split != "live" else contextlib.nullcontext():
                result = ctl.session.preview(spec, split)
        except MergerError as exc:
            fail(exc)
        if ctl.history is not None and not cached:
            ctl.history.record(ctl.pool_ref, spec, result)
        out = {"spec": spec.as_dict(), **result.to_dict()}
        note = ctl.session.note(spec)  # the page's note under the result ("the merge is the base", …)
        snapped = {name: computed for name, (_, computed) in spec.snapping().items()}
        return {**out, **({"note": note} if note else {}), **({"snapped": snapped} if snapped else {})}

    evaluate.__signature__ = sig
    evaluate.__annotations__ = hints
    evaluate.__doc__ = evaluate_endpoint.__doc__
    return evaluate

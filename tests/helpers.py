"""The tests' small random pools: they live in the package (merger.testing), shared with the
benchmarks and the bad-input catalogue."""
from devtools.testing import TINY_CONFIG, base_and_experts, demo_config, tiny_model, write_pool  # noqa: F401


def controls(ctl, method="task_arithmetic", experts=None, **values):
    """The Merge tab's inputs: experts, method, then one value per registry parameter."""
    from merger.methods import PARAM_NAMES
    from merger.methods.registry import param_record

    defaults = dict(lam=0.3, rank_ratio=0.08, sparsity=0.8, seed=0, steps=5, lr=1e-3, init=0.3, samples=16, k=2,
                    step_size=0.5)
    defaults.update(values)
    for n in PARAM_NAMES:  # any other parameter at its registry default
        defaults.setdefault(n, param_record(n)[1].default)
    return [experts if experts is not None else list(ctl.pool.tasks), method] + [defaults[n] for n in PARAM_NAMES]


def ui_controller(root):
    """A Controller over a small demo-data pool with a history, as the app builds it."""
    import merger
    from merger.io.history import History
    from merger.ui.merge_tab import Controller

    pool = merger.open_pool(write_pool(root, n_experts=3, scale=0.2, demo_data=True))
    return Controller(merger.PoolSession(pool), History(root / "history.sqlite"))


def with_weights(ctl, values, tasks=None, blocks=None):
    """The Merge tab's inputs with the coefficient sliders after the parameter controls."""
    tasks, blocks = tasks or {}, blocks or {}
    return [*values, *[tasks.get(e, 1.0) for e in ctl.weight_experts], *[blocks.get(b, 1.0) for b in ctl.weight_blocks]]


def random_world(n_experts: int = 3, scale: float = 0.05):
    """(base, experts, merged keys, task vectors) of a tiny random CLIP: the methods' formula tests."""
    base, experts = base_and_experts(n_experts=n_experts, scale=scale)
    keys = [k for k in base if k.startswith("visual.") and base[k].is_floating_point()]
    taus = [{k: e[k] - base[k] for k in keys} for e in experts]
    return base, experts, keys, taus


def close(a, b, atol=1e-5):
    """Every tensor of b equals a's of the same name, within atol."""
    import torch

    for k in b:
        assert torch.allclose(a[k], b[k], atol=atol), (k, float((a[k] - b[k]).abs().max()))

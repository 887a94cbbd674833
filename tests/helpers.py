"""The tests' small random pools: they live in the package (merger.testing), shared with the
benchmarks and the bad-input catalogue."""
from merger.testing import TINY_CONFIG, base_and_experts, demo_config, tiny_model, write_pool  # noqa: F401

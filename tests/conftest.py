import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ["MERGER_CACHE_DIR"] = tempfile.mkdtemp(prefix="merger-test-cache-")  # no stale heads
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/, which is not installed

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture
def tiny_pool(tmp_path):
    from helpers import write_pool

    return write_pool(tmp_path, n_experts=3)

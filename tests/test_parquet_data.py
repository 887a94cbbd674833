"""Parquet image datasets (the Hub's format) as task data: the same images give the same numbers as
the demo world they were written from; class names come from the dataset's label feature; bad
datasets are refused naming the file and the column."""
import pytest
import yaml

pytest.importorskip("pyarrow")

import merger  # noqa: E402
from devtools.testing import write_parquet_dataset, write_pool  # noqa: E402
from merger.errors import DataError  # noqa: E402


def parquet_copy(tmp_path, **change):
    """The demo-data pool, and a copy whose tasks read the same images from parquet files."""
    from merger.demo import world

    demo = write_pool(tmp_path / "demo", n_experts=2, demo_data=True, own_images=True)
    spec = yaml.safe_load(demo.read_text())
    for task, info in spec["tasks"].items():
        files = {}
        for split in ("train", "test"):  # the stored splits: val, live and probe are drawn from them
            drawn = info["data"]["demo"][split]
            images, labels = world.generate(drawn["n"], drawn["seed"])
            files[split] = str(write_parquet_dataset(tmp_path / "demo" / "parquet" / task / f"{split}.parquet",
                                                     images, labels[task], world.TASKS[task]))
        info["data"] = {"parquet": {**files, **change.get("entry", {})}}
        if not change.get("keep_classes"):
            del info["classes"]  # from the dataset's label feature
    (tmp_path / "demo" / "parquet.yaml").write_text(yaml.safe_dump(spec))
    return demo, tmp_path / "demo" / "parquet.yaml"


def pool_data(pool, task, split):
    from merger.data.tasks import TaskDataStore

    return TaskDataStore(pool).split(task, split)


def test_parquet_images_give_the_numbers_of_the_images_they_hold(tmp_path):
    demo, copy = parquet_copy(tmp_path)
    a, b = merger.open_pool(demo), merger.open_pool(copy)
    for split in ("live", "val", "test"):
        ra = merger.evaluate(a, merger.merge(a, "task_arithmetic", lam=0.4), split=split)
        rb = merger.evaluate(b, merger.merge(b, "task_arithmetic", lam=0.4), split=split)
        assert ra.accuracy == rb.accuracy and ra.counts == rb.counts
    from merger.data.tasks import TaskDataStore

    store = TaskDataStore(b)
    assert store.classes(b.tasks[0]) == TaskDataStore(a).classes(a.tasks[0])  # the label feature's names
    live = store.split(b.tasks[0], "live")
    assert live.n_source == pool_data(a, a.tasks[0], "test").images.shape[0] and live.images.shape[0] == 96


def test_a_missing_label_column_and_labels_beyond_the_names_are_refused(tmp_path):
    _, copy = parquet_copy(tmp_path, entry={"label": "y"})
    pool = merger.open_pool(copy)
    with pytest.raises(DataError, match=r"no column 'y' \(columns: image, label\)"):
        merger.evaluate(pool, merger.merge(pool, "task_arithmetic", lam=0.4), split="live")
    _, copy = parquet_copy(tmp_path / "few", keep_classes=True)
    spec = yaml.safe_load(copy.read_text())
    task = next(iter(spec["tasks"]))
    spec["tasks"][task]["classes"] = spec["tasks"][task]["classes"][:2]
    copy.write_text(yaml.safe_dump(spec))
    pool = merger.open_pool(copy)
    with pytest.raises(DataError, match=rf"tasks.{task}.classes: 2 names, but the .* split of its data has labels"):
        merger.evaluate(pool, merger.merge(pool, "task_arithmetic", lam=0.4), split="live")

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper
from PIL import Image

from qtool.calibration.dataset import Dataset, InputSpec
from qtool.errors import QtoolError

IMAGE_INPUT = [InputSpec("image", np.dtype(np.float32), ("N", 3, 8, 8))]
TWO_INPUTS = [InputSpec("a", np.dtype(np.float32), ("N", 4)), InputSpec("ids", np.dtype(np.int64), ("N", 2))]


def test_npz_samples_feed_multi_input_models(tmp_path):
    for i in range(3):
        np.savez(tmp_path / f"{i}.npz", a=np.full((4,), i, np.float32), ids=np.array([i, i], np.int64))
    feeds = [feed for _, feed in Dataset(tmp_path, TWO_INPUTS).samples()]
    assert len(feeds) == 3 and feeds[2]["a"].shape == (1, 4) and feeds[2]["ids"].tolist() == [[2, 2]]


def test_onnx_test_data_sets_by_name_or_position(tmp_path):
    for i in range(2):
        folder = tmp_path / f"test_data_set_{i}"
        folder.mkdir()
        # input_0 carries no name (fed by position), input_1 names its input
        (folder / "input_0.pb").write_bytes(numpy_helper.from_array(np.full((1, 4), i, np.float32)).SerializeToString())
        (folder / "input_1.pb").write_bytes(
            numpy_helper.from_array(np.array([[7, i]], np.int64), "ids").SerializeToString()
        )
    dataset = Dataset(tmp_path, TWO_INPUTS)
    assert dataset.format == "onnx-test-data"
    feeds = [feed for _, feed in dataset.samples()]
    assert feeds[1]["a"].tolist() == [[1.0] * 4] and feeds[1]["ids"].tolist() == [[7, 1]]


def write_image(path: Path, size=(12, 10), colour=(200, 100, 50)) -> None:
    Image.new("RGB", size, colour).save(path)


def test_images_are_resized_and_laid_out_from_the_model_shape_by_default(tmp_path):
    write_image(tmp_path / "a.png", colour=(255, 0, 51))
    ((_, feed),) = Dataset(tmp_path, IMAGE_INPUT).samples()
    image = feed["image"]
    assert image.shape == (1, 3, 8, 8) and image.dtype == np.float32
    np.testing.assert_allclose(image[0, :, 0, 0], [1.0, 0.0, 0.2], atol=1e-6)


def test_preprocess_block_resize_crop_normalise_bgr_nhwc(tmp_path):
    write_image(tmp_path / "a.jpg", size=(40, 20), colour=(100, 150, 200))
    spec = [InputSpec("image", np.dtype(np.float32), ("N", 10, 10, 3))]
    preprocess = {
        "resize": 20,
        "center_crop": [10, 10],
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
        "channel_order": "BGR",
        "layout": "NHWC",
    }
    ((_, feed),) = Dataset(tmp_path, spec, preprocess=preprocess).samples()
    pixel = feed["image"][0, 5, 5]
    expected = (np.array([200, 150, 100]) / 255 - 0.5) / 0.25  # BGR order
    np.testing.assert_allclose(pixel, expected, atol=0.02)  # JPEG is lossy


def test_unreadable_image_names_the_file(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(QtoolError, match=r"broken\.png: cannot read image"):
        list(Dataset(tmp_path, IMAGE_INPUT).samples())


def test_mixed_and_empty_directories_are_refused(tmp_path):
    with pytest.raises(QtoolError, match="holds no samples"):
        Dataset(tmp_path, IMAGE_INPUT)
    np.save(tmp_path / "a.npy", np.zeros((3, 8, 8), np.float32))
    write_image(tmp_path / "b.png")
    with pytest.raises(QtoolError, match="mixes sample formats"):
        Dataset(tmp_path, IMAGE_INPUT)


def test_non_finite_samples_fail_or_are_skipped_and_counted(tmp_path):
    np.save(tmp_path / "0.npy", np.zeros((3, 8, 8), np.float32))
    bad = np.zeros((3, 8, 8), np.float32)
    bad[0, 1, 1] = np.nan
    np.save(tmp_path / "1.npy", bad)
    with pytest.raises(QtoolError, match=r"1\.npy: input 'image' holds NaN or Inf"):
        list(Dataset(tmp_path, IMAGE_INPUT).samples())
    dataset = Dataset(tmp_path, IMAGE_INPUT, skip_nonfinite=True)
    assert [p.name for p, _ in dataset.samples()] == ["0.npy"] and [p.name for p in dataset.skipped] == ["1.npy"]


def test_shards_partition_the_samples(tmp_path):
    for i in range(7):
        np.save(tmp_path / f"{i}.npy", np.zeros((3, 8, 8), np.float32))
    shards = [[p.name for p in Dataset(tmp_path, IMAGE_INPUT, shard=(k, 3)).files] for k in (1, 2, 3)]
    assert sorted(name for shard in shards for name in shard) == sorted(f"{i}.npy" for i in range(7))
    assert shards[0] == ["0.npy", "3.npy", "6.npy"]


def test_batches_concatenate_samples_when_the_batch_is_dynamic(tmp_path):
    for i in range(5):
        np.save(tmp_path / f"{i}.npy", np.full((3, 8, 8), i, np.float32))
    batches = list(Dataset(tmp_path, IMAGE_INPUT).batches(2))
    assert [len(paths) for paths, _ in batches] == [2, 2, 1]
    assert [p.name for paths, _ in batches for p in paths] == [f"{i}.npy" for i in range(5)]
    assert [feed["image"].shape[0] for _, feed in batches] == [2, 2, 1]
    fixed = [InputSpec("image", np.dtype(np.float32), (1, 3, 8, 8))]
    assert [len(paths) for paths, _ in Dataset(tmp_path, fixed).batches(4)] == [1] * 5


def test_samples_with_different_dynamic_sizes_are_batched_separately(tmp_path):
    spec = [InputSpec("x", np.dtype(np.float32), ("N", "L", 4))]
    for i, length in enumerate([3, 3, 5, 5, 5]):
        np.save(tmp_path / f"{i}.npy", np.zeros((length, 4), np.float32))
    shapes = [feed["x"].shape for _, feed in Dataset(tmp_path, spec).batches(4)]
    assert shapes == [(2, 3, 4), (3, 5, 4)]


def test_an_input_without_shape_accepts_any_rank_and_odd_pb_names_do_not_crash(tmp_path):
    spec = [InputSpec("x", np.dtype(np.float32), None)]
    folder = tmp_path / "test_data_set_0"
    folder.mkdir()
    (folder / "input_x.pb").write_bytes(numpy_helper.from_array(np.ones((2, 3), np.float32), "x").SerializeToString())
    ((_, feed),) = Dataset(tmp_path, spec).samples()
    assert feed["x"].shape == (2, 3)


def test_integer_image_inputs_take_raw_pixels(tmp_path):
    write_image(tmp_path / "a.png", colour=(200, 100, 50))
    spec = [InputSpec("image", np.dtype(np.uint8), (1, 8, 8, 3))]
    ((_, feed),) = Dataset(tmp_path, spec).samples()
    assert feed["image"].dtype == np.uint8 and feed["image"][0, 0, 0].tolist() == [200, 100, 50]

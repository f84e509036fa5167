"""The CIFAR-10 reader on small files written here in the real `cifar-10-batches-py` format (and
packed as the real .tar.gz): values, order, labels, the training transform, determinism per
(seed, epoch, sample), DistributedSampler, and the message for a missing dataset.

    pytest tests/ddp/test_cifar10.py -q
"""

import io
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_from_scratch.workload import cifar10
from ddp_from_scratch.workload.cifar10 import CIFAR10, DatasetMissing, SyntheticCIFAR10, augment, sample_generator

PER_BATCH = 4


def _batch(start):
    """A batch dict as the real files hold it: b'data' (N, 3072) uint8 rows (R, then G, then B planes)."""
    data = np.zeros((PER_BATCH, 3072), dtype=np.uint8)
    for i in range(PER_BATCH):
        data[i] = (np.arange(3072) + start + i) % 251
    return {b"batch_label": b"x", b"labels": [(start + i) % 10 for i in range(PER_BATCH)],
            b"data": data, b"filenames": [b"f"] * PER_BATCH}


def _write(root, as_archive):
    files = {name: _batch(10 * k) for k, name in enumerate(cifar10.TRAIN_FILES + cifar10.TEST_FILES)}
    if as_archive:
        with tarfile.open(os.path.join(root, cifar10.ARCHIVE), "w:gz") as tar:
            for name, batch in files.items():
                blob = pickle.dumps(batch, protocol=2)
                info = tarfile.TarInfo(f"{cifar10.FOLDER}/{name}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    else:
        os.makedirs(os.path.join(root, cifar10.FOLDER))
        for name, batch in files.items():
            with open(os.path.join(root, cifar10.FOLDER, name), "wb") as f:
                pickle.dump(batch, f, protocol=2)


@pytest.mark.parametrize("as_archive", [False, True])
def test_reads_the_real_format(tmp_path, as_archive):
    _write(tmp_path, as_archive)
    train, test = CIFAR10(tmp_path, train=True), CIFAR10(tmp_path, train=False)
    assert len(train) == 5 * PER_BATCH and len(test) == PER_BATCH
    image, label = train[PER_BATCH + 1]  # second image of data_batch_2 (start 10)
    assert label == 11 % 10
    raw = torch.from_numpy(((np.arange(3072) + 10 + 1) % 251).astype(np.float32).reshape(3, 32, 32))
    torch.testing.assert_close(image, (raw / 255 - 0.5) / 0.5)  # planes R, G, B; mean 0.5, std 0.5
    assert test[0][1] == 50 % 10


def test_augmentation_is_deterministic_per_seed_epoch_sample(tmp_path):
    _write(tmp_path, False)
    a, b = CIFAR10(tmp_path, augment=True, seed=7), CIFAR10(tmp_path, augment=True, seed=7)
    assert torch.equal(a[3][0], b[3][0])
    a.set_epoch(1)
    assert not torch.equal(a[3][0], b[3][0])  # a new epoch, new choices
    b.set_epoch(1)
    assert torch.equal(a[3][0], b[3][0])
    assert not torch.equal(CIFAR10(tmp_path, augment=True, seed=8)[3][0], CIFAR10(tmp_path, augment=True, seed=7)[3][0])


def test_augmentation_differs_between_the_samples_of_one_batch():
    """Every image the same: a batch's augmented images must still differ (a generator seeded
    without the sample index would crop and flip them all alike)."""
    data = SyntheticCIFAR10(16, augment=True, seed=3)
    data.images[:] = data.images[0]
    x, _ = next(iter(torch.utils.data.DataLoader(data, batch_size=16)))
    distinct = {tuple(img.flatten().tolist()) for img in x}
    assert len(distinct) >= 8, f"only {len(distinct)} different augmentations in a batch of 16"


def test_crop_and_flip_keep_the_pixels():
    image = torch.arange(3 * 32 * 32, dtype=torch.float32).view(3, 32, 32) + 1  # no zeros
    seen_flip = seen_shift = False
    for i in range(40):
        out = augment(image, sample_generator(0, 0, i))
        assert out.shape == (3, 32, 32)
        inner = out[out != 0]  # what is not padding comes from the image, rows intact
        assert set(inner.tolist()) <= set(image.flatten().tolist())
        seen_flip |= bool((out[0, 16, 1:] - out[0, 16, :-1] < 0).any() & (out[0, 16] != 0).all())
        seen_shift |= bool((out == 0).any())
    assert seen_flip and seen_shift


def test_distributed_sampler_splits_the_set(tmp_path):
    _write(tmp_path, False)
    data = CIFAR10(tmp_path)
    parts = [list(DistributedSampler(data, num_replicas=2, rank=r, seed=3)) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == list(range(len(data)))


def test_missing_dataset_says_how_to_get_it(tmp_path):
    with pytest.raises(DatasetMissing) as info:
        CIFAR10(tmp_path / "nowhere")
    message = str(info.value)
    assert "cifar-10-python.tar.gz" in message and cifar10.URL in message and "--synthetic" in message


def test_synthetic_is_deterministic_and_labelled_as_such():
    a, b = SyntheticCIFAR10(100, seed=1), SyntheticCIFAR10(100, seed=1)
    assert a.synthetic and len(a) == 100
    assert torch.equal(a[5][0], b[5][0]) and a[5][1] == b[5][1]
    assert not torch.equal(SyntheticCIFAR10(100, seed=2)[5][0], a[5][0])


@pytest.mark.parametrize("damage", ["truncated archive", "empty batch file", "truncated batch file", "not a batch"])
def test_damaged_files_are_named_in_one_line(tmp_path, damage):
    as_archive = damage == "truncated archive"
    _write(tmp_path, as_archive)
    if as_archive:
        path = tmp_path / cifar10.ARCHIVE
        path.write_bytes(path.read_bytes()[:600])
    else:
        path = tmp_path / cifar10.FOLDER / "data_batch_3"
        blob = path.read_bytes()
        path.write_bytes({"empty batch file": b"", "truncated batch file": blob[: len(blob) // 2],
                          "not a batch": pickle.dumps({"x": 1})}[damage])
    with pytest.raises(cifar10.DatasetCorrupt) as info:
        CIFAR10(tmp_path, train=True)
    message = str(info.value)
    assert str(path) in message and "is damaged" in message and "\n" not in message, message


def test_train_names_a_damaged_file_before_starting(tmp_path, capsys):
    from ddp_from_scratch import train

    _write(tmp_path, False)
    (tmp_path / cifar10.FOLDER / "data_batch_5").write_bytes(b"")
    with pytest.raises(SystemExit) as info:
        train.main(["--data", str(tmp_path), "--batch-size", "2"])
    assert info.value.code == 2
    assert "data_batch_5 is damaged" in capsys.readouterr().err

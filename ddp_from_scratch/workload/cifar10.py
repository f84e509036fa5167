"""CIFAR-10 from the standard `cifar-10-batches-py` files (or the `.tar.gz` they come in), with the
training transform done on tensors and random choices fixed by (seed, epoch, sample).

    train = CIFAR10("data", train=True, augment=True, seed=0)
    sampler = DistributedSampler(train, num_replicas=env.world_size, rank=env.rank, seed=0)
    sampler.set_epoch(epoch); train.set_epoch(epoch)     # both: shuffle order and augmentation
    image, label = train[i]                              # (3, 32, 32) float32, int

Get the data (about 163 MiB) from https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz and put
the `.tar.gz`, or the `cifar-10-batches-py` folder unpacked from it, under the root folder.
`SyntheticCIFAR10` is a deterministic stand-in of the same shapes for machines without the data;
programs use it only when asked (`--synthetic`) and say so in every output.
"""

from __future__ import annotations

import os
import pickle
import tarfile
import zlib
from typing import List, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
FOLDER = "cifar-10-batches-py"
ARCHIVE = "cifar-10-python.tar.gz"
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILES = ["test_batch"]
# Mean 0.5 and std 0.5 per channel, as the tutorial "Understanding Distributed Training in PyTorch"
# (2024) normalises CIFAR-10.
MEAN = (0.5, 0.5, 0.5)
STD = (0.5, 0.5, 0.5)


class DatasetMissing(FileNotFoundError):
    """The CIFAR-10 files are not where they were looked for; the message says how to get them."""


class DatasetCorrupt(ValueError):
    """A CIFAR-10 file is there but damaged (truncated download, wrong file); the message names it."""


def _damaged(path: str, why: str) -> DatasetCorrupt:
    return DatasetCorrupt(f"{path} is damaged ({why}); delete it and download {URL} again")


def _missing(root: str) -> DatasetMissing:
    return DatasetMissing(
        f"CIFAR-10 not found under {os.path.abspath(root)!r}: expected {FOLDER}/ (data_batch_1..5, test_batch) "
        f"or {ARCHIVE}. Download {URL} and put it there (unpacking is optional), "
        "or run with --synthetic for a deterministic stand-in of the same shapes."
    )


def _unpickle(stream, path: str) -> Tuple[np.ndarray, List[int]]:
    """One batch file; a file that is not a whole CIFAR-10 batch raises DatasetCorrupt naming `path`."""
    try:
        batch = pickle.load(stream, encoding="bytes")
    except EOFError:
        raise _damaged(path, "it ends early: a truncated download?") from None
    except Exception as exc:  # UnpicklingError, a gzip/tar read error inside an archive, ...
        raise _damaged(path, f"not a CIFAR-10 batch: {type(exc).__name__}: {exc}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise _damaged(path, "not a CIFAR-10 batch: no b'data' and b'labels' in it")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = list(batch[b"labels"])
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != len(labels):
        raise _damaged(path, f"data of shape {data.shape} for {len(labels)} labels; expected (N, 3072)")
    return data.reshape(-1, 3, 32, 32), labels  # (N, C, H, W), the files' order


def load_arrays(root: str, train: bool) -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 3, 32, 32), labels int64 (N,)) from the folder or the archive."""
    names = TRAIN_FILES if train else TEST_FILES
    parts = []
    folder, archive = os.path.join(root, FOLDER), os.path.join(root, ARCHIVE)
    if os.path.isdir(folder):
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                raise DatasetMissing(f"{path} is missing; the folder {folder} is incomplete. {_missing(root)}")
            with open(path, "rb") as f:
                parts.append(_unpickle(f, path))
    elif os.path.exists(archive):
        try:
            with tarfile.open(archive, "r:gz") as tar:
                for name in names:
                    try:
                        member = tar.extractfile(f"{FOLDER}/{name}")
                    except KeyError:
                        member = None
                    if member is None:
                        raise _damaged(archive, f"it has no {FOLDER}/{name}")
                    parts.append(_unpickle(member, f"{archive} ({FOLDER}/{name})"))
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise _damaged(archive, f"cannot be read as .tar.gz: {type(exc).__name__}: {exc}") from None
    else:
        raise _missing(root)
    images = np.concatenate([p[0] for p in parts])
    labels = np.asarray([label for p in parts for label in p[1]], dtype=np.int64)
    return images, labels


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The random choices for one sample in one epoch: the same in every program with that seed."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch * 100_003 + index) % (2**63))


def augment(image: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crop of the zero-padded image back to its size, then a random horizontal flip."""
    _, h, w = image.shape  # (C, H, W)
    padded = torch.nn.functional.pad(image, (padding, padding, padding, padding))
    top, left, flip = torch.randint(0, 2 * padding + 1, (2,), generator=generator).tolist() + \
        [torch.randint(0, 2, (1,), generator=generator).item()]
    out = padded[:, top:top + h, left:left + w]
    return out.flip(-1) if flip else out


class _Images(Dataset):
    """Shared by the real and the synthetic set: uint8 images -> normalised float tensors."""

    synthetic = False

    def __init__(self, images: np.ndarray, labels: np.ndarray, augment: bool, seed: int):
        self.images = torch.from_numpy(images)  # (N, 3, 32, 32) uint8
        self.labels = torch.from_numpy(labels)
        self.augment, self.seed, self.epoch = augment, seed, 0
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def set_epoch(self, epoch: int) -> None:
        """Like DistributedSampler.set_epoch: new augmentation choices each epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = self.images[index].float().div_(255)
        if self.augment:
            image = augment(image, sample_generator(self.seed, self.epoch, index))
        return (image - self.mean) / self.std, int(self.labels[index])


class CIFAR10(_Images):
    """The real CIFAR-10: 50,000 training or 10,000 test images. Raises DatasetMissing if absent.

    Args:
        root: the folder holding cifar-10-batches-py/ or cifar-10-python.tar.gz.
        train: the training set (data_batch_1..5) or the test set (test_batch).
        augment: random crop with 4-pixel padding and horizontal flip (training transform).
        seed: fixes the augmentation, with the epoch and the sample index.
    """

    def __init__(self, root: str, train: bool = True, augment: bool = False, seed: int = 0):
        super().__init__(*load_arrays(root, train), augment=augment, seed=seed)


class SyntheticCIFAR10(_Images):
    """A deterministic CIFAR-shaped set (images and labels from `seed`), for runs without the data."""

    synthetic = True

    def __init__(self, size: int = 50_000, augment: bool = False, seed: int = 0):
        rng = np.random.default_rng(seed)
        labels = rng.integers(0, 10, size, dtype=np.int64)
        # class-dependent colour so that a model can learn something from it
        base = (labels[:, None, None, None] * 23 + np.arange(3)[None, :, None, None] * 60) % 256
        images = rng.integers(0, 64, (size, 3, 32, 32))  # the noise, then (in place: no int64 copies) the images
        images += base
        images %= 256
        super().__init__(images.astype(np.uint8), labels, augment=augment, seed=seed)

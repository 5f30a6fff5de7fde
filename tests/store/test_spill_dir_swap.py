"""Issue 27.6(a): the owner of ``nvme_dir`` renames the private spill directory away and plants
a look-alike between two spills. No spilled byte may land in the planted file, every spilled
extent must read back verified, and closing must delete nothing in the planted directory."""

import logging
import os

import pytest
import torch

from tiermem.store.io import make_backend
from tiermem.store.nvme import SPILL_FILE_NAME, SpillSpace

NBYTES = 256 << 10


def _bytes(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("backend", ["posix", "aiofiles"])
def test_a_planted_look_alike_directory_gets_no_spilled_byte(tmp_path, backend, caplog):
    space = SpillSpace(tmp_path, 4 << 20, backend=make_backend(backend, 2), o_direct=False,
                       chunk_bytes=64 << 10, owns_backend=True)
    private = space.dir_path
    first = _bytes(1)
    e1 = space.write("first", first, NBYTES).result()

    moved = str(tmp_path / "moved-away")
    os.rename(private, moved)  # the other user's move: rename the private directory away...
    os.mkdir(private, 0o700)   # ... and plant a look-alike with a spill file of their own
    planted = os.path.join(private, SPILL_FILE_NAME)
    with open(planted, "wb"):
        pass

    second = _bytes(2)
    e2 = space.write("second", second, NBYTES).result()  # the whole next spill
    assert os.path.getsize(planted) == 0  # nothing went into their file
    for extent, want in ((e1, first), (e2, second)):  # both read back, checksums verified
        out = torch.empty(NBYTES, dtype=torch.uint8)
        space.read("k", extent, out).result()
        assert torch.equal(out, want)
    assert os.path.getsize(os.path.join(moved, SPILL_FILE_NAME)) >= 2 * NBYTES

    with caplog.at_level(logging.WARNING, logger="tiermem"):
        space.close()
    assert os.listdir(private) == [SPILL_FILE_NAME]  # their directory and file stay
    assert os.listdir(moved) == []  # our own files went, through the directory we hold
    assert any(private in r.getMessage() and "replaced" in r.getMessage()
               for r in caplog.records)  # and the swap was reported, naming the path


def test_a_directory_that_is_not_private_is_refused_naming_it(tmp_path):
    from tiermem.store.spill_dir import PrivateDir

    shared = tmp_path / "not-private"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(OSError, match="not-private.* is not this user's private directory"):
        PrivateDir(str(shared))
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(OSError):  # never through a symlink
        PrivateDir(str(link))
    assert shared.is_dir()  # refused, left alone

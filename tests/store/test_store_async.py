"""TierStore's asyncio API (issue 27.3): ``aget`` results keep their bytes while other tasks
``aput``/``aget`` on the same store and the tiers evict under them."""

import asyncio

import pytest
import torch

from tiermem import StoreConfig, TierStore

KEY_BYTES = 64 << 10
TASKS = 8
ROUNDS = 8
SCRATCH = 3


def value(task: int, i: int) -> torch.Tensor:
    """A key's tensor: every element says which task and round wrote it."""
    return torch.full((KEY_BYTES // 4,), float(task * 1000 + i), dtype=torch.float32)


def make(tmp_path) -> TierStore:
    # 16 keys fit in the cpu tier (room for one held key per task and the keys being put); the
    # 8 * 24 scratch puts between an aget and its check evict the key read, unless held
    return TierStore(StoreConfig(gpu_bytes=0, cpu_bytes=16 * KEY_BYTES, nvme_bytes=16 << 20,
                                 nvme_dir=str(tmp_path), pool_slab_bytes=KEY_BYTES,
                                 io_backend="posix", io_threads=2, io_chunk_bytes=KEY_BYTES))


@pytest.mark.parametrize("hold", [False, True])
def test_aget_results_keep_their_bytes_while_other_tasks_evict(tmp_path, hold):
    store = make(tmp_path)
    wrong: list = []
    reads = 0

    async def task(t: int) -> None:
        nonlocal reads
        for i in range(ROUNDS):
            await store.aput((t, i), value(t, i), "cpu")
            for j in range(i + 1):  # read back every key this task wrote, one by one
                got = await store.aget((t, j), "cpu", hold=hold)
                await asyncio.sleep(0)  # the other tasks put and get (evicting) meanwhile
                for m in range(SCRATCH):  # and so does this one
                    await store.aput((t, "scratch", m), value(t, 900 + m), "cpu")
                reads += 1
                if not torch.equal(got, value(t, j)):
                    wrong.append(((t, j), got[0].item()))
                if hold:
                    store.release((t, j))

    async def main() -> None:
        await asyncio.gather(*(task(t) for t in range(TASKS)))

    try:
        asyncio.run(main())
        assert reads == TASKS * ROUNDS * (ROUNDS + 1) // 2
        assert wrong == []  # no result held another key's bytes when its task read it
        assert store.stats()["moved_bytes"].get("cpu->nvme", 0) > 0  # it really evicted
    finally:
        store.close()

import pytest
import torch

from paratrain.config.length import steps_per_epoch
from paratrain.data.batches import epoch_permutation, eval_range, global_batch, worker_part


@pytest.mark.parametrize("n,batch,world", [(1000, 100, 1), (1000, 100, 2), (1000, 96, 4), (1003, 64, 8)])
def test_every_index_once_per_epoch(n: int, batch: int, world: int) -> None:
    perm = epoch_permutation(n, seed=3, epoch=1)
    seen = []
    for step in range(steps_per_epoch(n, batch)):
        gb = global_batch(perm, step, batch)
        parts = [worker_part(gb, r, world) for r in range(world)]
        assert all(len(p) == batch // world for p in parts)
        assert torch.equal(torch.cat(parts), gb)  # the workers' parts are the global batch, in order
        seen.append(gb)
    seen = torch.cat(seen)
    assert len(seen) == n - n % batch  # the last partial batch is dropped...
    assert len(set(seen.tolist())) == len(seen)  # ...and no index repeats


def test_global_batch_does_not_depend_on_worker_count() -> None:
    perm = epoch_permutation(600, seed=0, epoch=0)
    gb = global_batch(perm, 2, 120)
    assert torch.equal(torch.cat([worker_part(gb, r, 4) for r in range(4)]),
                       torch.cat([worker_part(gb, r, 2) for r in range(2)]))


def test_permutation_is_seeded_per_epoch() -> None:
    a = epoch_permutation(500, 7, 0)
    assert torch.equal(a, epoch_permutation(500, 7, 0))
    assert not torch.equal(a, epoch_permutation(500, 7, 1))
    assert not torch.equal(a, epoch_permutation(500, 8, 0))
    assert sorted(a.tolist()) == list(range(500))


def test_uneven_batch_is_refused() -> None:
    with pytest.raises(ValueError):
        worker_part(torch.arange(10), 0, 3)


@pytest.mark.parametrize("n,world", [(10_000, 1), (10_000, 3), (7, 4), (3, 8), (0, 2)])
def test_eval_ranges_partition_without_padding(n: int, world: int) -> None:
    ranges = [eval_range(n, r, world) for r in range(world)]
    covered = [i for r in ranges for i in r]
    assert covered == list(range(n))  # contiguous, each index exactly once, nothing added
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_the_data_order_is_the_one_older_checkpoints_were_trained_with() -> None:
    """A resumed run must draw the order its first half drew, also across paratrain versions: any other
    seeding (a changed formula) would be just as random, and would silently change a resumed run's data."""
    assert epoch_permutation(12, 0, 0).tolist() == [8, 0, 5, 9, 7, 4, 2, 10, 3, 1, 11, 6]
    assert epoch_permutation(12, 3, 2).tolist() == [6, 11, 9, 5, 4, 0, 3, 10, 8, 7, 1, 2]
